//! Sleeps for an hour in every `log` call: blocked inside a host call (a
//! WASI clock poll), where the epoch deadline cannot reach it.
use hearth_guest::{export_tracker, Entries, Tracker};

#[derive(Default)]
struct Sleep;

impl Tracker for Sleep {
    fn log(&mut self, _step: u64, _values: Entries) -> Result<(), String> {
        std::thread::sleep(std::time::Duration::from_secs(3600));
        Ok(())
    }
}

export_tracker!(Sleep);
