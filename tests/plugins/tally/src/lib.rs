//! A summary-statistics tracker written to the fault contract: count, min,
//! max and sum of every logged value, kept in /logs/tally.txt after each
//! step and read back when a fresh instance starts after a fault, so the
//! numbers come out complete. It panics on purpose, from its options:
//! `panic-steps` (comma-separated steps) each panic `panics` times, after
//! the step is counted and saved when `count-then-panic` (the contract's
//! "the failed instance may have done part of the call"), before it
//! otherwise. Each `start` with `restart` set is noted in
//! /logs/restarts.txt (count, call, step, again, values lost), and
//! `finish` writes /logs/finished.
use hearth_guest::files::write_atomically;
use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use std::collections::BTreeMap;

#[derive(Default)]
struct Tally {
    /// name → (count, min, max, sum)
    stats: BTreeMap<String, (u64, f64, f64, f64)>,
    /// `log` calls applied (the index of the next one).
    done: u64,
    /// The next call is one the failed instance already applied.
    skip_next: bool,
    /// step → times it panicked
    panicked: BTreeMap<u64, u64>,
    panic_steps: Vec<u64>,
    panics: u64,
    count_then_panic: bool,
}

const STATE: &str = "/logs/tally.txt";

impl Tally {
    fn save(&self) -> Result<(), String> {
        let mut text = String::new();
        text += &format!("done {}\n", self.done);
        for (step, n) in &self.panicked {
            text += &format!("panicked {step} {n}\n");
        }
        for (name, (count, min, max, sum)) in &self.stats {
            text += &format!("stat {name} {count} {min:?} {max:?} {sum:?}\n");
        }
        write_atomically(STATE, &text)
    }

    fn load(&mut self) {
        let text = std::fs::read_to_string(STATE).unwrap_or_default();
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            match f[..] {
                ["done", n] => self.done = n.parse().unwrap(),
                ["panicked", step, n] => {
                    self.panicked
                        .insert(step.parse().unwrap(), n.parse().unwrap());
                }
                ["stat", name, count, min, max, sum] => {
                    let p = |s: &str| s.parse::<f64>().unwrap();
                    self.stats.insert(
                        name.into(),
                        (count.parse().unwrap(), p(min), p(max), p(sum)),
                    );
                }
                _ => {}
            }
        }
    }
}

impl Tally {
    /// Panics if `step` is one to panic at and has not yet panicked
    /// `panics` times (counted in the saved state, so across instances).
    fn maybe_panic(&mut self, step: u64) -> Result<(), String> {
        let times = self.panicked.get(&step).copied().unwrap_or(0);
        if self.panic_steps.contains(&step) && times < self.panics {
            self.panicked.insert(step, times + 1);
            self.save()?;
            panic!("tally panics at step {step} (time {})", times + 1);
        }
        Ok(())
    }
}

impl Tracker for Tally {
    fn start(&mut self, start: Start) -> Result<(), String> {
        if let Some(Value::Text(steps)) = start.option("panic-steps") {
            self.panic_steps = steps
                .split(',')
                .filter_map(|s| s.trim().parse().ok())
                .collect();
        }
        if let Some(Value::Int(n)) = start.option("panics") {
            self.panics = *n as u64;
        }
        if let Some(Value::Boolean(b)) = start.option("count-then-panic") {
            self.count_then_panic = *b;
        }
        if let Some(r) = &start.restart {
            let step = r.step.map(|s| s.to_string()).unwrap_or("-".into());
            let line = format!(
                "{} {} {step} {} {}\n",
                r.count, r.call, r.again, r.values_lost
            );
            let before = std::fs::read_to_string("/logs/restarts.txt").unwrap_or_default();
            write_atomically("/logs/restarts.txt", &(before + &line))?;
        }
        // A new run finds /logs empty; a restart finds what was counted.
        self.load();
        if let Some(r) = &start.restart {
            if let Some(index) = r.log_index {
                // Applied by the failed instance before it failed: once is enough.
                self.skip_next = r.again && self.done > index;
                if !r.again {
                    self.done = self.done.max(index + 1); // lost, not coming again
                }
            }
        }
        Ok(())
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        if !self.count_then_panic {
            self.maybe_panic(step)?;
        }
        if std::mem::take(&mut self.skip_next) {
            // Delivered again after a fault, but already counted.
        } else {
            for (name, value) in values {
                let v = match value {
                    Value::Float(v) => v,
                    Value::Int(i) => i as f64,
                    _ => continue,
                };
                let s =
                    self.stats
                        .entry(name)
                        .or_insert((0, f64::INFINITY, f64::NEG_INFINITY, 0.0));
                *s = (s.0 + 1, s.1.min(v), s.2.max(v), s.3 + v);
            }
            self.done += 1;
        }
        self.save()?;
        self.maybe_panic(step)
    }

    fn finish(&mut self) -> Result<(), String> {
        write_atomically("/logs/finished", "")
    }
}

export_tracker!(Tally);
