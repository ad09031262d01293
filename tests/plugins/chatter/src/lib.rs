//! Prints 5 000 short lines to stdout on every call.
use hearth_guest::{export_tracker, Entries, Start, Tracker};

#[derive(Default)]
struct Chatter;

fn chatter(call: &str) {
    for i in 0..5_000 {
        println!("chatter {call} line {i}");
    }
}

impl Tracker for Chatter {
    fn start(&mut self, _start: Start) -> Result<(), String> {
        chatter("start");
        Ok(())
    }
    fn log(&mut self, step: u64, _values: Entries) -> Result<(), String> {
        chatter(&format!("log {step}"));
        Ok(())
    }
}

export_tracker!(Chatter);
