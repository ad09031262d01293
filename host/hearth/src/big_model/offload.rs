//! Weights offloaded to disk in Accelerate's layout: one `<name>.dat` per
//! tensor (its raw bytes, row-major, little-endian, as `numpy.memmap`
//! writes them; a bfloat16 or float8 tensor as the int16 or int8 it
//! reinterprets to, since NumPy has neither) and an `index.json` with each
//! tensor's dtype and shape — what Accelerate's `offload_state_dict`
//! writes and its `load_offloaded_weights` reads, and the reverse.

use super::handles::Handles;
use super::{BigModelError, MapDevice};
use crate::checkpoint::CheckpointError;
use crate::models::Model;
use indexmap::IndexMap;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// The index file of an offload folder.
pub const OFFLOAD_INDEX_NAME: &str = "index.json";

/// How one offloaded tensor is stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadEntry {
    /// NumPy's name of its dtype (`float32`), or `bfloat16` / `float8_*`
    /// (may be absent in an entry that names a safetensors file).
    #[serde(default)]
    pub dtype: String,
    /// Its shape (`[]` for a scalar, stored as one element; absent in an
    /// entry that names a safetensors file).
    #[serde(default)]
    pub shape: Vec<i64>,
    /// Instead of a `.dat` file: a safetensors file holding it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safetensors_file: Option<String>,
    /// Its name in that file, when not its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_name: Option<String>,
}

/// Tensor name → how it is stored, in the order tensors were offloaded.
pub type OffloadIndex = IndexMap<String, OffloadEntry>;

/// The name in an offload index of a dtype, and the dtype whose bytes the
/// `.dat` file holds.
fn numpy_name(kind: Kind) -> Option<&'static str> {
    Some(match kind {
        Kind::Float => "float32",
        Kind::Half => "float16",
        Kind::Double => "float64",
        Kind::BFloat16 => "bfloat16",
        Kind::Int64 => "int64",
        Kind::Int => "int32",
        Kind::Int16 => "int16",
        Kind::Int8 => "int8",
        Kind::Uint8 => "uint8",
        Kind::Bool => "bool",
        Kind::ComplexFloat => "complex64",
        Kind::ComplexDouble => "complex128",
        Kind::Float8e4m3fn => "float8_e4m3fn",
        Kind::Float8e5m2 => "float8_e5m2",
        Kind::Float8e4m3fnuz => "float8_e4m3fnuz",
        Kind::Float8e5m2fnuz => "float8_e5m2fnuz",
        _ => return None,
    })
}

fn kind_named(name: &str) -> Option<Kind> {
    [
        Kind::Float,
        Kind::Half,
        Kind::Double,
        Kind::BFloat16,
        Kind::Int64,
        Kind::Int,
        Kind::Int16,
        Kind::Int8,
        Kind::Uint8,
        Kind::Bool,
        Kind::ComplexFloat,
        Kind::ComplexDouble,
        Kind::Float8e4m3fn,
        Kind::Float8e5m2,
        Kind::Float8e4m3fnuz,
        Kind::Float8e5m2fnuz,
    ]
    .into_iter()
    .find(|k| numpy_name(*k) == Some(name))
}

/// The file of tensor `name` in `folder`; a name that would leave the
/// folder is refused.
fn dat_file(folder: &Path, name: &str) -> Result<PathBuf, BigModelError> {
    if name.is_empty() || name.contains(['/', '\\', '\0']) {
        return Err(BigModelError::Checkpoint(CheckpointError::Format {
            path: folder.join(OFFLOAD_INDEX_NAME),
            message: format!("tensor name {name:?} cannot name a file in the offload folder"),
        }));
    }
    Ok(folder.join(format!("{name}.dat")))
}

/// Accelerate's `offload_weight`: writes `weight` to `<folder>/<name>.dat`
/// (atomically) and records it in `index`.
pub fn offload_weight(
    weight: &Tensor,
    name: &str,
    folder: &Path,
    index: Option<&mut OffloadIndex>,
) -> Result<(), BigModelError> {
    let kind = weight.kind();
    let dtype = numpy_name(kind).ok_or_else(|| {
        BigModelError::Checkpoint(CheckpointError::Dtype {
            name: name.into(),
            kind,
        })
    })?;
    let path = dat_file(folder, name)?;
    let cpu = weight.detach().to_device(Device::Cpu).contiguous();
    let bytes = crate::checkpoint::tensor_bytes(&cpu);
    hearth_ops::durable::write_atomically(&path, |f| std::io::Write::write_all(f, bytes))
        .map_err(BigModelError::io(&path))?;
    if let Some(index) = index {
        index.insert(
            name.into(),
            OffloadEntry {
                dtype: dtype.into(),
                shape: weight.size(),
                safetensors_file: None,
                weight_name: None,
            },
        );
    }
    Ok(())
}

/// Accelerate's `load_offloaded_weight`: the tensor a `.dat` file holds,
/// on the CPU. A file of the wrong length is an error naming it.
pub fn load_offloaded_weight(file: &Path, entry: &OffloadEntry) -> Result<Tensor, BigModelError> {
    let bad = |message: String| {
        BigModelError::Checkpoint(CheckpointError::Format {
            path: file.into(),
            message,
        })
    };
    let kind = kind_named(&entry.dtype).ok_or_else(|| {
        bad(format!(
            "unknown dtype {:?} in the offload index",
            entry.dtype
        ))
    })?;
    if entry.shape.iter().any(|&d| d < 0) {
        return Err(bad(format!(
            "negative shape {:?} in the offload index",
            entry.shape
        )));
    }
    let numel = entry
        .shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d as usize));
    let expected = numel.and_then(|n| n.checked_mul(kind.elt_size_in_bytes()));
    let data = std::fs::read(file).map_err(BigModelError::io(file))?;
    if expected != Some(data.len()) {
        return Err(bad(format!(
            "holds {} bytes, but the offload index says {} {:?} ({} bytes); the folder is damaged: offload the weights again",
            data.len(),
            entry.dtype,
            entry.shape,
            expected.map_or("too many".into(), |e| e.to_string())
        )));
    }
    Ok(Tensor::from_data_size(&data, &entry.shape, kind))
}

/// Reads `<folder>/index.json` (an empty index when there is none).
pub fn read_offload_index(folder: &Path) -> Result<OffloadIndex, BigModelError> {
    let path = folder.join(OFFLOAD_INDEX_NAME);
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| {
            BigModelError::Checkpoint(CheckpointError::Format {
                path: path.clone(),
                message: format!(
                    "not an offload index ({e}): it maps tensor names to {{\"dtype\", \"shape\"}}"
                ),
            })
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(OffloadIndex::new()),
        Err(e) => Err(BigModelError::io(&path)(e)),
    }
}

/// Accelerate's `save_offload_index`: adds `index` to the folder's
/// `index.json` (written atomically); nothing is written for an empty one.
pub fn save_offload_index(index: &OffloadIndex, folder: &Path) -> Result<(), BigModelError> {
    if index.is_empty() {
        return Ok(());
    }
    let mut current = read_offload_index(folder)?;
    current.extend(index.iter().map(|(k, v)| (k.clone(), v.clone())));
    let path = folder.join(OFFLOAD_INDEX_NAME);
    let json = serde_json::to_string_pretty(&current).expect("an index serialises");
    hearth_ops::durable::write_atomically(&path, |f| std::io::Write::write_all(f, json.as_bytes()))
        .map_err(BigModelError::io(&path))
}

/// Accelerate's `offload_state_dict`: every tensor to `folder`, and the index.
pub fn offload_state_dict(
    folder: &Path,
    tensors: &[(String, Tensor)],
) -> Result<(), BigModelError> {
    std::fs::create_dir_all(folder).map_err(BigModelError::io(folder))?;
    let mut index = OffloadIndex::new();
    for (name, t) in tensors {
        offload_weight(t, name, folder, Some(&mut index))?;
    }
    save_offload_index(&index, folder)
}

/// Accelerate's `load_offloaded_weights`: each tensor of `index` from
/// `folder` into `model`, on the CPU.
pub fn load_offloaded_weights(
    model: &dyn Model,
    index: &OffloadIndex,
    folder: &Path,
) -> Result<(), BigModelError> {
    let loader =
        OffloadedWeightsLoader::new(HashMap::new(), Some(folder.into()), Some(index.clone()))?;
    let handles = Handles::of(model);
    for name in index.keys() {
        let value = loader.get(name)?;
        handles.set(name, MapDevice::Cpu, Some(&value), None)?;
    }
    Ok(())
}

/// Accelerate's `OffloadedWeightsLoader`: tensors by name, from a state
/// dict kept in memory first, else from the offload folder (a `.dat` file
/// or the safetensors file the index names), read when asked for.
#[derive(Debug, Default)]
pub struct OffloadedWeightsLoader {
    state_dict: HashMap<String, Tensor>,
    folder: Option<PathBuf>,
    index: OffloadIndex,
    device: Option<Device>,
}

impl OffloadedWeightsLoader {
    /// A loader over `state_dict` and the offload `folder`, whose index is
    /// `index` or else the folder's `index.json`.
    pub fn new(
        state_dict: HashMap<String, Tensor>,
        folder: Option<PathBuf>,
        index: Option<OffloadIndex>,
    ) -> Result<Self, BigModelError> {
        let index = match (index, &folder) {
            (Some(index), _) => index,
            (None, Some(folder)) => read_offload_index(folder)?,
            (None, None) => OffloadIndex::new(),
        };
        Ok(Self {
            state_dict,
            folder,
            index,
            device: None,
        })
    }

    /// Safetensors-backed entries are read onto `device` (else the CPU).
    pub fn on_device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Every name: the state dict's, then the index's.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.state_dict.keys().cloned().collect();
        keys.sort();
        keys.extend(
            self.index
                .keys()
                .filter(|k| !self.state_dict.contains_key(*k))
                .cloned(),
        );
        keys
    }

    /// True when `name` can be loaded.
    pub fn contains(&self, name: &str) -> bool {
        self.state_dict.contains_key(name) || self.index.contains_key(name)
    }

    /// The tensor `name`.
    pub fn get(&self, name: &str) -> Result<Tensor, BigModelError> {
        if let Some(t) = self.state_dict.get(name) {
            return Ok(t.shallow_clone());
        }
        let entry = self
            .index
            .get(name)
            .ok_or_else(|| BigModelError::NoSuchTensor { name: name.into() })?;
        if let Some(file) = &entry.safetensors_file {
            // The path as written (transformers writes it whole), as
            // Accelerate opens it.
            let path = PathBuf::from(file);
            let key = entry.weight_name.as_deref().unwrap_or(name);
            let tensor = crate::checkpoint::read_safetensor(&path, key)?;
            let tensor = if entry.dtype.is_empty() {
                tensor
            } else {
                let kind = kind_named(&entry.dtype).ok_or_else(|| {
                    BigModelError::Checkpoint(CheckpointError::Format {
                        path: path.clone(),
                        message: format!(
                            "unknown dtype {:?} for `{name}` in the offload index",
                            entry.dtype
                        ),
                    })
                })?;
                tensor.to_kind(kind)
            };
            return Ok(tensor.to_device(self.device.unwrap_or(Device::Cpu)));
        }
        let folder = self
            .folder
            .as_deref()
            .ok_or_else(|| BigModelError::NoSuchTensor { name: name.into() })?;
        load_offloaded_weight(&dat_file(folder, name)?, entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_through_a_dat_file() {
        let dir = tempfile::tempdir().unwrap();
        let base = Tensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0, 0.0, 7.0]).view([2, 3]);
        let tensors: Vec<(String, Tensor)> = [
            Kind::Float,
            Kind::Half,
            Kind::BFloat16,
            Kind::Double,
            Kind::Int64,
            Kind::Uint8,
            Kind::Bool,
        ]
        .iter()
        .map(|k| (format!("t.{k:?}"), base.to_kind(*k)))
        .chain([("scalar".to_string(), Tensor::from(3.5f64))])
        .collect();
        offload_state_dict(dir.path(), &tensors).unwrap();
        let loader =
            OffloadedWeightsLoader::new(HashMap::new(), Some(dir.path().into()), None).unwrap();
        for (name, t) in &tensors {
            let back = loader.get(name).unwrap();
            assert_eq!(back.kind(), t.kind(), "{name}");
            assert_eq!(back.size(), t.size(), "{name}");
            assert!(back.equal(t), "{name}");
        }
        let index = read_offload_index(dir.path()).unwrap();
        assert_eq!(index["t.BFloat16"].dtype, "bfloat16");
        assert_eq!(index["scalar"].shape, Vec::<i64>::new());
    }

    #[test]
    fn a_damaged_file_and_a_name_leaving_the_folder_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let t = Tensor::from_slice(&[1.0f32, 2.0]);
        let mut index = OffloadIndex::new();
        offload_weight(&t, "w", dir.path(), Some(&mut index)).unwrap();
        std::fs::write(dir.path().join("w.dat"), [0u8; 5]).unwrap();
        let err = load_offloaded_weight(&dir.path().join("w.dat"), &index["w"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("w.dat") && err.contains("5 bytes"), "{err}");
        let err = offload_weight(&t, "../escape", dir.path(), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("../escape"), "{err}");
        assert!(!dir.path().join("../escape.dat").exists());
    }
}
