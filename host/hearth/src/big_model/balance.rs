//! Accelerate's `get_balanced_memory`: a `max_memory` that spreads a model
//! evenly over the GPUs given instead of filling the first ones.

use super::memory::{get_max_memory, MapDevice, MaxMemory};
use super::sizes::{compute_module_sizes, ModuleSizes};
use super::Notes;
use crate::models::ModuleTree;
use indexmap::IndexMap;
use std::collections::HashMap;
use tch::Kind;

/// Accelerate's `get_module_leaves`: the keys no other key is directly
/// under (the root and top-level keys count no parent).
fn leaves(sizes: &ModuleSizes) -> Vec<&String> {
    let mut children: HashMap<&str, usize> = HashMap::new();
    for name in sizes.keys() {
        if let Some((parent, _)) = name.rsplit_once('.') {
            *children.entry(parent).or_default() += 1;
        }
    }
    sizes
        .keys()
        .filter(|n| !n.is_empty() && !children.contains_key(n.as_str()))
        .collect()
}

/// The class Accelerate reads for a key of the sizes: a module's, or
/// `Parameter` / `Tensor` for a parameter / buffer.
fn class_of<'t>(tree: &'t ModuleTree, name: &str) -> &'t str {
    match tree.get(name) {
        Some(m) => &m.kind,
        None if tree.tensors().iter().any(|t| t.buffer && t.name == name) => "Tensor",
        None => "Parameter",
    }
}

/// The reserve each GPU gets above its share: 1.25 × the larger of the
/// first module of a no-split class met and the mean size of the modules
/// just above the tensors.
fn reserve(tree: &ModuleTree, sizes: &ModuleSizes, no_split: &[String]) -> u64 {
    let mut first: IndexMap<&str, u64> = IndexMap::new();
    if !no_split.is_empty() {
        let wanted: std::collections::HashSet<&str> = no_split.iter().map(String::as_str).collect();
        for (name, size) in sizes.iter().filter(|(n, _)| !n.is_empty()) {
            let class = class_of(tree, name);
            if wanted.contains(class) && !first.contains_key(class) {
                first.insert(class, *size);
            }
            if first.len() == wanted.len() {
                break;
            }
        }
    }
    let largest_no_split = first.values().copied().max().unwrap_or(0);
    let tensors: std::collections::HashSet<&String> = leaves(sizes).into_iter().collect();
    let modules: ModuleSizes = sizes
        .iter()
        .filter(|(n, _)| !tensors.contains(n))
        .map(|(n, s)| (n.clone(), *s))
        .collect();
    let finals = leaves(&modules);
    let mean = finals.iter().map(|n| modules[*n]).sum::<u64>() / finals.len().max(1) as u64;
    (1.25 * largest_no_split.max(mean) as f64) as u64
}

/// Accelerate's `get_balanced_memory(model, max_memory,
/// no_split_module_classes, dtype, low_zero)`: each GPU but the last is
/// capped at its share of the model plus a reserve (see `reserve`); with
/// `low_zero`, GPU 0 gets only what the others cannot hold (it is left
/// free for other work, as transformers' `"balanced_low_0"`).
///
/// Unlike Accelerate, `disk` may be among the devices (Accelerate's own
/// check fails on it); with no `max_memory`, hearth knows only the CPU's
/// free memory (it does not ask the GPUs), so nothing is balanced.
pub fn get_balanced_memory(
    tree: &ModuleTree,
    max_memory: Option<&MaxMemory>,
    no_split_module_classes: &[String],
    dtype: Option<Kind>,
    low_zero: bool,
    notes: &mut Notes,
) -> MaxMemory {
    let mut memory = get_max_memory(max_memory, notes);
    let gpus: Vec<usize> = memory
        .iter()
        .filter_map(|(d, m)| match d {
            MapDevice::Gpu(i) if *m > 0 => Some(*i),
            _ => None,
        })
        .collect();
    if gpus.is_empty() {
        return memory;
    }
    // One GPU cannot leave GPU 0 low.
    let low_zero = low_zero && gpus.len() > 1;
    let sizes = compute_module_sizes(tree, dtype);
    let total = sizes.get("").copied().unwrap_or(0);
    let share = total / (if low_zero { gpus.len() - 1 } else { gpus.len() }) as u64;
    let per_gpu = share + reserve(tree, &sizes, no_split_module_classes);
    let gpu = |i: usize| MapDevice::Gpu(i);
    for &i in &gpus[..gpus.len() - 1] {
        let cap = if low_zero && i == 0 {
            memory.get(&gpu(0)).copied().unwrap_or(0)
        } else {
            per_gpu
        };
        let m = memory.get_mut(&gpu(i)).expect("listed above");
        *m = cap.min(*m);
    }
    if low_zero {
        let others: u64 = (1..gpus.len())
            .map(|i| memory.get(&gpu(i)).copied().unwrap_or(0))
            .sum();
        if let Some(zero) = memory.get_mut(&gpu(0)) {
            *zero = total.saturating_sub(others).min(*zero);
        }
    }
    memory
}
