//! {{name}}: a hearth sharding wrap policy. It makes a unit of every module
//! whose class is in `classes` (comma-separated) and holds at least
//! `min-params` parameters.
//!
//! Build and install it with `hearth plugins build` and `hearth plugins
//! install .`; test it on this machine with `cargo test`.
use hearth_guest::{export_wrap_policy, Module, WrapPolicy};

struct Plugin;

impl WrapPolicy for Plugin {
    fn units(options_json: &str, modules: &[Module]) -> Result<Vec<String>, String> {
        // Declared in plugin.toml: hearth has checked the types and filled
        // in the defaults.
        let options: serde_json::Value = serde_json::from_str(options_json).map_err(|e| e.to_string())?;
        let classes: Vec<&str> = options["classes"].as_str().unwrap_or("").split(',').map(str::trim).collect();
        let min_params = options["min-params"].as_u64().unwrap_or(0);
        Ok(units(modules, &classes, min_params))
    }
}

/// The paths of the modules of `classes` with at least `min_params` parameters.
fn units(modules: &[Module], classes: &[&str], min_params: u64) -> Vec<String> {
    modules
        .iter()
        .filter(|m| classes.contains(&m.kind.as_str()) && m.params >= min_params)
        .map(|m| m.path.clone())
        .collect()
}

export_wrap_policy!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;

    fn module(path: &str, kind: &str, params: u64) -> Module {
        Module {
            path: path.into(),
            kind: kind.into(),
            params,
            own_params: 0,
            param_bytes: 4 * params,
            buffer_bytes: 0,
            parent: None,
        }
    }

    #[test]
    fn modules_of_the_classes_and_size_become_units() {
        let tree = [module("", "Gpt", 300), module("blocks.0", "Block", 120), module("blocks.1", "Block", 20), module("head", "Linear", 90)];
        assert_eq!(units(&tree, &["Block"], 100), ["blocks.0"]);
        assert_eq!(units(&tree, &["Block", "Linear"], 0), ["blocks.0", "blocks.1", "head"]);
    }
}
