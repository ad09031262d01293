//! The module tree of a model, as a wrap policy will see it.

use std::collections::{BTreeMap, HashMap};
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
    /// Number of scalar parameters held by this module itself.
    pub own_params: u64,
    /// Bytes of parameters in this module and all below it.
    pub param_bytes: u64,
    /// Names of the buffers held directly by this module.
    pub buffers: Vec<String>,
    /// Bytes of buffers in this module and all below it.
    pub buffer_bytes: u64,
    /// Bytes of parameters and buffers in this module and all below it, by
    /// dtype (safetensors' names: `F32`, `BF16`, …).
    pub bytes_by_dtype: BTreeMap<String, u64>,
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
        Self::with_buffers(declared, variables, &HashMap::new())
    }

    /// As [`new`](Self::new), with the model's named buffers too.
    pub fn with_buffers(
        declared: &[(String, &str)],
        variables: &HashMap<String, Tensor>,
        buffers: &HashMap<String, Tensor>,
    ) -> Self {
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
                own_params: 0,
                param_bytes: 0,
                buffers: Vec::new(),
                buffer_bytes: 0,
                bytes_by_dtype: BTreeMap::new(),
                parent: if path.is_empty() {
                    None
                } else {
                    parent_of(path)
                },
            })
            .collect();
        for (is_param, named) in [(true, variables), (false, buffers)] {
            let mut names: Vec<&String> = named.keys().collect();
            names.sort();
            for name in names {
                let t = &named[name];
                let owner = parent_of(name).unwrap_or(0);
                let count = t.numel() as u64;
                let bytes = count * t.kind().elt_size_in_bytes() as u64;
                let dtype = crate::checkpoint::dtype_of(t.kind())
                    .map_or_else(|| format!("{:?}", t.kind()), |d| format!("{d:?}"));
                if is_param {
                    modules[owner].params.push(name.clone());
                    modules[owner].own_params += count;
                } else {
                    modules[owner].buffers.push(name.clone());
                }
                let mut at = Some(owner);
                while let Some(i) = at {
                    let m = &mut modules[i];
                    if is_param {
                        m.num_params += count;
                        m.param_bytes += bytes;
                    } else {
                        m.buffer_bytes += bytes;
                    }
                    *m.bytes_by_dtype.entry(dtype.clone()).or_default() += bytes;
                    at = m.parent;
                }
            }
        }
        Self { modules }
    }

    /// The modules, parents before children.
    pub fn modules(&self) -> &[ModuleInfo] {
        &self.modules
    }

    /// A tree inferred from variable names alone (a custom `VarStore`
    /// model): every prefix of a name is a module, of class `Module` unless
    /// `classes` names it (`("blocks.0", "Block")`); the root is `root_class`.
    pub fn from_variables(
        variables: &HashMap<String, Tensor>,
        root_class: &str,
        classes: &[(&str, &str)],
    ) -> Self {
        let mut paths = std::collections::BTreeSet::new();
        for name in variables.keys() {
            let mut p = name.as_str();
            while let Some(i) = p.rfind('.') {
                p = &p[..i];
                paths.insert(p.to_string());
            }
        }
        let class_of = |path: &str| {
            classes
                .iter()
                .find(|(p, _)| *p == path)
                .map_or("Module", |(_, c)| *c)
        };
        let mut declared: Vec<(String, &str)> = vec![(String::new(), root_class)];
        declared.extend(paths.into_iter().map(|p| {
            let class = class_of(&p);
            (p, class)
        }));
        Self::new(&declared, variables)
    }

    /// The module at `path`, if any.
    pub fn get(&self, path: &str) -> Option<&ModuleInfo> {
        self.modules.iter().find(|m| m.path == path)
    }
}
