//! Loops forever in every `log` call.
use hearth_guest::{export_tracker, Entries, Tracker};

#[derive(Default)]
struct Spin;

impl Tracker for Spin {
    fn log(&mut self, step: u64, _values: Entries) -> Result<(), String> {
        let mut n = step;
        loop {
            n = std::hint::black_box(n.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
}

export_tracker!(Spin);
