//! Running a model whose modules sit on several devices and on the disk:
//! Accelerate's `dispatch_model` and its `AlignDevicesHook`s, at the
//! granularity of the model's units.
//!
//! Each tensor lives where the device map puts it. Tensors mapped to the
//! disk — and, when the model runs on a GPU, those mapped to the CPU — are
//! *offloaded*: between uses they hold no data on the execution device;
//! just before a unit runs, the offloaded tensors it uses are read (from
//! the offload folder, or the copy in host memory) onto the device the
//! unit runs on, and dropped again once it ran. Activations follow the
//! units from device to device; the output comes back to the input's
//! device.
//!
//! Where hearth differs: Accelerate hooks every module, hearth every unit
//! (an embedding, a block, the head). A unit runs on the device of its
//! first tensor; tensors of the unit mapped to another GPU are copied
//! there for the unit's run as offloaded ones are. Map a model's blocks
//! whole (`no_split_module_classes = ["Block"]`) to avoid the copies. The
//! forward pass is for inference: it records no graph.

use super::device_map::{check_device_map, device_of, DeviceMap};
use super::handles::{is_placeholder, placeholder, torch_err, Handles};
use super::offload::{
    offload_state_dict, read_offload_index, OffloadIndex, OffloadedWeightsLoader,
};
use super::sizes::is_under;
use super::{BigModelError, MapDevice, Notes};
use crate::models::Model;
use std::collections::HashMap;
use std::path::PathBuf;
use tch::{Device, Kind, Tensor};

/// The knobs of [`dispatch_model`], with Accelerate's defaults.
#[derive(Debug, Clone, Default)]
pub struct DispatchOptions {
    /// The device offloaded modules run on (default: the first GPU of the
    /// map, else the CPU).
    pub main_device: Option<MapDevice>,
    /// Where the tensors mapped to the disk are (written there from the
    /// model's own values when the folder has no `index.json` yet).
    pub offload_dir: Option<PathBuf>,
    /// The offload folder's index, when not its `index.json`.
    pub offload_index: Option<OffloadIndex>,
    /// Buffers of offloaded modules are offloaded too (else they stay on
    /// the main device).
    pub offload_buffers: bool,
}

/// One tensor of a dispatched model.
struct Placed {
    name: String,
    /// Its name in the offload loader (a tied name may be stored under
    /// another of its names).
    source: String,
    /// The model's own handle.
    handle: Tensor,
    /// Its dtype in the model.
    kind: Kind,
    /// Where it runs.
    execution: Device,
    /// Read from the offload loader when needed (else resident).
    offloaded: bool,
}

/// What one unit of the model runs with.
struct UnitPlan {
    device: Device,
    tensors: Vec<usize>,
}

/// A model dispatched over devices and the disk (see the module docs).
pub struct DispatchedModel {
    model: Box<dyn Model>,
    tensors: Vec<Placed>,
    units: Vec<UnitPlan>,
    loader: OffloadedWeightsLoader,
    notes: Notes,
    device_map: DeviceMap,
}

/// Accelerate's `dispatch_model(model, device_map, main_device,
/// offload_dir, offload_index, offload_buffers)`: places every tensor as
/// `device_map` says (the map must cover the model) and returns the model,
/// ready to run with offloaded tensors loaded just in time.
pub fn dispatch_model(
    model: Box<dyn Model>,
    device_map: &DeviceMap,
    options: &DispatchOptions,
) -> Result<DispatchedModel, BigModelError> {
    let tree = model.module_tree().clone();
    let mut notes = Notes::default();
    check_device_map(&tree, device_map, &mut notes)?;
    let main = options.main_device.unwrap_or_else(|| {
        device_map
            .values()
            .copied()
            .filter(|d| d.is_gpu())
            .min()
            .unwrap_or(MapDevice::Cpu)
    });
    let main_torch = main
        .torch_device()
        .ok_or_else(|| BigModelError::UnknownDevice {
            name: "disk (as the main device)".into(),
        })?;
    let offloaded_places: &[MapDevice] = if main.is_gpu() {
        &[MapDevice::Cpu, MapDevice::Disk]
    } else {
        &[MapDevice::Disk]
    };
    let handles = Handles::of(model.as_ref());
    let disk: Vec<&String> = device_map
        .iter()
        .filter(|(_, d)| **d == MapDevice::Disk)
        .map(|(k, _)| k)
        .collect();
    let folder = options.offload_dir.clone();
    if !disk.is_empty() && folder.is_none() && options.offload_index.is_none() {
        return Err(BigModelError::NoOffloadFolder {
            module: disk[0].clone(),
        });
    }
    // Where each tensor goes, decided before anything is touched.
    struct Decided<'t> {
        entry: &'t crate::models::TensorEntry,
        place: MapDevice,
        offloaded: bool,
        execution: Device,
        empty: bool,
    }
    let no_values = |name: &str, why: String| {
        BigModelError::Checkpoint(crate::checkpoint::CheckpointError::State {
            path: PathBuf::from(name),
            message: format!("tensor `{name}` holds no values (it was offloaded): {why}"),
        })
    };
    let mut decided = Vec::new();
    for entry in tree.tensors() {
        let place = device_of(device_map, &entry.name).expect("checked: the map covers the model");
        // Offloaded places run on the main device; a buffer there stays
        // on it unless buffers are offloaded too.
        let away = offloaded_places.contains(&place);
        let offloaded = away && (!entry.buffer || options.offload_buffers);
        let execution = match place.torch_device() {
            Some(d) if !away => d,
            _ => main_torch,
        };
        let empty = is_placeholder(&handles.handle(&entry.name)?, &entry.shape);
        if empty && (!offloaded || place == MapDevice::Cpu) {
            return Err(no_values(
                &entry.name,
                format!("it is mapped to {place}; load the checkpoint with this device map first"),
            ));
        }
        decided.push(Decided {
            entry,
            place,
            offloaded,
            execution,
            empty,
        });
    }
    let on_disk = |d: &&Decided| d.offloaded && d.place == MapDevice::Disk;
    // A folder without an index gets the disk modules' own values.
    let mut index = options.offload_index.clone();
    if let Some(folder) = folder.as_ref().filter(|_| index.is_none()) {
        let found = read_offload_index(folder)?;
        if found.is_empty() && !disk.is_empty() {
            let mut values = Vec::new();
            for d in decided.iter().filter(on_disk) {
                if d.empty {
                    return Err(no_values(
                        &d.entry.name,
                        format!(
                            "{} has no index.json; give the folder it was offloaded to",
                            folder.display()
                        ),
                    ));
                }
                values.push((
                    d.entry.name.clone(),
                    handles.handle(&d.entry.name)?.detach(),
                ));
            }
            offload_state_dict(folder, &values)?;
            index = Some(read_offload_index(folder)?);
        } else {
            index = Some(found);
        }
    }
    let index = index.unwrap_or_default();
    // Each disk tensor is in the index (under any of its tied names), in
    // the model's shape.
    let mut sources: HashMap<String, String> = HashMap::new();
    for d in decided.iter().filter(on_disk) {
        let name = &d.entry.name;
        let group = handles.group(name);
        let Some((source, stored)) = group.iter().find_map(|n| index.get(n).map(|e| (n, e))) else {
            return Err(BigModelError::NoSuchTensor {
                name: format!("{name} (not in the offload folder's index)"),
            });
        };
        if stored.safetensors_file.is_none() && stored.shape != d.entry.shape {
            return Err(BigModelError::Checkpoint(
                crate::checkpoint::CheckpointError::Mismatch {
                    path: folder
                        .clone()
                        .unwrap_or_default()
                        .join(super::OFFLOAD_INDEX_NAME),
                    name: name.clone(),
                    message: format!(
                        "shape {:?} in the offload folder, {:?} in the model",
                        stored.shape, d.entry.shape
                    ),
                },
            ));
        }
        sources.insert(name.clone(), source.clone());
    }
    // Now the tensors move.
    let mut in_memory: HashMap<String, Tensor> = HashMap::new();
    let mut tensors = Vec::new();
    for d in decided {
        let name = d.entry.name.clone();
        let mut handle = handles.handle(&name)?;
        let kind = handle.kind();
        if d.offloaded {
            if d.place == MapDevice::Cpu {
                in_memory.insert(name.clone(), handle.detach().to_device(Device::Cpu));
            }
            tch::no_grad(|| handle.set_data(&placeholder(kind, d.execution)));
        } else if handle.device() != d.execution {
            let moved = handle
                .detach()
                .f_to_device(d.execution)
                .map_err(torch_err(format!("moving `{name}` to {}", d.place)))?;
            tch::no_grad(|| handle.set_data(&moved));
        }
        tensors.push(Placed {
            source: sources.remove(&name).unwrap_or_else(|| name.clone()),
            name,
            handle,
            kind,
            execution: d.execution,
            offloaded: d.offloaded,
        });
    }
    let loader = OffloadedWeightsLoader::new(in_memory, folder, Some(index))?;
    cut_at_the_map(model.as_ref(), device_map, &mut notes);
    let units = plan_units(model.as_ref(), &tensors, main_torch);
    Ok(DispatchedModel {
        model,
        tensors,
        units,
        loader,
        notes,
        device_map: device_map.clone(),
    })
}

/// Cuts a model whose units are not fixed (a TorchScript model) at the
/// modules the device map places, so that each runs on its own with only
/// its tensors on its device; where it cannot be cut, it runs whole (its
/// offloaded tensors all brought in for the run) and a note says why.
fn cut_at_the_map(model: &dyn Model, device_map: &DeviceMap, notes: &mut Notes) {
    let tree = model.module_tree();
    let modules: Vec<String> = device_map
        .keys()
        .filter(|k| !k.is_empty() && tree.get(k).is_some())
        .cloned()
        .collect();
    if let Err(why) = model.cut_at(&modules) {
        notes.warn(format!(
            "{why}; it runs whole, every tensor brought onto its device for each run"
        ));
    }
}

/// Which tensors each unit uses (a tied name counts for its group), and
/// the device it runs on: its first tensor's.
fn plan_units(model: &dyn Model, tensors: &[Placed], main: Device) -> Vec<UnitPlan> {
    let tree = model.module_tree();
    let index: HashMap<&str, usize> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let canonical = |name: &str| -> Option<usize> {
        index.get(name).copied().or_else(|| {
            let group = tree.ties().iter().find(|g| g.iter().any(|n| n == name))?;
            group.iter().find_map(|n| index.get(n.as_str()).copied())
        })
    };
    model
        .units()
        .iter()
        .map(|unit| {
            // Module paths (hearth's own models) or tensor names (the
            // pieces of a cut TorchScript model).
            let paths = unit.modules();
            let mut used: Vec<usize> = tree
                .modules()
                .iter()
                .flat_map(|m| m.params.iter().chain(&m.buffers))
                .filter(|n| paths.iter().any(|p| is_under(n, p)))
                .filter_map(|n| canonical(n))
                .collect();
            used.sort_unstable();
            used.dedup();
            let device = used.first().map_or(main, |&i| tensors[i].execution);
            UnitPlan {
                device,
                tensors: used,
            }
        })
        .collect()
}

/// Tensors brought onto a unit's device for its run, put back on drop
/// (also when the run fails).
struct Onloaded<'m> {
    tensors: &'m [Placed],
    restore: Vec<(usize, Tensor)>,
}

impl Drop for Onloaded<'_> {
    fn drop(&mut self) {
        for (i, before) in self.restore.drain(..) {
            let mut handle = self.tensors[i].handle.shallow_clone();
            tch::no_grad(|| handle.set_data(&before));
        }
    }
}

impl DispatchedModel {
    /// Runs the model on `tokens` (`[batch, time]`), unit by unit, without
    /// a graph; the logits come back on the tokens' device.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor, BigModelError> {
        let _no_grad = tch::no_grad_guard();
        let mut x = vec![tokens.shallow_clone()];
        for (i, (unit, plan)) in self.model.units().into_iter().zip(&self.units).enumerate() {
            let _onloaded = self.onload(plan)?;
            let inputs = x
                .iter()
                .map(|t| t.f_to_device(plan.device))
                .collect::<Result<Vec<_>, _>>()
                .map_err(torch_err(format!(
                    "moving activations to {:?}",
                    plan.device
                )))?;
            let failed = |message: &str| BigModelError::Forward {
                unit: format!("{i} ({})", unit.modules().join(", ")),
                message: message.lines().next().unwrap_or_default().to_string(),
            };
            // A unit's ops report errors by panicking (tch): caught here and
            // returned, with the offloaded tensors put back by the guard.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                unit.forward_all(&inputs, false)
            }));
            x = match ran {
                Ok(Ok(out)) => out,
                Ok(Err(e)) => return Err(failed(&e.to_string())),
                Err(panic) => {
                    return Err(failed(
                        panic
                            .downcast_ref::<String>()
                            .map(String::as_str)
                            .or_else(|| panic.downcast_ref::<&str>().copied())
                            .unwrap_or("it panicked"),
                    ))
                }
            };
        }
        match <[Tensor; 1]>::try_from(x) {
            Ok([out]) => Ok(out.to_device(tokens.device())),
            Err(x) => Err(BigModelError::Forward {
                unit: "the last".into(),
                message: format!("it gave {} tensors, not the model's one output", x.len()),
            }),
        }
    }

    /// Brings what `plan` needs and is not on its device there.
    fn onload(&self, plan: &UnitPlan) -> Result<Onloaded<'_>, BigModelError> {
        let mut guard = Onloaded {
            tensors: &self.tensors,
            restore: Vec::new(),
        };
        for &i in &plan.tensors {
            let t = &self.tensors[i];
            let value = if t.offloaded {
                self.loader.get(&t.source)?
            } else if t.execution != plan.device {
                t.handle.detach()
            } else {
                continue;
            };
            let value = value
                .f_to_device(plan.device)
                .and_then(|v| v.f_to_kind(t.kind))
                .map_err(torch_err(format!(
                    "loading `{}` onto {:?}",
                    t.name, plan.device
                )))?;
            guard.restore.push((i, t.handle.detach()));
            let mut handle = t.handle.shallow_clone();
            handle.set_data(&value);
        }
        Ok(guard)
    }

    /// The model (its offloaded tensors hold no data between runs).
    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    /// The device map it was dispatched with (Accelerate's
    /// `model.hf_device_map`).
    pub fn hf_device_map(&self) -> &DeviceMap {
        &self.device_map
    }

    /// Accelerate's warnings while dispatching.
    pub fn notes(&self) -> &Notes {
        &self.notes
    }

    /// The tensors read from the disk or host memory for each run.
    pub fn offloaded(&self) -> Vec<&str> {
        self.tensors
            .iter()
            .filter(|t| t.offloaded)
            .map(|t| t.name.as_str())
            .collect()
    }
}
