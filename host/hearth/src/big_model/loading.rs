//! Loading a checkpoint straight onto the devices of a device map:
//! Accelerate's `load_checkpoint_in_model`.

use super::device_map::{device_of, DeviceMap};
use super::handles::{is_placeholder, retie_parameters, Handles};
use super::offload::{load_offloaded_weights, offload_weight, save_offload_index, OffloadIndex};
use super::state_dict::check_format;
use super::{BigModelError, MapDevice, Notes};
use crate::checkpoint::{self, CheckpointError};
use crate::models::Model;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// The knobs of [`load_checkpoint_in_model`], with Accelerate's defaults.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Where each module goes; `None` loads into the tensors where they are.
    pub device_map: Option<DeviceMap>,
    /// Where tensors mapped to the disk are written.
    pub offload_folder: Option<PathBuf>,
    /// The dtype floating tensors are loaded in (with a device map).
    pub dtype: Option<Kind>,
    /// Tensors mapped to the CPU pass through the disk while the checkpoint
    /// is read (less host memory at once); their temporary folder is made
    /// inside the offload folder when there is one.
    pub offload_state_dict: bool,
    /// Buffers of modules mapped to the disk go to the disk too.
    pub offload_buffers: bool,
    /// Modules kept in float32 when `dtype` is float16.
    pub keep_in_fp32_modules: Vec<String>,
    /// The checkpoint must hold exactly the model's tensors.
    pub strict: bool,
}

/// What [`load_checkpoint_in_model`] did.
#[derive(Debug, Clone, Default)]
pub struct LoadedCheckpoint {
    /// Model tensors the checkpoint did not hold (they kept their values).
    pub missing: Vec<String>,
    /// Checkpoint tensors the model does not have (not loaded).
    pub unexpected: Vec<String>,
    /// What went to the offload folder.
    pub offload_index: OffloadIndex,
    /// Accelerate's warnings.
    pub notes: Notes,
}

/// Accelerate's rule for `keep_in_fp32_modules` and a `dtype`.
fn target_dtype(name: &str, kind: Kind, options: &LoadOptions) -> Option<Kind> {
    let dtype = options.dtype?;
    let floating = matches!(
        kind,
        Kind::Half
            | Kind::Float
            | Kind::Double
            | Kind::BFloat16
            | Kind::Float8e5m2
            | Kind::Float8e4m3fn
            | Kind::Float8e5m2fnuz
            | Kind::Float8e4m3fnuz
    );
    if !floating {
        return None;
    }
    let keep = dtype == Kind::Half
        && options
            .keep_in_fp32_modules
            .iter()
            .any(|k| (name.contains(k.as_str()) && name.contains(&format!("{k}."))) || k == name);
    Some(if keep { Kind::Float } else { dtype })
}

/// Accelerate's `load_checkpoint_in_model`: the checkpoint at `checkpoint`
/// (a `.safetensors` file, an index, or a folder with either) into `model`.
///
/// With a device map, each tensor goes to its module's device in `dtype`,
/// and tensors mapped to the disk are written to the offload folder in
/// Accelerate's layout (and hold no data in the model); shard files are
/// read one at a time, tensor by tensor. Everything that can be checked is
/// checked before anything is written (names, shapes, dtypes, devices, the
/// GPUs named); should writing fail all the same, the files this load
/// wrote are removed. A tied parameter counts as loaded under any of its
/// names.
///
/// Where hearth differs: with a device map, a parameter the checkpoint
/// does not hold is an error naming it (a device-mapped model is usually
/// built without values, so it would run on garbage; a buffer keeps its
/// own value); tied names mapped to different devices are an error (they
/// are one tensor); a buffer mapped to the disk without `offload_buffers`
/// is loaded onto the CPU (Accelerate leaves the model's own value).
pub fn load_checkpoint_in_model(
    model: &dyn Model,
    checkpoint: &Path,
    options: &LoadOptions,
) -> Result<LoadedCheckpoint, BigModelError> {
    let handles = Handles::of(model);
    let files = checkpoint::weight_files(checkpoint)?;
    let mut notes = Notes::default();
    let held = names_held(&files, &mut notes)?;
    let unexpected: Vec<String> = held
        .iter()
        .filter(|n| !handles.contains(n))
        .cloned()
        .collect();
    let missing: Vec<String> = model
        .module_tree()
        .tensors()
        .iter()
        .map(|t| t.name.clone())
        .filter(|n| !handles.group(n).iter().any(|g| held.contains(g)))
        .collect();
    if options.strict && (!missing.is_empty() || !unexpected.is_empty()) {
        return Err(BigModelError::Checkpoint(CheckpointError::Keys {
            path: checkpoint.into(),
            missing,
            unexpected,
        }));
    }
    if !unexpected.is_empty() {
        let listed: Vec<String> = unexpected.iter().map(|n| format!("'{n}'")).collect();
        notes.warn(format!(
            "Some weights of the model checkpoint at {} were not used when initializing {}: {{{}}}. This may or may \
             not be an issue - make sure that the checkpoint does not have unnecessary parameters, or that the model \
             definition correctly corresponds to the checkpoint.",
            checkpoint.display(),
            model.module_tree().modules().first().map_or("Module", |m| m.kind.as_str()),
            listed.join(", ")
        ));
    }
    let Some(map) = &options.device_map else {
        // In place: every name of a tied tensor is offered, so that the
        // checkpoint's name for it is found.
        let mut all: Vec<(String, Tensor)> = Vec::new();
        for n in held.iter().filter(|n| handles.contains(n)) {
            all.push((n.clone(), handles.handle(n)?));
        }
        checkpoint::load_checkpoint_in_model(&all, checkpoint, false)?;
        return Ok(LoadedCheckpoint {
            missing,
            unexpected,
            notes,
            ..Default::default()
        });
    };
    let plan = check_mapped(&handles, map, &files, &missing, options, &mut notes)?;
    let mut written = Vec::new();
    match place(model, &handles, map, &files, &plan, options, &mut written) {
        Ok(offload_index) => Ok(LoadedCheckpoint {
            missing: plan.kept.clone(),
            unexpected,
            offload_index,
            notes,
        }),
        Err(e) => {
            for file in written {
                let _ = std::fs::remove_file(file);
            }
            Err(e)
        }
    }
}

/// The tensor names the checkpoint's files hold (after checking each
/// file's format, and that it holds what its index says).
fn names_held(
    files: &[checkpoint::WeightFile],
    notes: &mut Notes,
) -> Result<BTreeSet<String>, BigModelError> {
    let mut held = BTreeSet::new();
    for (file, expected) in files {
        let mapped = checkpoint::open_mapped(file)?;
        check_format(file, mapped.bytes(), notes)?;
        let st = mapped.tensors(file)?;
        let names: BTreeSet<&str> = st.names().into_iter().collect();
        if let Some(absent) = expected
            .iter()
            .flatten()
            .find(|n| !names.contains(n.as_str()))
        {
            return Err(BigModelError::Checkpoint(CheckpointError::Format {
                path: file.clone(),
                message: format!("the index says it holds tensor `{absent}`, but it does not"),
            }));
        }
        held.extend(names.into_iter().map(String::from));
    }
    Ok(held)
}

/// What the checks before a mapped load decided.
struct MappedPlan {
    /// Buffers the checkpoint lacks that keep the model's values.
    kept: Vec<String>,
}

/// The checks before anything is written: the map covers the model and
/// names only GPUs this machine has, tied names share a device, the
/// offload folder is given when the disk is used, every tensor of the
/// files fits the model's shape and has a dtype hearth reads, and the
/// parameters the checkpoint lacks (an error) or buffers (kept).
fn check_mapped(
    handles: &Handles,
    map: &DeviceMap,
    files: &[checkpoint::WeightFile],
    missing: &[String],
    options: &LoadOptions,
    notes: &mut Notes,
) -> Result<MappedPlan, BigModelError> {
    super::device_map::check_device_map(handles.tree(), map, notes)?;
    let gpus = hearth_ops::cuda::device_count();
    if let Some((module, MapDevice::Gpu(index))) = map
        .iter()
        .find(|(_, d)| matches!(d, MapDevice::Gpu(i) if *i >= gpus))
    {
        return Err(BigModelError::NoSuchGpu {
            module: module.clone(),
            index: *index,
            available: gpus,
        });
    }
    for group in handles.tree().ties() {
        let devices: Vec<(String, Option<MapDevice>)> = group
            .iter()
            .map(|n| (n.clone(), device_of(map, n)))
            .collect();
        if devices.iter().any(|(_, d)| *d != devices[0].1) {
            let listed: Vec<String> = devices
                .iter()
                .map(|(n, d)| format!("{n} on {}", d.map_or("nothing".into(), |d| d.to_string())))
                .collect();
            return Err(BigModelError::SplitTie {
                names: listed.join(", "),
            });
        }
    }
    if let Some((module, _)) = map.iter().find(|(_, d)| **d == MapDevice::Disk) {
        if options.offload_folder.is_none() {
            return Err(BigModelError::NoOffloadFolder {
                module: module.clone(),
            });
        }
    }
    for (file, _) in files {
        let mapped = checkpoint::open_mapped(file)?;
        let st = mapped.tensors(file)?;
        for name in st.names().into_iter().filter(|n| handles.contains(n)) {
            let view = st.tensor(name).expect("listed by the file");
            let mismatch = |message: String| {
                BigModelError::Checkpoint(CheckpointError::Mismatch {
                    path: file.clone(),
                    name: name.into(),
                    message,
                })
            };
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let entry = handles
                .entry(name)
                .ok_or_else(|| BigModelError::NoSuchTensor { name: name.into() })?;
            if shape != entry.shape {
                return Err(mismatch(format!(
                    "shape {shape:?} in the file, {:?} in the model",
                    entry.shape
                )));
            }
            if checkpoint::kind_of(view.dtype()).is_none() {
                return Err(mismatch(format!("dtype {:?} cannot be read", view.dtype())));
            }
        }
    }
    let mut kept = Vec::new();
    for name in missing {
        let entry = handles.entry(name).expect("listed by the tree");
        let device = device_of(map, name).expect("checked: the map covers the model");
        let has_values = !is_placeholder(&handles.handle(name)?, &entry.shape);
        if entry.buffer && has_values {
            notes.warn(format!(
                "buffer `{name}` is not in the checkpoint; it keeps the model's own value (on {device})"
            ));
            kept.push(name.clone());
        } else {
            return Err(BigModelError::MissingMapped {
                checkpoint: files.first().map_or_else(PathBuf::new, |(f, _)| f.clone()),
                name: name.clone(),
                device,
            });
        }
    }
    Ok(MappedPlan { kept })
}

/// Writes the checkpoint's tensors where the map says, recording in
/// `written` every file it writes (removed by the caller on failure).
fn place(
    model: &dyn Model,
    handles: &Handles,
    map: &DeviceMap,
    files: &[checkpoint::WeightFile],
    plan: &MappedPlan,
    options: &LoadOptions,
    written: &mut Vec<PathBuf>,
) -> Result<OffloadIndex, BigModelError> {
    let folder = options.offload_folder.as_deref();
    let uses_disk = map.values().any(|d| *d == MapDevice::Disk);
    if let Some(folder) = folder.filter(|_| uses_disk) {
        std::fs::create_dir_all(folder).map_err(BigModelError::io(folder))?;
    }
    let mut stage: Option<(tempfile::TempDir, OffloadIndex)> = None;
    if options.offload_state_dict {
        let dir = match folder {
            Some(f) => {
                std::fs::create_dir_all(f).map_err(BigModelError::io(f))?;
                tempfile::Builder::new()
                    .prefix(".state-dict-")
                    .tempdir_in(f)
            }
            None => tempfile::tempdir(),
        }
        .map_err(BigModelError::io(folder.unwrap_or(Path::new("."))))?;
        stage = Some((dir, OffloadIndex::new()));
    }
    let mut index = OffloadIndex::new();
    // Writes `value` to the disk under `name`, then drops the model's copy.
    let mut offload = |name: &str, value: &Tensor, into: &Path, index: &mut OffloadIndex, dtype| {
        offload_weight(value, name, into, Some(index))?;
        written.push(into.join(format!("{name}.dat")));
        handles.set(name, MapDevice::Disk, None, dtype)
    };
    let mut place_one =
        |name: &str, value: &Tensor, stage: &mut Option<(tempfile::TempDir, OffloadIndex)>| {
            let device = device_of(map, name).expect("checked");
            let dtype = target_dtype(name, value.kind(), options);
            let resident_buffer =
                handles.entry(name).is_some_and(|e| e.buffer) && !options.offload_buffers;
            match (device, stage) {
                (MapDevice::Disk, _) if !resident_buffer => {
                    offload(name, value, folder.expect("checked"), &mut index, dtype)
                }
                (MapDevice::Disk, _) => handles.set(name, MapDevice::Cpu, Some(value), dtype),
                (MapDevice::Cpu, Some((dir, staged))) => {
                    offload(name, value, dir.path(), staged, dtype)
                }
                (device, _) => handles.set(name, device, Some(value), dtype),
            }
        };
    for (file, _) in files {
        let mapped = checkpoint::open_mapped(file)?;
        let st = mapped.tensors(file)?;
        for name in st.names().into_iter().filter(|n| handles.contains(n)) {
            let view = st.tensor(name).expect("listed by the file");
            let value = checkpoint::tensor_from_view(file, name, &view)?;
            place_one(name, &value, &mut stage)?;
        }
    }
    // Buffers the checkpoint lacks go where the map sends them, with their values.
    for name in &plan.kept {
        let value = handles.handle(name)?.detach();
        place_one(name, &value, &mut stage)?;
    }
    if let Some(folder) = folder {
        save_offload_index(&index, folder)?;
    }
    if let Some((dir, staged)) = stage {
        load_offloaded_weights(model, &staged, dir.path())?;
    }
    retie_parameters(model, handles.tree().ties());
    Ok(index)
}
