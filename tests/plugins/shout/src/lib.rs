//! Prints one 100 MB line to stdout (in 1 MiB writes, so its own memory stays
//! small), then logs normally into /logs/steps.txt.
use hearth_guest::{export_tracker, Entries, Start, Tracker};
use std::io::Write;

#[derive(Default)]
struct Shout;

impl Tracker for Shout {
    fn start(&mut self, _start: Start) -> Result<(), String> {
        let chunk = vec![b'x'; 1 << 20];
        let mut out = std::io::stdout().lock();
        for _ in 0..100 {
            out.write_all(&chunk).map_err(|e| e.to_string())?;
        }
        out.write_all(b"\n")
            .and_then(|_| out.flush())
            .map_err(|e| e.to_string())
    }
    fn log(&mut self, step: u64, _values: Entries) -> Result<(), String> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open("/logs/steps.txt")
            .map_err(|e| e.to_string())?;
        writeln!(f, "{step}").map_err(|e| e.to_string())
    }
}

export_tracker!(Shout);
