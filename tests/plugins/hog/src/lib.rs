//! Allocates without bound in every `log` call.
use hearth_guest::{export_tracker, Entries, Tracker};

#[derive(Default)]
struct Hog(Vec<Vec<u8>>);

impl Tracker for Hog {
    fn log(&mut self, _step: u64, _values: Entries) -> Result<(), String> {
        loop {
            self.0.push(vec![1u8; 1 << 20]);
        }
    }
}

export_tracker!(Hog);
