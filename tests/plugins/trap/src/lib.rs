//! Traps (panics) in its first `log` call, then behaves: shows that a trap
//! drops the instance, a fresh one is made, `start` is replayed, and later
//! steps still arrive. Records what it sees in /logs/seen.txt.
use hearth_guest::{export_tracker, Entries, Start, Tracker};
use std::io::Write;

fn note(line: &str) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open("/logs/seen.txt")
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

#[derive(Default)]
struct Trap;

impl Tracker for Trap {
    fn start(&mut self, _start: Start) -> Result<(), String> {
        note("start");
        Ok(())
    }
    fn log(&mut self, step: u64, _values: Entries) -> Result<(), String> {
        if std::fs::read_to_string("/logs/seen.txt")
            .unwrap_or_default()
            .contains("trapped")
        {
            note(&format!("log {step}"));
            return Ok(());
        }
        note("trapped");
        panic!("fixture trap at step {step}");
    }
}

export_tracker!(Trap);
