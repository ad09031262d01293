//! The built-in wrap policies, one component installed under a plugin name
//! per policy (`manifests/*.toml`; each sets the `policy` option), with
//! Accelerate's semantics for its `auto_wrap_policy` names:
//!
//! - `transformer-based` (`TRANSFORMER_BASED_WRAP`): every module whose
//!   class is in `transformer_cls_names_to_wrap` is a unit; a class that
//!   no module has is refused with Accelerate's message.
//! - `size-based` (`SIZE_BASED_WRAP`): PyTorch FSDP1's
//!   `size_based_auto_wrap_policy` applied by `_recursive_wrap` below the
//!   root: recurse into a module whose parameters not yet wrapped number at
//!   least `min_num_params`, then wrap it when what its children left
//!   unwrapped still does (never a `ModuleList` or `ModuleDict`); with
//!   `min_num_params` 0 (Accelerate's default) nothing but the root.
//! - `no-wrap` (`NO_WRAP`): the root alone.
//!
//! The host makes the root a unit in every case.

use hearth_guest::{export_wrap_policy, Module, WrapPolicy};
use serde_json::Value;

struct Builtin;

impl WrapPolicy for Builtin {
    fn units(options_json: &str, modules: &[Module]) -> Result<Vec<String>, String> {
        let options: Value =
            serde_json::from_str(options_json).map_err(|e| format!("options are not JSON: {e}"))?;
        match options["policy"].as_str() {
            Some("transformer-based") => transformer_based(&options, modules),
            Some("size-based") => size_based(&options, modules),
            Some("no-wrap") => Ok(Vec::new()),
            other => Err(format!("unknown policy {other:?}; the manifest presets it")),
        }
    }
}

export_wrap_policy!(Builtin);

fn transformer_based(options: &Value, modules: &[Module]) -> Result<Vec<String>, String> {
    let names: Vec<&str> = match &options["transformer_cls_names_to_wrap"] {
        Value::Null => Vec::new(),
        Value::Array(items) => items
            .iter()
            .map(|n| {
                n.as_str()
                    .ok_or("transformer_cls_names_to_wrap holds class names (strings)")
            })
            .collect::<Result<_, _>>()?,
        Value::String(s) => s.split(',').collect(),
        _ => return Err("transformer_cls_names_to_wrap is a list of class names".into()),
    };
    // Accelerate stops at the first name that matches no module.
    if let Some(missing) = names
        .iter()
        .find(|n| !modules.iter().any(|m| m.kind == **n))
    {
        return Err(format!(
            "Could not find the transformer layer class {missing} in the model."
        ));
    }
    Ok(modules
        .iter()
        .filter(|m| names.contains(&m.kind.as_str()))
        .map(|m| m.path.clone())
        .collect())
}

fn size_based(options: &Value, modules: &[Module]) -> Result<Vec<String>, String> {
    let min = match &options["min_num_params"] {
        Value::Null => 0,
        v => v
            .as_u64()
            .ok_or("min_num_params is a whole number of parameters")?,
    };
    if min == 0 || modules.is_empty() {
        return Ok(Vec::new());
    }
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); modules.len()];
    for (i, m) in modules.iter().enumerate() {
        if let Some(p) = m.parent {
            children[p as usize].push(i);
        }
    }
    let mut units = Vec::new();
    let root = modules.iter().position(|m| m.parent.is_none()).unwrap_or(0);
    recursive_wrap(root, true, min, modules, &children, &mut units);
    Ok(units)
}

/// FSDP1's `_recursive_wrap`: returns the parameters wrapped at or below
/// `i`, adding the units it makes to `units`.
fn recursive_wrap(
    i: usize,
    only_children: bool,
    min: u64,
    modules: &[Module],
    children: &[Vec<usize>],
    units: &mut Vec<String>,
) -> u64 {
    let m = &modules[i];
    // Recurse only into a large module (MultiheadAttention is a leaf).
    if m.params < min || m.kind == "MultiheadAttention" {
        return 0;
    }
    let wrapped: u64 = children[i]
        .iter()
        .map(|&c| recursive_wrap(c, false, min, modules, children, units))
        .sum();
    let remainder = m.params - wrapped;
    let excluded = m.kind == "ModuleList" || m.kind == "ModuleDict";
    if !only_children && remainder >= min && !excluded {
        units.push(m.path.clone());
        m.params
    } else {
        wrapped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(path: &str, kind: &str, params: u64, parent: Option<u32>) -> Module {
        Module {
            path: path.into(),
            kind: kind.into(),
            params,
            own_params: 0,
            param_bytes: params * 4,
            buffer_bytes: 0,
            parent,
        }
    }

    /// A root holding a list of two layers of 60 and 50, and a head of 30.
    fn tree() -> Vec<Module> {
        vec![
            module("", "Net", 140, None),
            module("layers", "ModuleList", 110, Some(0)),
            module("layers.0", "Layer", 60, Some(1)),
            module("layers.1", "Layer", 50, Some(1)),
            module("head", "Linear", 30, Some(0)),
        ]
    }

    fn units(options: &str) -> Result<Vec<String>, String> {
        Builtin::units(options, &tree())
    }

    #[test]
    fn transformer_based_wraps_every_module_of_the_classes() {
        let got =
            units(r#"{"policy":"transformer-based","transformer_cls_names_to_wrap":["Layer"]}"#);
        assert_eq!(got.unwrap(), ["layers.0", "layers.1"]);
    }

    #[test]
    fn transformer_based_refuses_a_class_the_model_lacks_with_accelerates_message() {
        let got = units(
            r#"{"policy":"transformer-based","transformer_cls_names_to_wrap":["Layer","Nope"]}"#,
        );
        assert_eq!(
            got.unwrap_err(),
            "Could not find the transformer layer class Nope in the model."
        );
    }

    #[test]
    fn size_based_follows_fsdp_recursion_and_never_wraps_a_module_list() {
        // 55: layers.0 (60) is wrapped, layers.1 (50) is not; the list
        // (110, remainder 50) is never wrapped.
        let got = units(r#"{"policy":"size-based","min_num_params":55}"#).unwrap();
        assert_eq!(got, ["layers.0"]);
        // 50: both layers; the head (30) is too small.
        let got = units(r#"{"policy":"size-based","min_num_params":50}"#).unwrap();
        assert_eq!(got, ["layers.0", "layers.1"]);
        // 0 (Accelerate's default) and a threshold above the whole model: the root alone.
        assert!(units(r#"{"policy":"size-based"}"#).unwrap().is_empty());
        assert!(units(r#"{"policy":"size-based","min_num_params":1000}"#)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn no_wrap_is_the_root_alone() {
        assert!(units(r#"{"policy":"no-wrap"}"#).unwrap().is_empty());
    }
}
