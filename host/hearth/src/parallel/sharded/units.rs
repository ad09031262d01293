//! Which parameters each unit owns: a unit holds the parameters below its
//! module that no unit nested inside it holds (FSDP's rule); the root is
//! always a unit and takes whatever is left.

use crate::models::ModuleTree;

/// Why a set of unit paths cannot shard a model.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UnitError {
    /// A path names no module of the model.
    #[error(
        "unit `{path}` is not a module of the model; the modules are listed by `hearth model plan`"
    )]
    NoSuchModule {
        /// The path.
        path: String,
    },
    /// An ignored module that the model does not have.
    #[error("ignored module `{path}` is not a module of the model; the modules are listed by `hearth model plan`")]
    NoSuchIgnored {
        /// The path.
        path: String,
    },
}

/// [`assign`], leaving out the parameters below `ignored` modules (FSDP's
/// `ignored_modules`: neither sharded nor averaged).
pub fn assign_except(
    tree: &ModuleTree,
    units: &[String],
    ignored: &[String],
) -> Result<Vec<(String, Vec<String>)>, UnitError> {
    if let Some(path) = ignored.iter().find(|p| tree.get(p).is_none()) {
        return Err(UnitError::NoSuchIgnored { path: path.clone() });
    }
    let mut assigned = assign(tree, units)?;
    for (_, names) in &mut assigned {
        names.retain(|n| !ignored.iter().any(|m| crate::models::under(n, m)));
    }
    Ok(assigned)
}

/// The units' parameter names, in the order the units are given (the root
/// `""` added first when missing); units that end up owning no parameter
/// are dropped, except the root.
pub fn assign(
    tree: &ModuleTree,
    units: &[String],
) -> Result<Vec<(String, Vec<String>)>, UnitError> {
    let mut paths: Vec<String> = vec![String::new()];
    for path in units {
        if tree.get(path).is_none() {
            return Err(UnitError::NoSuchModule { path: path.clone() });
        }
        if !paths.contains(path) {
            paths.push(path.clone());
        }
    }
    let mut owned: Vec<Vec<String>> = vec![Vec::new(); paths.len()];
    for module in tree.modules() {
        for name in &module.params {
            owned[owner(&paths, &module.path)].push(name.clone());
        }
    }
    Ok(paths
        .into_iter()
        .zip(owned)
        .enumerate()
        .filter(|(i, (_, params))| *i == 0 || !params.is_empty())
        .map(|(_, unit)| unit)
        .collect())
}

/// The index in `paths` of the innermost unit containing module `module`.
fn owner(paths: &[String], module: &str) -> usize {
    paths
        .iter()
        .enumerate()
        .filter(|(_, p)| crate::models::under(module, p))
        .max_by_key(|(_, p)| p.len())
        .map(|(i, _)| i)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::tiny_gpt as gpt;
    use crate::models::Model;

    #[test]
    fn blocks_own_their_parameters_and_the_root_the_rest() {
        let model = gpt();
        let units = ["blocks.0".to_string(), "blocks.1".to_string()];
        let got = assign(model.module_tree(), &units).unwrap();
        let paths: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(paths, ["", "blocks.0", "blocks.1"]);
        assert_eq!(got[1].1.len(), 12);
        assert!(got[1].1.iter().all(|n| n.starts_with("blocks.0.")));
        let mut root = got[0].1.clone();
        root.sort();
        assert_eq!(
            root,
            [
                "head.bias",
                "head.weight",
                "ln.bias",
                "ln.weight",
                "pos.weight",
                "tok.weight"
            ]
        );
        let total: usize = got.iter().map(|(_, p)| p.len()).sum();
        assert_eq!(total, model.named_parameters().len());
    }

    #[test]
    fn a_nested_unit_takes_its_parameters_from_the_outer_one() {
        let model = gpt();
        let units = ["blocks.0".to_string(), "blocks.0.fc".to_string()];
        let got = assign(model.module_tree(), &units).unwrap();
        // In PyTorch's declaration order.
        assert_eq!(got[2].1, ["blocks.0.fc.weight", "blocks.0.fc.bias"]);
        assert_eq!(got[1].1.len(), 10);
        // `blocks.1` is not `blocks.10`'s prefix and so on: only whole path parts match.
        assert_eq!(owner(&["".into(), "blocks.1".into()], "blocks.10.fc"), 0);
    }

    #[test]
    fn a_path_that_is_no_module_is_refused() {
        let err = assign(gpt().module_tree(), &["blocks.7".into()]).unwrap_err();
        assert_eq!(
            err,
            UnitError::NoSuchModule {
                path: "blocks.7".into()
            }
        );
    }
}
