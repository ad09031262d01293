//! How many bytes each module and tensor of a model takes, and its largest
//! layer: Accelerate's `compute_module_sizes`, `calculate_maximum_sizes`
//! and `get_max_layer_size`, on a [`ModuleTree`].

use crate::models::ModuleTree;
use indexmap::IndexMap;
use tch::Kind;

/// Bytes per module path (`""` is the root) and per tensor name, with
/// exactly the keys, and in the order, of Accelerate's `compute_module_sizes`.
pub type ModuleSizes = IndexMap<String, u64>;

/// Integer and boolean tensors keep their size whatever `dtype` a model is
/// loaded in (Accelerate's rule: `set_module_tensor_to_device` does not
/// convert them).
pub(crate) fn is_integral(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64 | Kind::Bool
    )
}

/// Bits per element (`dtype_byte_size` × 8: a bool is one bit).
fn element_bits(kind: Kind) -> u64 {
    match kind {
        Kind::Bool => 1,
        k => 8 * k.elt_size_in_bytes() as u64,
    }
}

/// Bytes of `numel` elements of `kind` when the model is loaded in `dtype`:
/// floating tensors take the smaller of the two sizes. A bool takes an
/// eighth of a byte, as in Accelerate; hearth rounds a tensor's bools up
/// to whole bytes where Accelerate keeps the fraction.
pub(crate) fn tensor_size(numel: u64, kind: Kind, dtype: Option<Kind>) -> u64 {
    let bits = match dtype {
        Some(d) if !is_integral(kind) => element_bits(kind).min(element_bits(d)),
        _ => element_bits(kind),
    };
    (numel * bits).div_ceil(8)
}

/// Reads a dtype as Accelerate's `dtype` arguments take it (`"float16"`,
/// `"torch.bfloat16"`), or by its short name (`fp16`, `bf16`, `fp32`).
pub fn parse_dtype(text: &str) -> Result<Kind, super::BigModelError> {
    let name = text.trim().trim_start_matches("torch.");
    Ok(match name.to_ascii_lowercase().as_str() {
        "float32" | "fp32" | "float" => Kind::Float,
        "float16" | "fp16" | "half" => Kind::Half,
        "bfloat16" | "bf16" => Kind::BFloat16,
        "float64" | "fp64" | "double" => Kind::Double,
        "float8_e4m3fn" => Kind::Float8e4m3fn,
        "float8_e5m2" => Kind::Float8e5m2,
        "int8" => Kind::Int8,
        "uint8" => Kind::Uint8,
        _ => return Err(super::BigModelError::UnknownDtype { text: text.into() }),
    })
}

/// Accelerate's `compute_module_sizes(model, dtype)`: the bytes of every
/// parameter and buffer (a tied parameter once), added to its own name and
/// to every module above it. `dtype`, when given, is the dtype floating
/// tensors are loaded in.
pub fn compute_module_sizes(tree: &ModuleTree, dtype: Option<Kind>) -> ModuleSizes {
    sizes(tree, dtype, false)
}

fn sizes(tree: &ModuleTree, dtype: Option<Kind>, buffers_only: bool) -> ModuleSizes {
    let mut sizes = ModuleSizes::new();
    for t in tree.tensors().iter().filter(|t| t.buffer || !buffers_only) {
        let size = tensor_size(t.numel(), t.kind, dtype);
        let parts: Vec<&str> = t.name.split('.').collect();
        for end in 0..=parts.len() {
            *sizes.entry(parts[..end].join(".")).or_default() += size;
        }
    }
    sizes
}

/// Bytes of the buffers of the module at `path` and below it (Accelerate's
/// `compute_module_total_buffer_size` of that module).
pub fn compute_module_total_buffer_size(tree: &ModuleTree, path: &str, dtype: Option<Kind>) -> u64 {
    tree.tensors()
        .iter()
        .filter(|t| t.buffer && is_under(&t.name, path))
        .map(|t| tensor_size(t.numel(), t.kind, dtype))
        .sum()
}

/// True when `name` is `path` or below it (`""` holds everything).
pub(crate) fn is_under(name: &str, path: &str) -> bool {
    crate::models::under(name, path)
}

/// What an entry of Accelerate's lists of `(name, module)` pairs is: a
/// module of the tree, or a parameter or buffer (which never splits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Node {
    /// The module at this index of the tree.
    Module(usize),
    /// A parameter or buffer.
    Tensor,
}

/// A named entry of such a list.
pub(crate) type Named = (String, Node);

/// The node `name` is in `tree`.
pub(crate) fn node(tree: &ModuleTree, name: &str) -> Node {
    tree.index_of(name).map_or(Node::Tensor, Node::Module)
}

/// Whether `node` is a module that has children and whose class may split.
pub(crate) fn splits(tree: &ModuleTree, node: Node, no_split: &[String]) -> bool {
    match node {
        Node::Module(i) => {
            !tree.children(i).is_empty() && !no_split.iter().any(|c| *c == tree.modules()[i].kind)
        }
        Node::Tensor => false,
    }
}

/// A module's direct parameters, then its children
/// (`named_parameters(recurse=False) + named_children()`): what it is
/// replaced by when it splits.
pub(crate) fn split_into(tree: &ModuleTree, i: usize) -> Vec<Named> {
    let module = &tree.modules()[i];
    let mut parts: Vec<Named> = module
        .params
        .iter()
        .map(|p| (p.clone(), Node::Tensor))
        .collect();
    parts.extend(
        tree.children(i)
            .iter()
            .map(|&c| (tree.modules()[c].path.clone(), Node::Module(c))),
    );
    parts
}

/// The root's direct parameters, children and direct buffers: where
/// Accelerate starts walking a model.
pub(crate) fn top_level(tree: &ModuleTree) -> Vec<Named> {
    if tree.modules().is_empty() {
        return Vec::new();
    }
    let mut top = split_into(tree, 0);
    top.extend(
        tree.modules()[0]
            .buffers
            .iter()
            .map(|b| (b.clone(), Node::Tensor)),
    );
    top
}

/// Accelerate's `get_max_layer_size` on nodes already resolved.
pub(crate) fn max_layer(
    tree: &ModuleTree,
    modules: &[Named],
    sizes: &ModuleSizes,
    no_split: &[String],
) -> (u64, Vec<String>) {
    let mut max_size = 0;
    let mut names = Vec::new();
    let mut to_treat: std::collections::VecDeque<Named> = modules.iter().cloned().collect();
    while let Some((name, node)) = to_treat.pop_front() {
        if let (true, Node::Module(i)) = (splits(tree, node, no_split), node) {
            for child in tree.children(i).iter().rev() {
                to_treat.push_front((tree.modules()[*child].path.clone(), Node::Module(*child)));
            }
            continue;
        }
        let size = sizes.get(&name).copied().unwrap_or(0);
        if size > max_size {
            max_size = size;
            names = vec![name];
        } else if size == max_size {
            names.push(name);
        }
    }
    (max_size, names)
}

/// Accelerate's `get_max_layer_size(modules, module_sizes,
/// no_split_module_classes)`: the largest layer among the modules (or
/// tensors) named, and every layer of that size, where a layer is a module
/// with no children, a module of a class that must not split, or a tensor.
pub fn get_max_layer_size(
    tree: &ModuleTree,
    modules: &[String],
    sizes: &ModuleSizes,
    no_split_module_classes: &[String],
) -> (u64, Vec<String>) {
    let named: Vec<Named> = modules.iter().map(|n| (n.clone(), node(tree, n))).collect();
    max_layer(tree, &named, sizes, no_split_module_classes)
}

/// The largest layer of the whole model (`get_max_layer_size` from the
/// root's parameters, children and buffers, as `infer_auto_device_map`
/// starts).
pub fn largest_layer(
    tree: &ModuleTree,
    sizes: &ModuleSizes,
    no_split_module_classes: &[String],
) -> (u64, Vec<String>) {
    max_layer(tree, &top_level(tree), sizes, no_split_module_classes)
}

/// Accelerate's `calculate_maximum_sizes`: the model's total size and its
/// largest layer (with `no_split_module_classes` as transformers models
/// declare in `_no_split_modules`).
pub fn calculate_maximum_sizes(
    tree: &ModuleTree,
    no_split_module_classes: &[String],
) -> (u64, (u64, Vec<String>)) {
    let sizes = compute_module_sizes(tree, None);
    let largest = largest_layer(tree, &sizes, no_split_module_classes);
    (sizes.get("").copied().unwrap_or(0), largest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::tiny_gpt as gpt;
    use crate::models::Model;

    #[test]
    fn sizes_add_up_to_every_module_above_a_tensor() {
        let model = gpt();
        let sizes = compute_module_sizes(model.module_tree(), None);
        let params = model.num_parameters() as u64;
        assert_eq!(sizes[""], 4 * params);
        assert_eq!(sizes["blocks.0.qkv.weight"], 4 * 8 * 24);
        assert_eq!(
            sizes["blocks.0.qkv"],
            sizes["blocks.0.qkv.weight"] + sizes["blocks.0.qkv.bias"]
        );
        // Keys in Accelerate's order: the root, then each parameter's path.
        let keys: Vec<&str> = sizes.keys().take(4).map(String::as_str).collect();
        assert_eq!(keys, ["", "tok", "tok.weight", "pos"]);
        let half = compute_module_sizes(model.module_tree(), Some(Kind::BFloat16));
        assert_eq!(half[""], 2 * params);
        let wider = compute_module_sizes(model.module_tree(), Some(Kind::Double));
        assert_eq!(wider[""], 4 * params, "a dtype never makes a tensor larger");
    }

    #[test]
    fn a_class_that_must_not_split_is_one_layer() {
        let model = gpt();
        let tree = model.module_tree();
        let sizes = compute_module_sizes(tree, None);
        let top: Vec<String> = ["tok", "pos", "blocks", "ln", "head"]
            .map(String::from)
            .into();
        let (size, names) = get_max_layer_size(tree, &top, &sizes, &[]);
        // fc (8 → 32) is the largest leaf: 8·32 + 32 parameters.
        assert_eq!(names, ["blocks.0.fc", "blocks.1.fc"]);
        assert_eq!(size, sizes["blocks.0.fc"]);
        let (size, names) = get_max_layer_size(tree, &top, &sizes, &["Block".into()]);
        assert_eq!(names, ["blocks.0", "blocks.1"]);
        assert_eq!(size, sizes["blocks.0"]);
        let (total, (largest, _)) = calculate_maximum_sizes(tree, &["Block".into()]);
        assert_eq!((total, largest), (sizes[""], sizes["blocks.0"]));
    }

    #[test]
    fn bools_take_an_eighth_of_a_byte_rounded_up() {
        assert_eq!(tensor_size(16, Kind::Bool, None), 2);
        assert_eq!(tensor_size(17, Kind::Bool, Some(Kind::Half)), 3);
        assert_eq!(tensor_size(5, Kind::Int64, Some(Kind::Half)), 40);
        assert_eq!(tensor_size(5, Kind::Float, Some(Kind::Half)), 10);
    }
}
