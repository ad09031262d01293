//! The module tree of a model, as wrap policies and the big-model
//! utilities see it: PyTorch's `named_modules()`, `named_parameters()` and
//! `named_buffers()`, in PyTorch's order.

use std::collections::{BTreeMap, HashMap};
use tch::{Kind, Tensor};

/// One module of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleInfo {
    /// Dotted path from the root (`""` for the root, `"blocks.0.qkv"`).
    pub path: String,
    /// The module's class, named as PyTorch would (`"Linear"`, `"Block"`).
    pub kind: String,
    /// Names of the parameters held directly by this module, in declaration
    /// order (`module.named_parameters(recurse=False)`: a tied parameter is
    /// listed by every module holding it).
    pub params: Vec<String>,
    /// Number of scalar parameters in this module and all below it (a tied
    /// parameter counted once).
    pub num_params: u64,
    /// Number of scalar parameters held by this module itself.
    pub own_params: u64,
    /// Bytes of parameters in this module and all below it.
    pub param_bytes: u64,
    /// Names of the buffers held directly by this module, in declaration order.
    pub buffers: Vec<String>,
    /// Bytes of buffers in this module and all below it.
    pub buffer_bytes: u64,
    /// Bytes of parameters and buffers in this module and all below it, by
    /// dtype (safetensors' names: `F32`, `BF16`, …).
    pub bytes_by_dtype: BTreeMap<String, u64>,
    /// Index of the parent module in the tree (`None` for the root).
    pub parent: Option<usize>,
}

/// One parameter or buffer, listed once however many names it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// Its full name (`blocks.0.qkv.weight`); for a tied parameter, the
    /// first name PyTorch's `named_parameters()` gives it.
    pub name: String,
    /// Index of the module holding it.
    pub module: usize,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its dtype.
    pub kind: Kind,
    /// A buffer (not a parameter).
    pub buffer: bool,
}

impl TensorEntry {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d.max(0) as u64).product()
    }

    /// Bytes of its data.
    pub fn bytes(&self) -> u64 {
        self.numel() * self.kind.elt_size_in_bytes() as u64
    }
}

/// All modules of a model, parents before children, and its tensors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModuleTree {
    modules: Vec<ModuleInfo>,
    children: Vec<Vec<usize>>,
    index: HashMap<String, usize>,
    tensors: Vec<TensorEntry>,
    ties: Vec<Vec<String>>,
}

/// Whether the tensor or module `name` is `path` or below it (`""` holds
/// everything; `blocks.1` holds `blocks.1.fc.weight`, not `blocks.10.fc`).
pub(crate) fn under(name: &str, path: &str) -> bool {
    path.is_empty()
        || name
            .strip_prefix(path)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// Where a tensor's data is: two names with the same key are one tensor.
fn identity(t: &Tensor) -> Option<(usize, Kind, Vec<i64>, Vec<i64>)> {
    let ptr = t.data_ptr() as usize;
    (ptr != 0 && t.numel() > 0).then(|| (ptr, t.kind(), t.size(), t.stride()))
}

impl ModuleTree {
    /// Builds the tree from `(path, kind)` pairs (parents before children,
    /// siblings in declaration order, the root `""` first) and the model's
    /// named parameters in declaration order.
    pub fn new(declared: &[(String, &str)], variables: &[(String, Tensor)]) -> Self {
        Self::with_buffers(declared, variables, &[])
    }

    /// As [`new`](Self::new), with the model's named buffers too.
    pub fn with_buffers(
        declared: &[(String, &str)],
        variables: &[(String, Tensor)],
        buffers: &[(String, Tensor)],
    ) -> Self {
        let index: HashMap<String, usize> = declared
            .iter()
            .enumerate()
            .map(|(i, (p, _))| (p.clone(), i))
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
        let mut children = vec![Vec::new(); modules.len()];
        for (i, m) in modules.iter().enumerate() {
            if let Some(p) = m.parent {
                children[p].push(i);
            }
        }
        let mut tensors = Vec::new();
        let mut ties: Vec<Vec<String>> = Vec::new();
        for (is_param, named) in [(true, variables), (false, buffers)] {
            // PyTorch's order: modules in order, each one's own tensors in
            // declaration order.
            let mut ordered: Vec<(usize, &String, &Tensor)> = named
                .iter()
                .map(|(n, t)| (parent_of(n).unwrap_or(0), n, t))
                .collect();
            ordered.sort_by_key(|(owner, _, _)| *owner);
            // The first name of a tensor is its own; later ones are ties.
            let mut first: HashMap<_, usize> = HashMap::new();
            let mut tied: BTreeMap<usize, Vec<String>> = BTreeMap::new();
            for (owner, name, t) in ordered {
                if is_param {
                    modules[owner].params.push(name.clone());
                } else {
                    modules[owner].buffers.push(name.clone());
                }
                if let Some(key) = identity(t) {
                    if let Some(&at) = first.get(&key) {
                        tied.entry(at).or_default().push(name.clone());
                        continue;
                    }
                    first.insert(key, tensors.len());
                }
                let count = t.numel() as u64;
                let bytes = count * t.kind().elt_size_in_bytes() as u64;
                let dtype = crate::checkpoint::dtype_of(t.kind())
                    .map_or_else(|| format!("{:?}", t.kind()), |d| format!("{d:?}"));
                if is_param {
                    modules[owner].own_params += count;
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
                tensors.push(TensorEntry {
                    name: name.clone(),
                    module: owner,
                    shape: t.size(),
                    kind: t.kind(),
                    buffer: !is_param,
                });
            }
            if is_param {
                // find_tied_parameters: each group sorted.
                for (at, mut names) in tied {
                    names.push(tensors[at].name.clone());
                    names.sort();
                    names.dedup();
                    ties.push(names);
                }
            }
        }
        Self {
            modules,
            children,
            index,
            tensors,
            ties,
        }
    }

    /// The modules, parents before children.
    pub fn modules(&self) -> &[ModuleInfo] {
        &self.modules
    }

    /// A tree inferred from variable names alone (a custom `VarStore`
    /// model): every prefix of a name is a module, in the order the names
    /// first reach it, of class `Module` unless `classes` names it
    /// (`("blocks.0", "Block")`); the root is `root_class`.
    pub fn from_variables(
        variables: &[(String, Tensor)],
        root_class: &str,
        classes: &[(&str, &str)],
    ) -> Self {
        let mut paths: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (name, _) in variables {
            let parts: Vec<&str> = name.split('.').collect();
            for end in 1..parts.len() {
                let path = parts[..end].join(".");
                if seen.insert(path.clone()) {
                    paths.push(path);
                }
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
        self.index_of(path).map(|i| &self.modules[i])
    }

    /// The index of the module at `path` in [`modules`](Self::modules).
    pub fn index_of(&self, path: &str) -> Option<usize> {
        self.index.get(path).copied()
    }

    /// The direct children of module `i`, in declaration order
    /// (`named_children()`).
    pub fn children(&self, i: usize) -> &[usize] {
        &self.children[i]
    }

    /// Every parameter (as `named_parameters()` lists them: a tied one
    /// once), then every buffer (`named_buffers()`).
    pub fn tensors(&self) -> &[TensorEntry] {
        &self.tensors
    }

    /// Groups of parameter names that are one tensor, each sorted, as
    /// Accelerate's `find_tied_parameters` gives them.
    pub fn ties(&self) -> &[Vec<String>] {
        &self.ties
    }
}

/// A `VarStore`'s variables in PyTorch's declaration order, as far as a
/// store can tell: modules in the order their first variable was created,
/// and within a module `weight`, then `bias`, then the rest in creation
/// order (torch.nn's layers declare `weight` first; tch creates `bias`
/// first). Variables the store does not list among its trainable ones
/// follow, by name.
pub fn declaration_order(vs: &tch::nn::VarStore) -> Vec<(String, Tensor)> {
    let mut named: HashMap<usize, Vec<(String, Tensor)>> = HashMap::new();
    let mut rest = Vec::new();
    for (name, t) in vs.variables() {
        let ptr = t.data_ptr() as usize;
        if ptr == 0 {
            rest.push((name, t));
        } else {
            named.entry(ptr).or_default().push((name, t));
        }
    }
    let mut created = Vec::new();
    for t in vs.trainable_variables() {
        if let Some(mut names) = named.remove(&(t.data_ptr() as usize)) {
            names.sort_by(|a, b| a.0.cmp(&b.0));
            created.extend(names);
        }
    }
    rest.extend(named.into_values().flatten());
    rest.sort_by(|a, b| a.0.cmp(&b.0));
    created.extend(rest);
    let module_of = |name: &str| name.rsplit_once('.').map_or("", |(m, _)| m).to_string();
    let mut first_seen: HashMap<String, usize> = HashMap::new();
    for (name, _) in &created {
        let next = first_seen.len();
        first_seen.entry(module_of(name)).or_insert(next);
    }
    let rank = |name: &str| match name.rsplit('.').next() {
        Some("weight") => 0,
        Some("bias") => 1,
        _ => 2,
    };
    created.sort_by_key(|(name, _)| (first_seen[&module_of(name)], rank(name)));
    created
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn inferred_modules_follow_the_variables_and_linear_weights_come_first() {
        let _rng = crate::global_rng();
        let vs = tch::nn::VarStore::new(Device::Cpu);
        for name in ["layers.0", "layers.1", "layers.2", "head"] {
            let path = name
                .split('.')
                .fold(vs.root(), |p, part| p / part.to_string());
            tch::nn::linear(path, 2, 2, Default::default());
        }
        let ordered = declaration_order(&vs);
        let names: Vec<&str> = ordered.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "layers.0.weight",
                "layers.0.bias",
                "layers.1.weight",
                "layers.1.bias",
                "layers.2.weight",
                "layers.2.bias",
                "head.weight",
                "head.bias"
            ]
        );
        let tree = ModuleTree::from_variables(&ordered, "Net", &[("layers.1", "Layer")]);
        let paths: Vec<&str> = tree.modules().iter().map(|m| m.path.as_str()).collect();
        assert_eq!(
            paths,
            ["", "layers", "layers.0", "layers.1", "layers.2", "head"]
        );
        assert_eq!(tree.get("layers.1").unwrap().kind, "Layer");
        let layers = tree.index_of("layers").unwrap();
        assert_eq!(tree.children(layers), [2, 3, 4]);
        assert_eq!(tree.children(0), [1, 5]);
    }

    #[test]
    fn a_tensor_under_two_names_is_counted_once_and_reported_as_tied() {
        let _rng = crate::global_rng();
        let shared = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
        let variables = vec![
            ("emb.weight".to_string(), shared.shallow_clone()),
            (
                "head.bias".to_string(),
                Tensor::zeros([4], (Kind::Float, Device::Cpu)),
            ),
            ("head.weight".to_string(), shared.shallow_clone()),
        ];
        let declared = vec![
            (String::new(), "Net"),
            ("emb".to_string(), "Embedding"),
            ("head".to_string(), "Linear"),
        ];
        let tree = ModuleTree::new(&declared, &variables);
        assert_eq!(tree.modules()[0].num_params, 12 + 4);
        assert_eq!(tree.ties(), [vec!["emb.weight", "head.weight"]]);
        let names: Vec<&str> = tree.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["emb.weight", "head.bias"]);
        // Each module still lists what it holds.
        assert_eq!(
            tree.get("head").unwrap().params,
            ["head.bias", "head.weight"]
        );
    }
}
