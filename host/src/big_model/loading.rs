//! Loading a checkpoint straight onto the devices of a device map:
//! Accelerate's `load_checkpoint_in_model`, `load_state_dict`,
//! `set_module_tensor_to_device` and `retie_parameters`.
//!
//! A tensor "on the disk" (Accelerate's meta device) keeps its handle in
//! the model with no data: an empty tensor of its dtype, which
//! [`dispatch_model`](super::dispatch_model) fills just before the unit
//! using it runs.

use super::device_map::{device_of, DeviceMap};
use super::offload::{load_offloaded_weights, offload_weight, save_offload_index, OffloadIndex};
use super::sizes::is_integral;
use super::{BigModelError, MapDevice, Notes};
use crate::checkpoint::{self, CheckpointError};
use crate::models::{Model, ModuleTree};
use safetensors::SafeTensors;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// A model's tensors by name: parameters and buffers, a tied parameter
/// under every one of its names.
pub(crate) fn named_tensors(model: &dyn Model) -> HashMap<String, Tensor> {
    let mut named: HashMap<String, Tensor> = model
        .named_parameters()
        .into_iter()
        .chain(model.named_buffers())
        .collect();
    for group in model.module_tree().ties() {
        if let Some(t) = group
            .iter()
            .find_map(|n| named.get(n))
            .map(Tensor::shallow_clone)
        {
            for n in group {
                named.entry(n.clone()).or_insert_with(|| t.shallow_clone());
            }
        }
    }
    named
}

/// The shape, dtype and kind (buffer or not) the tree records for `name`
/// (a tied name gets its group's).
pub(crate) fn recorded<'t>(
    tree: &'t ModuleTree,
    name: &str,
) -> Option<&'t crate::models::TensorEntry> {
    let find = |n: &str| tree.tensors().iter().find(|t| t.name == n);
    find(name).or_else(|| {
        let group = tree.ties().iter().find(|g| g.iter().any(|n| n == name))?;
        group.iter().find_map(|n| find(n))
    })
}

/// The empty tensor a tensor "on the disk" holds: its dtype, no data.
pub(crate) fn placeholder(kind: Kind, device: Device) -> Tensor {
    Tensor::empty([0], (kind, device))
}

/// True when the handle holds no values though the tree says it has some.
pub(crate) fn is_placeholder(handle: &Tensor, shape: &[i64]) -> bool {
    handle.numel() == 0 && shape.iter().product::<i64>() != 0
}

fn torch_err(what: String) -> impl FnOnce(tch::TchError) -> BigModelError {
    move |source| BigModelError::Torch { what, source }
}

/// Accelerate's `set_module_tensor_to_device`: the model's tensor `name`
/// (its own handle, so every module using it sees the change) moves to
/// `device`, taking `value` when given (cast to `dtype`, else to the
/// tensor's own dtype; integer tensors keep theirs). To the disk it keeps
/// no data (Accelerate's meta device), in `dtype` when given.
pub fn set_module_tensor_to_device(
    model: &dyn Model,
    name: &str,
    device: MapDevice,
    value: Option<&Tensor>,
    dtype: Option<Kind>,
) -> Result<(), BigModelError> {
    let tensors = named_tensors(model);
    let mut handle = tensors
        .get(name)
        .ok_or_else(|| BigModelError::NoSuchTensor { name: name.into() })?
        .shallow_clone();
    let entry = recorded(model.module_tree(), name);
    let shape = entry.map_or_else(|| handle.size(), |e| e.shape.clone());
    let Some(target) = device.torch_device() else {
        let kind = dtype.unwrap_or(handle.kind());
        tch::no_grad(|| handle.set_data(&placeholder(kind, Device::Cpu)));
        return Ok(());
    };
    let new = match value {
        Some(v) => {
            if v.size() != shape {
                return Err(BigModelError::Checkpoint(CheckpointError::Mismatch {
                    path: PathBuf::from("(value)"),
                    name: name.into(),
                    message: format!("shape {:?} given, {:?} in the model", v.size(), shape),
                }));
            }
            let kind = match dtype {
                Some(d) if !is_integral(v.kind()) => d,
                Some(_) => v.kind(),
                None => handle.kind(),
            };
            v.detach()
                .f_to_device(target)
                .and_then(|t| t.f_to_kind(kind))
                .map_err(torch_err(format!("moving `{name}` to {device}")))?
        }
        None if is_placeholder(&handle, &shape) => {
            return Err(BigModelError::Checkpoint(CheckpointError::State {
                path: PathBuf::from(name),
                message: format!("tensor `{name}` is offloaded (it holds no values here): give a value to put on {device}"),
            }))
        }
        None => {
            let moved = handle
                .detach()
                .f_to_device(target)
                .map_err(torch_err(format!("moving `{name}` to {device}")))?;
            match dtype {
                Some(d) if !is_integral(moved.kind()) => moved.to_kind(d),
                _ => moved,
            }
        }
    };
    tch::no_grad(|| handle.set_data(&new));
    Ok(())
}

/// Accelerate's `retie_parameters`: each group of tied names shares the
/// values of its first name that holds any.
pub fn retie_parameters(model: &dyn Model, ties: &[Vec<String>]) {
    let tensors = named_tensors(model);
    for group in ties {
        let handles: Vec<&Tensor> = group.iter().filter_map(|n| tensors.get(n)).collect();
        let Some(source) = handles.iter().find(|t| t.numel() > 0) else {
            continue;
        };
        let source = source.detach();
        for h in handles {
            if !h.is_set_to(&source) {
                let mut h = h.shallow_clone();
                tch::no_grad(|| h.set_data(&source));
            }
        }
    }
}

/// Reads a safetensors file's `format` metadata as Accelerate does: none is
/// taken as `pt` (with a warning), `tf` and `flax` are refused.
fn check_format(path: &Path, st_bytes: &[u8], notes: &mut Notes) -> Result<(), BigModelError> {
    let bad = |message: String| {
        BigModelError::Checkpoint(CheckpointError::Format {
            path: path.into(),
            message,
        })
    };
    let (_, metadata) = SafeTensors::read_metadata(st_bytes).map_err(|e| bad(e.to_string()))?;
    let format = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get("format").cloned());
    match format.as_deref() {
        None if metadata.metadata().is_none() => {
            notes.warn(format!(
                "The safetensors archive passed at {} does not contain metadata. Make sure to save your model with the \
                 `save_pretrained` method. Defaulting to 'pt' metadata.",
                path.display()
            ));
            Ok(())
        }
        Some("pt") => Ok(()),
        Some(f @ ("tf" | "flax")) => Err(bad(format!("it was saved with {f}; hearth reads the pt format"))),
        other => Err(bad(format!(
            "its metadata has format {other:?}, not \"pt\"; save the model with save_pretrained or save_model"
        ))),
    }
}

/// Accelerate's `load_state_dict(checkpoint_file, device_map)`: every
/// tensor of one safetensors file, each on the device its module is mapped
/// to (tensors mapped to the disk, or to nothing, on the CPU).
pub fn load_state_dict(
    path: &Path,
    device_map: Option<&DeviceMap>,
    notes: &mut Notes,
) -> Result<Vec<(String, Tensor)>, BigModelError> {
    if path.extension().is_none_or(|e| e != "safetensors") {
        return Err(BigModelError::Checkpoint(CheckpointError::Format {
            path: path.into(),
            message: "hearth reads safetensors files (*.safetensors), not pickled state dicts"
                .into(),
        }));
    }
    let map = checkpoint::open_mapped(path)?;
    check_format(path, map.bytes(), notes)?;
    let st = map.tensors(path)?;
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let view = st.tensor(&name).expect("listed by the file");
        let tensor = checkpoint::tensor_from_view(path, &name, &view)?;
        let device = device_map
            .and_then(|m| device_of(m, &name))
            .and_then(MapDevice::torch_device)
            .unwrap_or(Device::Cpu);
        let tensor = tensor.f_to_device(device).map_err(torch_err(format!(
            "{}: loading `{name}` on {device:?}",
            path.display()
        )))?;
        out.push((name, tensor));
    }
    Ok(out)
}

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
/// read one at a time, tensor by tensor. Everything is checked before
/// anything is written (names, shapes, dtypes, devices): a failed load
/// writes nothing and changes nothing.
///
/// Where hearth differs: with a device map, a model tensor the checkpoint
/// does not hold is an error naming it (a device-mapped model is usually
/// built without values, so it would run on garbage); a buffer mapped to
/// the disk without `offload_buffers` is loaded onto the CPU (Accelerate
/// leaves the model's own value).
pub fn load_checkpoint_in_model(
    model: &dyn Model,
    checkpoint: &Path,
    options: &LoadOptions,
) -> Result<LoadedCheckpoint, BigModelError> {
    let Some(map) = &options.device_map else {
        let tensors: Vec<(String, Tensor)> = model
            .named_parameters()
            .into_iter()
            .chain(model.named_buffers())
            .collect();
        let report = checkpoint::load_checkpoint_in_model(&tensors, checkpoint, options.strict)?;
        return Ok(LoadedCheckpoint {
            missing: report.missing,
            unexpected: report.unexpected,
            ..Default::default()
        });
    };
    let tree = model.module_tree();
    let mut notes = Notes::default();
    super::device_map::check_device_map(tree, map, &mut notes)?;
    warn_split_ties(tree, map, &mut notes);
    let folder = options.offload_folder.as_deref();
    if let Some((module, _)) = map.iter().find(|(_, d)| **d == MapDevice::Disk) {
        if folder.is_none() {
            return Err(BigModelError::NoOffloadFolder {
                module: module.clone(),
            });
        }
    }
    let files = checkpoint::weight_files(checkpoint)?;
    let tensors = named_tensors(model);
    let unexpected = check_files(tree, map, &files, &tensors, options, &mut notes)?;

    let mut offload_index = OffloadIndex::new();
    let mut cpu_stage: Option<(tempfile::TempDir, OffloadIndex)> = None;
    if let Some(folder) = folder.filter(|_| map.values().any(|d| *d == MapDevice::Disk)) {
        std::fs::create_dir_all(folder).map_err(BigModelError::io(folder))?;
    }
    if options.offload_state_dict {
        let stage = match folder {
            Some(f) => {
                std::fs::create_dir_all(f).map_err(BigModelError::io(f))?;
                tempfile::Builder::new()
                    .prefix(".state-dict-")
                    .tempdir_in(f)
            }
            None => tempfile::tempdir(),
        }
        .map_err(BigModelError::io(folder.unwrap_or(Path::new("."))))?;
        cpu_stage = Some((stage, OffloadIndex::new()));
    }
    let buffers: HashSet<&str> = tree
        .tensors()
        .iter()
        .filter(|t| t.buffer)
        .map(|t| t.name.as_str())
        .collect();
    for (file, _) in &files {
        let mapped = checkpoint::open_mapped(file)?;
        let st = mapped.tensors(file)?;
        for name in st.names() {
            if !tensors.contains_key(name) {
                continue;
            }
            let view = st.tensor(name).expect("listed by the file");
            let value = checkpoint::tensor_from_view(file, name, &view)?;
            let device = device_of(map, name).expect("checked");
            let dtype = target_dtype(name, value.kind(), options);
            let offloaded_buffer = buffers.contains(name) && !options.offload_buffers;
            match (device, &mut cpu_stage) {
                (MapDevice::Disk, _) if !offloaded_buffer => {
                    set_module_tensor_to_device(model, name, MapDevice::Disk, None, dtype)?;
                    let folder = folder.expect("checked");
                    offload_weight(&value, name, folder, Some(&mut offload_index))?;
                }
                (MapDevice::Disk, _) => {
                    set_module_tensor_to_device(model, name, MapDevice::Cpu, Some(&value), dtype)?
                }
                (MapDevice::Cpu, Some((stage, index))) => {
                    set_module_tensor_to_device(model, name, MapDevice::Disk, None, dtype)?;
                    offload_weight(&value, name, stage.path(), Some(index))?;
                }
                (device, _) => {
                    set_module_tensor_to_device(model, name, device, Some(&value), dtype)?
                }
            }
        }
    }
    if let Some(folder) = folder {
        save_offload_index(&offload_index, folder)?;
    }
    if let Some((stage, index)) = cpu_stage {
        load_offloaded_weights(model, &index, stage.path())?;
    }
    retie_parameters(model, tree.ties());
    Ok(LoadedCheckpoint {
        missing: Vec::new(),
        unexpected,
        offload_index,
        notes,
    })
}

/// Accelerate's `check_tied_parameters_on_same_device`.
fn warn_split_ties(tree: &ModuleTree, map: &DeviceMap, notes: &mut Notes) {
    for group in tree.ties() {
        let devices: Vec<(String, Option<MapDevice>)> = group
            .iter()
            .map(|n| (n.clone(), device_of(map, n)))
            .collect();
        let distinct: HashSet<Option<MapDevice>> = devices.iter().map(|(_, d)| *d).collect();
        if distinct.len() > 1 {
            let listed: Vec<String> = devices
                .iter()
                .map(|(n, d)| {
                    format!(
                        "'{n}': {}",
                        d.map_or("None".into(), |d| match d {
                            MapDevice::Gpu(i) => i.to_string(),
                            other => format!("'{other}'"),
                        })
                    )
                })
                .collect();
            notes.warn(format!(
                "Tied parameters are on different devices: {{{}}}. Please modify your custom device map or set \
                 `device_map='auto'`. ",
                listed.join(", ")
            ));
        }
    }
}

/// The checks before anything is loaded: every tensor of the files has a
/// device, fits the model's shape and has a dtype hearth reads; with
/// `strict` the names match exactly, and every model tensor is in the
/// checkpoint. Returns the checkpoint's tensors the model does not have.
fn check_files(
    tree: &ModuleTree,
    map: &DeviceMap,
    files: &[checkpoint::WeightFile],
    tensors: &HashMap<String, Tensor>,
    options: &LoadOptions,
    notes: &mut Notes,
) -> Result<Vec<String>, BigModelError> {
    let mut seen = BTreeSet::new();
    let mut unexpected = Vec::new();
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
        for name in names {
            if !tensors.contains_key(name) {
                unexpected.push(name.to_string());
                continue;
            }
            let view = st.tensor(name).expect("listed by the file");
            let mismatch = |message: String| {
                BigModelError::Checkpoint(CheckpointError::Mismatch {
                    path: file.clone(),
                    name: name.into(),
                    message,
                })
            };
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let entry = recorded(tree, name)
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
            if device_of(map, name).is_none() {
                return Err(BigModelError::Uncovered {
                    tensors: vec![name.to_string()],
                });
            }
            seen.insert(name.to_string());
        }
    }
    unexpected.sort();
    // A tied group is loaded when any of its names is.
    let held = |name: &str| {
        seen.contains(name)
            || tree
                .ties()
                .iter()
                .any(|g| g.iter().any(|n| n == name) && g.iter().any(|n| seen.contains(n)))
    };
    let missing: Vec<&str> = tree
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !held(n))
        .collect();
    if options.strict && !unexpected.is_empty() {
        return Err(BigModelError::Checkpoint(CheckpointError::Keys {
            path: files.first().map_or_else(PathBuf::new, |(f, _)| f.clone()),
            missing: missing.iter().map(|s| s.to_string()).collect(),
            unexpected,
        }));
    }
    if let Some(name) = missing.first() {
        return Err(BigModelError::MissingMapped {
            checkpoint: files.first().map_or_else(PathBuf::new, |(f, _)| f.clone()),
            name: name.to_string(),
            device: device_of(map, name).unwrap_or(MapDevice::Cpu),
        });
    }
    Ok(unexpected)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::{serialize_to_file, Dtype, TensorView};

    fn write(path: &Path, metadata: Option<HashMap<String, String>>) {
        let data = [0u8; 8];
        let views = [
            ("a.w", TensorView::new(Dtype::F32, vec![2], &data).unwrap()),
            ("b.w", TensorView::new(Dtype::F32, vec![2], &data).unwrap()),
        ];
        serialize_to_file(views, metadata, path).unwrap();
    }

    #[test]
    fn load_state_dict_reads_the_pt_format_and_warns_without_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let map: DeviceMap = [
            ("a".to_string(), MapDevice::Cpu),
            ("b".to_string(), MapDevice::Disk),
        ]
        .into_iter()
        .collect();
        let pt = dir.path().join("pt.safetensors");
        write(&pt, Some(HashMap::from([("format".into(), "pt".into())])));
        let mut notes = Notes::default();
        let tensors = load_state_dict(&pt, Some(&map), &mut notes).unwrap();
        assert_eq!(
            tensors
                .iter()
                .map(|(n, t)| (n.as_str(), t.device()))
                .collect::<Vec<_>>(),
            [("a.w", Device::Cpu), ("b.w", Device::Cpu)],
            "the disk's tensors are read onto the CPU"
        );
        assert!(notes.warnings.is_empty());

        let bare = dir.path().join("bare.safetensors");
        write(&bare, None);
        load_state_dict(&bare, None, &mut notes).unwrap();
        assert!(
            notes.warnings[0].contains("does not contain metadata"),
            "{:?}",
            notes.warnings
        );

        let tf = dir.path().join("tf.safetensors");
        write(&tf, Some(HashMap::from([("format".into(), "tf".into())])));
        let err = load_state_dict(&tf, None, &mut notes)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tf.safetensors") && err.contains("saved with tf"),
            "{err}"
        );
        let err = load_state_dict(&dir.path().join("model.bin"), None, &mut notes)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.bin") && err.contains("safetensors"),
            "{err}"
        );
    }
}
