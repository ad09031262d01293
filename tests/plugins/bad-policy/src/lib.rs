//! A wrap policy that misbehaves as its options say (`{"misbehave": …}`
//! anywhere in the options JSON): `trap` panics, `hang` never returns,
//! `err` returns an error, `missing` names a module the model lacks,
//! `chatter` prints 1500 numbered lines and then behaves, and anything
//! else wraps every `Block`. Shows that a wrap policy fails closed, naming
//! the plugin, before training starts, and that its output budget is the
//! run config's `[plugin-limits]`.
use hearth_guest::{export_wrap_policy, Module, WrapPolicy};

struct BadPolicy;

impl WrapPolicy for BadPolicy {
    fn units(options_json: &str, modules: &[Module]) -> Result<Vec<String>, String> {
        let wants = |mode: &str| options_json.contains(&format!("\"{mode}\""));
        if wants("trap") {
            panic!("fixture wrap policy trapped");
        }
        if wants("hang") {
            let mut spins = 0u64;
            loop {
                spins = std::hint::black_box(spins.wrapping_add(1));
            }
        }
        if wants("err") {
            return Err("fixture wrap policy refuses this model".into());
        }
        if wants("chatter") {
            for line in 1..=1500 {
                println!("fixture wrap policy line {line}");
            }
        }
        if wants("missing") {
            return Ok(vec!["blocks.99".into()]);
        }
        Ok(modules
            .iter()
            .filter(|m| m.kind == "Block")
            .map(|m| m.path.clone())
            .collect())
    }
}

export_wrap_policy!(BadPolicy);
