//! A wrap policy whose answer comes from the fuzzer's script (the hex
//! string `script` in its options): paths of the model's modules or any
//! text, errors, traps, output.
use hearth_guest::{export_wrap_policy, Module, WrapPolicy};

#[path = "../../script.rs"]
mod script;
use script::Script;

struct Fuzz;

impl WrapPolicy for Fuzz {
    fn units(options_json: &str, modules: &[Module]) -> Result<Vec<String>, String> {
        let mut s = Script::from_hex_in(options_json, "script");
        let op = s.u8();
        if op & 1 != 0 {
            s.chatter();
        }
        if op & 0x0c == 0x0c {
            panic!("fuzz wrap policy traps on purpose");
        }
        if op & 2 != 0 {
            return Err(s.text());
        }
        let mut paths = Vec::new();
        for _ in 0..s.u8() % 12 {
            let pick = s.u8();
            if pick < 160 && !modules.is_empty() {
                let m = &modules[pick as usize % modules.len()];
                paths.push(m.path.clone());
            } else if pick < 200 && !modules.is_empty() {
                // A real path with a twist: a suffix, a prefix cut short.
                let m = &modules[pick as usize % modules.len()];
                let mut p = m.path.clone();
                p.push_str(&s.text());
                paths.push(p);
            } else {
                paths.push(s.text());
            }
        }
        Ok(paths)
    }
}

export_wrap_policy!(Fuzz);
