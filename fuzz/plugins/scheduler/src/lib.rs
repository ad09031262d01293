//! A scheduler whose every answer comes from the fuzzer's script (the hex
//! string `script` in its options, or the state given to `load`): rates of
//! any count and value, errors, traps, output.
use hearth_guest::{export_scheduler, Scheduler};
use std::cell::RefCell;

#[path = "../../script.rs"]
mod script;
use script::Script;

/// Runs the script's next step: output, an error or a trap.
fn act(s: &mut Script) -> Result<(), String> {
    let op = s.u8();
    if op & 1 != 0 {
        s.chatter();
    }
    if op & 0x0c == 0x0c {
        panic!("fuzz scheduler traps on purpose");
    }
    if op & 2 != 0 {
        return Err(s.text());
    }
    if op & 0xf0 == 0xf0 {
        // Grows until the host's memory cap stops it.
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            hoard.push(vec![1u8; 4 << 20]);
            std::hint::black_box(&hoard);
        }
    }
    Ok(())
}

struct Fuzz {
    script: RefCell<Script>,
    base: Vec<f64>,
}

impl Scheduler for Fuzz {
    fn create(options_json: &str, base_lrs: Vec<f64>, _total: Option<u64>) -> Result<Self, String> {
        let mut s = Script::from_hex_in(options_json, "script");
        act(&mut s)?;
        Ok(Self {
            script: RefCell::new(s),
            base: base_lrs,
        })
    }

    fn lrs(&self, step: u64) -> Vec<f64> {
        let mut s = self.script.borrow_mut();
        if s.done() {
            return self.base.clone();
        }
        let op = s.u8();
        if op & 1 != 0 {
            s.chatter();
        }
        if op & 0x0e == 0x0e {
            panic!("fuzz scheduler traps in lrs at step {step}");
        }
        match op >> 4 & 3 {
            0 => self.base.clone(),
            1 => {
                let f = s.f64();
                self.base.iter().map(|lr| lr * f).collect()
            }
            _ => (0..s.u8() % 6).map(|_| s.f64()).collect(),
        }
    }

    fn observe(&mut self, _metric: f64) {
        if act(self.script.get_mut()).is_err() {
            panic!("fuzz scheduler traps in observe");
        }
    }

    fn save(&self) -> Vec<u8> {
        self.script.borrow_mut().bytes()
    }

    fn load(&mut self, state: &[u8]) -> Result<(), String> {
        let mut s = Script::new(state.to_vec());
        act(&mut s)?;
        *self.script.get_mut() = s;
        Ok(())
    }
}

export_scheduler!(Fuzz);
