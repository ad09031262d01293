//! The module tree of a model, as a wrap policy will see it.

use std::collections::HashMap;
use tch::Tensor;

/// One module of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleInfo {
    /// Dotted path from the root (`""` for the root, `"blocks.0.qkv"`).
    pub path: String,
    /// The module's class, named as PyTorch would (`"Linear"`, `"Block"`).
    pub kind: String,
    /// Names of the parameters held directly by this module.
    pub params: Vec<String>,
    /// Number of scalar parameters in this module and all below it.
    pub num_params: u64,
    /// Index of the parent module in the tree (`None` for the root).
    pub parent: Option<usize>,
}

/// All modules of a model, parents before children.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModuleTree {
    modules: Vec<ModuleInfo>,
}

impl ModuleTree {
    /// Builds the tree from `(path, kind)` pairs (in declaration order, the
    /// root `""` first) and the model's named variables.
    pub fn new(declared: &[(String, &str)], variables: &HashMap<String, Tensor>) -> Self {
        let index: HashMap<&str, usize> = declared
            .iter()
            .enumerate()
            .map(|(i, (p, _))| (p.as_str(), i))
            .collect();
        let parent_of = |path: &str| -> Option<usize> {
            let mut p = path;
            while !p.is_empty() {
                p = p.rfind('.').map_or("", |i| &p[..i]);
                if let Some(&i) = index.get(p) {
                    return Some(i);
                }
            }
            None
        };
        let mut modules: Vec<ModuleInfo> = declared
            .iter()
            .map(|(path, kind)| ModuleInfo {
                path: path.clone(),
                kind: kind.to_string(),
                params: Vec::new(),
                num_params: 0,
                parent: if path.is_empty() {
                    None
                } else {
                    parent_of(path)
                },
            })
            .collect();
        let mut names: Vec<&String> = variables.keys().collect();
        names.sort();
        for name in names {
            let owner = parent_of(name).unwrap_or(0);
            modules[owner].params.push(name.clone());
            let count = variables[name].numel() as u64;
            let mut at = Some(owner);
            while let Some(i) = at {
                modules[i].num_params += count;
                at = modules[i].parent;
            }
        }
        Self { modules }
    }

    /// The modules, parents before children.
    pub fn modules(&self) -> &[ModuleInfo] {
        &self.modules
    }

    /// The module at `path`, if any.
    pub fn get(&self, path: &str) -> Option<&ModuleInfo> {
        self.modules.iter().find(|m| m.path == path)
    }
}
