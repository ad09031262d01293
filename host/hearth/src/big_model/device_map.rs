//! Accelerate's `infer_auto_device_map`: which device each module of a
//! model goes to, filling the GPUs in order, then the CPU, then the disk,
//! keeping room on the devices that run offloaded modules for the largest
//! layer, never splitting a module of a no-split class and keeping tied
//! parameters together. Ported step for step (its verbose lines, warnings
//! and quirks included) so that the same inputs give the same map.

use super::memory::{get_max_memory, MapDevice, MaxMemory};
use super::sizes::{
    compute_module_sizes, compute_module_total_buffer_size, max_layer, node, split_into, splits,
    top_level, ModuleSizes, Named, Node,
};
use super::{BigModelError, Notes};
use crate::models::ModuleTree;
use indexmap::IndexMap;
use std::collections::HashSet;
use tch::Kind;

/// Module path (or tensor name) → device, in the order Accelerate fills it.
pub type DeviceMap = IndexMap<String, MapDevice>;

/// The knobs of [`infer_auto_device_map`], with Accelerate's defaults.
#[derive(Debug, Clone)]
pub struct AutoDeviceMapOptions {
    /// What each device may hold (`None`: the CPU's free memory).
    pub max_memory: Option<MaxMemory>,
    /// Classes whose modules never cross devices (a block with a residual).
    pub no_split_module_classes: Vec<String>,
    /// The dtype floating weights will be loaded in.
    pub dtype: Option<Kind>,
    /// Record each step (Accelerate prints them) in [`Notes::steps`].
    pub verbose: bool,
    /// Merge submodules that went to one device into their parent.
    pub clean_result: bool,
    /// Offloaded modules take their buffers along (else buffers stay on the
    /// execution device, and count against it).
    pub offload_buffers: bool,
    /// When nothing fits on a device, look for any smaller module that does.
    pub fallback_allocation: bool,
}

impl Default for AutoDeviceMapOptions {
    fn default() -> Self {
        Self {
            max_memory: None,
            no_split_module_classes: Vec::new(),
            dtype: None,
            verbose: false,
            clean_result: true,
            offload_buffers: false,
            fallback_allocation: false,
        }
    }
}

/// Python's `repr` of a list of strings.
fn py_list(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("'{s}'")).collect();
    format!("[{}]", quoted.join(", "))
}

/// Accelerate's test for "`name` is inside a tied name" (`name + "." in
/// k + "."`: a substring test, kept as it is).
fn inside(name: &str, tied: &str) -> bool {
    format!("{tied}.").contains(&format!("{name}."))
}

/// The tied groups that reach out of `name`, and the tied names outside it.
fn ties_leaving(name: &str, ties: &[Vec<String>]) -> (Vec<Vec<String>>, Vec<String>) {
    let groups: Vec<Vec<String>> = ties
        .iter()
        .filter(|g| g.iter().any(|k| inside(name, k)) && !g.iter().all(|k| inside(name, k)))
        .cloned()
        .collect();
    let outside = groups
        .iter()
        .flat_map(|g| g.iter().filter(|p| !inside(name, p)).cloned())
        .collect();
    (groups, outside)
}

/// Accelerate's `get_module_size_with_ties`: the module's size plus that of
/// the modules holding the tied parameters outside it, and those modules.
fn size_with_ties(
    tied_params: &[String],
    module_size: u64,
    sizes: &ModuleSizes,
    to_treat: &[Named],
) -> (u64, Vec<Named>) {
    let mut tied_modules = Vec::new();
    let mut total = module_size as i128;
    for param in tied_params {
        // Accelerate fails when the holder is no longer waiting; hearth
        // leaves such a tie out.
        let Some(holder) = to_treat
            .iter()
            .find(|(n, _)| param.starts_with(&format!("{n}.")))
        else {
            continue;
        };
        let size = |n: &str| sizes.get(n).copied().unwrap_or(0) as i128;
        total += size(&holder.0) - size(param);
        tied_modules.push(holder.clone());
    }
    (total.max(0) as u64, tied_modules)
}

/// Accelerate's `fallback_allocate`: the first module, breadth first, that
/// fits in `limit` bytes (splitting what may split), and what is left to
/// place once it is taken out.
fn fallback_allocate(
    tree: &ModuleTree,
    modules: &[Named],
    sizes: &ModuleSizes,
    limit: i128,
    no_split: &[String],
    ties: &[Vec<String>],
) -> Option<(Named, Vec<Named>)> {
    if limit < 0 {
        return None;
    }
    let mut to_search: Vec<Named> = modules.to_vec();
    let found = loop {
        if to_search.is_empty() {
            return None;
        }
        let (name, n) = to_search.remove(0);
        let (_, tied_params) = ties_leaving(&name, ties);
        let size = sizes.get(&name).copied().unwrap_or(0);
        let (with_ties, _) = size_with_ties(&tied_params, size, sizes, &to_search);
        if with_ties as i128 <= limit {
            break (name, n);
        }
        if let (true, Node::Module(i)) = (splits(tree, n, no_split), n) {
            let mut parts = split_into(tree, i);
            parts.append(&mut to_search);
            to_search = parts;
        }
    };
    // Open every parent of the module found that is still waiting.
    let mut modules: Vec<Named> = modules.to_vec();
    let name = &found.0;
    for (dot, _) in name.match_indices('.') {
        let parent = &name[..dot];
        if let Some(at) = modules.iter().position(|(n, _)| n == parent) {
            let Node::Module(i) = modules[at].1 else {
                continue;
            };
            modules.splice(at..=at, split_into(tree, i));
        }
    }
    let at = modules.iter().position(|(n, _)| n == name)?;
    let found = modules.remove(at);
    Some((found, modules))
}

/// Accelerate's `clean_device_map`: a module whose submodules all went to
/// one device is mapped whole.
pub fn clean_device_map(map: &mut DeviceMap, module: &str) {
    let prefix = if module.is_empty() {
        String::new()
    } else {
        format!("{module}.")
    };
    let under: Vec<String> = map
        .keys()
        .filter(|k| k.starts_with(&prefix))
        .cloned()
        .collect();
    let devices: HashSet<MapDevice> = under.iter().map(|k| map[k]).collect();
    if devices.len() == 1 && under.len() > 1 {
        let device = map[&under[0]];
        for k in &under {
            map.shift_remove(k);
        }
        map.insert(module.to_string(), device);
    }
    let depth = if module.is_empty() {
        1
    } else {
        module.split('.').count() + 1
    };
    let mut children: Vec<String> = map
        .keys()
        .filter(|k| k.starts_with(&prefix) && k.len() > module.len())
        .map(|k| k.split('.').take(depth).collect::<Vec<_>>().join("."))
        .collect();
    children.sort();
    children.dedup();
    for child in children {
        clean_device_map(map, &child);
    }
}

/// Accelerate's `infer_auto_device_map`. Devices fill in order (GPUs by
/// index, the CPU, then the disk, which is always there); the first GPU
/// and the CPU keep room for the largest layer, so that an offloaded layer
/// can be brought in to run.
///
/// Where Accelerate returns a map that cannot run — something offloaded,
/// and the device that would run it given less room than the model's
/// largest layer — hearth refuses, naming the layer and the device.
pub fn infer_auto_device_map(
    tree: &ModuleTree,
    options: &AutoDeviceMapOptions,
    notes: &mut Notes,
) -> Result<DeviceMap, BigModelError> {
    let o = options;
    let no_split = &o.no_split_module_classes;
    let max_memory = get_max_memory(o.max_memory.as_ref(), notes);
    let mut devices: Vec<MapDevice> = max_memory.keys().copied().collect();
    if !devices.contains(&MapDevice::Disk) {
        devices.push(MapDevice::Disk);
    }
    let gpus: Vec<MapDevice> = devices.iter().copied().filter(|d| d.is_gpu()).collect();
    let main_devices: Vec<MapDevice> = match gpus.first() {
        Some(&g) => vec![g, MapDevice::Cpu],
        None => vec![MapDevice::Cpu],
    };
    let sizes = compute_module_sizes(tree, o.dtype);
    let size = |n: &str| sizes.get(n).copied().unwrap_or(0);
    let ties = tree.ties();
    let mut to_treat = top_level(tree);
    let mut map = DeviceMap::new();
    let mut current = 0usize;
    let mut used: IndexMap<MapDevice, i128> = devices.iter().map(|d| (*d, 0)).collect();
    let mut buffer_sizes: IndexMap<MapDevice, u64> = IndexMap::new();
    let mut minimum: IndexMap<MapDevice, i128> = IndexMap::new();
    let modules_only = |list: &[Named]| -> Vec<Named> {
        list.iter()
            .filter(|(_, n)| matches!(n, Node::Module(_)))
            .cloned()
            .collect()
    };
    let (mut max_layer_size, mut max_layer_names) = max_layer(tree, &to_treat, &sizes, no_split);
    let first_max_layer = (max_layer_size, max_layer_names.clone());
    let say = |notes: &mut Notes, line: String| {
        if o.verbose {
            notes.steps.push(line);
        }
    };

    while !to_treat.is_empty() {
        let (name, n) = to_treat.remove(0);
        say(notes, format!("\nTreating module {name}."));
        max_layer_names.retain(|l| *l != name && !l.starts_with(&format!("{name}.")));
        if max_layer_names.is_empty() {
            (max_layer_size, max_layer_names) =
                max_layer(tree, &modules_only(&to_treat), &sizes, no_split);
        }
        let module_size = size(&name);
        let (tied_groups, tied_params) = ties_leaving(&name, ties);
        if !tied_groups.is_empty() {
            let groups: Vec<String> = tied_groups.iter().map(|g| py_list(g)).collect();
            say(
                notes,
                format!(
                    "  Found the relevant tied param groups [{}]",
                    groups.join(", ")
                ),
            );
        }
        if !tied_params.is_empty() {
            say(
                notes,
                format!(
                    "  So those parameters need to be taken into account {}",
                    py_list(&tied_params)
                ),
            );
        }
        let device = devices[current];
        let mut max_size: Option<i128> = (device != MapDevice::Disk)
            .then(|| max_memory.get(&device).copied().unwrap_or(0) as i128);
        let mut reserved = 0i128;
        if main_devices.contains(&device) {
            max_size = max_size.map(|m| m - max_layer_size as i128);
            reserved = max_layer_size as i128;
        }
        let (with_ties, tied_modules) =
            size_with_ties(&tied_params, module_size, &sizes, &to_treat);
        let tied_names: Vec<String> = tied_modules.iter().map(|(n, _)| n.clone()).collect();
        let now = used[&device];

        // The module and the modules tied to it fit.
        if max_size.is_none_or(|m| now + with_ties as i128 <= m) {
            let mut line = format!("Putting {name}");
            if tied_names.is_empty() {
                line += &format!(" (size={module_size})");
            } else {
                line += &format!(" and {}", py_list(&tied_names));
            }
            if let Some(m) = max_size {
                line += &format!(" (available={})", m - now);
            }
            say(notes, format!("{line} on {device}."));
            used[&device] += with_ties as i128;
            map.insert(name.clone(), device);
            for tied in &tied_names {
                if let Some(at) = to_treat.iter().position(|(t, _)| t == tied) {
                    to_treat.remove(at);
                }
                map.insert(tied.clone(), device);
            }
            if !o.offload_buffers && matches!(n, Node::Module(_)) {
                *buffer_sizes.entry(device).or_default() +=
                    compute_module_total_buffer_size(tree, &name, o.dtype);
            }
            continue;
        }
        let max_size = max_size.expect("the disk holds everything");

        // The module alone fits: try splitting a module tied to it.
        if !tied_params.is_empty() && now + module_size as i128 <= max_size {
            say(
                notes,
                format!(
                    "Not enough space on {device} to put {name} and {} (space available {}, needed size {with_ties}).",
                    py_list(&tied_names),
                    max_size - now
                ),
            );
            let split = tied_modules.iter().find_map(|(tied, t)| match t {
                Node::Module(i) if splits(tree, *t, no_split) => Some((tied.clone(), *i)),
                _ => None,
            });
            if let Some((tied, i)) = split {
                say(notes, format!("Splitting {tied}."));
                let at = to_treat
                    .iter()
                    .position(|(t, _)| *t == tied)
                    .expect("waiting");
                to_treat.splice(at..=at, split_into(tree, i));
                to_treat.insert(0, (name, n));
                (max_layer_size, max_layer_names) =
                    max_layer(tree, &modules_only(&to_treat), &sizes, no_split);
                continue;
            }
            say(
                notes,
                "None of the tied module can be split, going to the next device.".into(),
            );
        }

        // The module does not fit: split it, or go on to the next device.
        if now + module_size as i128 >= max_size {
            say(
                notes,
                format!(
                    "Not enough space on {device} to put {name} (space available {}, module size {module_size}).",
                    max_size - now
                ),
            );
            if let (true, Node::Module(i)) = (splits(tree, n, no_split), n) {
                say(notes, format!("Splitting {name}."));
                let mut parts = split_into(tree, i);
                parts.append(&mut to_treat);
                to_treat = parts;
                (max_layer_size, max_layer_names) =
                    max_layer(tree, &modules_only(&to_treat), &sizes, no_split);
                continue;
            }
            say(
                notes,
                "This module cannot be split, going to the next device.".into(),
            );
        }

        if now == 0 && o.fallback_allocation && device != MapDevice::Disk {
            let room = max_memory.get(&device).copied().unwrap_or(0) as i128
                - (max_layer_size.max(with_ties)) as i128;
            if let Some((found, rest)) =
                fallback_allocate(tree, &to_treat, &sizes, room - now, no_split, ties)
            {
                to_treat = [vec![found, (name, n)], rest].concat();
                continue;
            }
        }
        if now == 0 {
            minimum.insert(device, with_ties as i128 + reserved);
        }
        used[&device] += reserved;
        current += 1;
        to_treat.insert(0, (name, n));
    }

    used.retain(|_, m| *m > 0);
    if o.clean_result {
        clean_device_map(&mut map, "");
    }
    let off_gpu_buffers = buffer_sizes.get(&MapDevice::Cpu).copied().unwrap_or(0)
        + buffer_sizes.get(&MapDevice::Disk).copied().unwrap_or(0);
    if off_gpu_buffers > 0 && !o.offload_buffers {
        let fits = max_memory.iter().any(|(d, m)| {
            d.is_gpu() && *m as i128 >= off_gpu_buffers as i128 + used.get(d).copied().unwrap_or(0)
        });
        if !gpus.is_empty() && !fits {
            notes.warn(format!(
                "Current model requires {off_gpu_buffers} bytes of buffer for offloaded layers, which seems does \
                 not fit any GPU's remaining memory. If you are experiencing a OOM later, please consider using \
                 offload_buffers=True."
            ));
        }
    }
    if !minimum.is_empty() {
        let lines: Vec<String> = minimum
            .iter()
            .map(|(d, m)| format!("  - {d}: {m} bytes required"))
            .collect();
        notes.info(format!(
            "Based on the current allocation process, no modules could be assigned to the following devices due to \
             insufficient memory:\n{}\nThese minimum requirements are specific to this allocation attempt and may \
             vary. Consider increasing the available memory for these devices to at least the specified minimum, or \
             adjusting the model config.",
            lines.join("\n")
        ));
    }
    check_runnable(tree, &map, &max_memory, first_max_layer)?;
    Ok(map)
}

/// Refuses a map with offloaded modules when the device that would run them
/// has less room than the largest layer (Accelerate returns such a map;
/// running it would exceed the `max_memory` given).
fn check_runnable(
    tree: &ModuleTree,
    map: &DeviceMap,
    max_memory: &MaxMemory,
    (largest, names): (u64, Vec<String>),
) -> Result<(), BigModelError> {
    // The device dispatch_model runs offloaded modules on: the first GPU
    // the map uses, else the CPU.
    let execution = map
        .values()
        .copied()
        .filter(|d| d.is_gpu())
        .min()
        .unwrap_or(MapDevice::Cpu);
    let offloaded = map
        .values()
        .any(|d| *d == MapDevice::Disk || (execution.is_gpu() && *d == MapDevice::Cpu));
    let room = max_memory.get(&execution).copied().unwrap_or(0);
    match names.first() {
        Some(layer) if offloaded && room < largest => Err(BigModelError::LargestLayerDoesNotFit {
            layer: layer.clone(),
            class: match node(tree, layer) {
                Node::Module(i) => tree.modules()[i].kind.clone(),
                Node::Tensor => "tensor".into(),
            },
            size: largest,
            device: execution,
            room,
        }),
        _ => Ok(()),
    }
}

/// Accelerate's `check_device_map`: every tensor of the model has a device
/// (an error names those without one); keys that are no module of the
/// model are reported.
pub fn check_device_map(
    tree: &ModuleTree,
    map: &DeviceMap,
    notes: &mut Notes,
) -> Result<(), BigModelError> {
    let strays: Vec<String> = map
        .keys()
        .filter(|k| !k.is_empty() && tree.get(k).is_none())
        .cloned()
        .collect();
    if !strays.is_empty() {
        notes.warn(format!(
            "The following device_map keys do not match any submodules in the model: {}",
            py_list(&strays)
        ));
    }
    let uncovered: Vec<String> = tree
        .modules()
        .iter()
        .flat_map(|m| m.params.iter().chain(&m.buffers))
        .filter(|name| device_of(map, name).is_none())
        .cloned()
        .collect();
    if uncovered.is_empty() {
        Ok(())
    } else {
        Err(BigModelError::Uncovered { tensors: uncovered })
    }
}

/// The device `map` gives the tensor (or module) `name`: that of the
/// longest key `name` is under.
pub fn device_of(map: &DeviceMap, name: &str) -> Option<MapDevice> {
    let mut at = name;
    loop {
        if let Some(d) = map.get(at) {
            return Some(*d);
        }
        if at.is_empty() {
            return None;
        }
        at = at.rfind('.').map_or("", |i| &at[..i]);
    }
}
