//! Model weights as Hugging Face writes them: one `model.safetensors`, or
//! shards `model-00001-of-0000N.safetensors` with a
//! `model.safetensors.index.json` (`metadata.total_size`, `weight_map`) —
//! what Accelerate's `save_model` and `load_checkpoint_in_model` read and
//! write, and what `transformers` and `safetensors` load.

use super::safetensors_io::{kind_of, layout_order, open_mapped, TensorMeta};
use super::safetensors_io::{save_safetensors_fetched, CheckpointError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use tch::Tensor;

/// The single-file weights name.
pub const SAFE_WEIGHTS_NAME: &str = "model.safetensors";
/// The index of a sharded save.
pub const SAFE_WEIGHTS_INDEX_NAME: &str = "model.safetensors.index.json";

/// `model.safetensors.index.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardIndex {
    /// `{"total_size": bytes}`.
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// Tensor name → shard file name.
    pub weight_map: BTreeMap<String, String>,
}

/// What [`save_model`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedModel {
    /// The weight files, in order.
    pub files: Vec<PathBuf>,
    /// The index, when the weights were sharded.
    pub index: Option<PathBuf>,
    /// Bytes of tensor data (the index's `total_size`).
    pub total_size: u64,
}

/// Parses a shard size: a number of bytes, or a number with `KB`/`MB`/`GB`
/// (powers of 10) or `KiB`/`MiB`/`GiB` (powers of 2), as Accelerate's
/// `convert_file_size_to_int`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = (t[..split].trim(), &t[split..]);
    let factor: u64 = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        _ => {
            return Err(format!(
                "{text:?}: the unit is B, KB, MB, GB, KiB, MiB or GiB"
            ))
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 500MB or 10GB"))?;
    if value.is_nan() || value <= 0.0 {
        return Err(format!("{text:?}: a shard size is positive"));
    }
    Ok((value * factor as f64) as u64)
}

fn bytes_of(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// Splits `tensors` (in the order given) into shards of at most
/// `max_shard_size` bytes with Hugging Face's greedy rule: fill the current
/// shard until the next tensor would tip it over; a tensor larger than the
/// limit gets a shard of its own.
pub fn plan_shards(tensors: &[(String, Tensor)], max_shard_size: u64) -> Vec<Vec<usize>> {
    let sizes: Vec<u64> = tensors.iter().map(|(_, t)| bytes_of(t)).collect();
    plan_shards_of(&sizes, max_shard_size)
}

/// [`plan_shards`] of tensors of `sizes` bytes.
fn plan_shards_of(sizes: &[u64], max_shard_size: u64) -> Vec<Vec<usize>> {
    let mut shards = Vec::new();
    let (mut current, mut current_size) = (Vec::new(), 0u64);
    for (i, &size) in sizes.iter().enumerate() {
        if size > max_shard_size {
            shards.push(vec![i]);
            continue;
        }
        if current_size + size > max_shard_size {
            shards.push(std::mem::take(&mut current));
            current_size = 0;
        }
        current.push(i);
        current_size += size;
    }
    if !current.is_empty() {
        shards.push(current);
    }
    shards
}

/// The order [`save_model_from`] fetches the tensors `metas` describes
/// in, as indices into `metas`: file by file, each file's tensors in
/// their layout order. A streamed save's other processes follow it to
/// take part in the same gathers.
pub fn write_order(
    metas: &[TensorMeta],
    max_shard_size: u64,
) -> Result<Vec<usize>, CheckpointError> {
    let sizes: Vec<u64> = metas.iter().map(TensorMeta::bytes).collect();
    let mut order = Vec::with_capacity(metas.len());
    for shard in plan_shards_of(&sizes, max_shard_size.max(1)) {
        let part: Vec<TensorMeta> = shard.iter().map(|&i| metas[i].clone()).collect();
        order.extend(layout_order(&part)?.into_iter().map(|k| shard[k]));
    }
    Ok(order)
}

fn is_shard_name(name: &str) -> bool {
    // model-00001-of-00003.safetensors
    let Some(rest) = name
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let parts: Vec<&str> = rest.split("-of-").collect();
    parts.len() == 2
        && parts
            .iter()
            .all(|p| p.len() == 5 && p.bytes().all(|b| b.is_ascii_digit()))
}

/// Writes `tensors` into `dir` as `model.safetensors`, or, when they exceed
/// `max_shard_size` bytes, as numbered shards plus the index (each file
/// written atomically, the index last). Weight files of an earlier save in
/// `dir` that this one does not use are removed afterwards, so `dir` never
/// holds a mix.
pub fn save_model(
    dir: &Path,
    tensors: &[(String, Tensor)],
    max_shard_size: u64,
) -> Result<SavedModel, CheckpointError> {
    let metas: Vec<TensorMeta> = tensors.iter().map(|(n, t)| TensorMeta::of(n, t)).collect();
    save_model_from(dir, &metas, max_shard_size, &mut |i| {
        Ok(tensors[i].1.shallow_clone())
    })
}

/// [`save_model`] of the tensors `metas` describes, each fetched by
/// `fetch` (its index into `metas`) just before it is written, in
/// [`write_order`]: the files byte for byte what `save_model` writes, with
/// no more than one tensor in memory beyond what `fetch` holds.
pub fn save_model_from(
    dir: &Path,
    metas: &[TensorMeta],
    max_shard_size: u64,
    fetch: &mut dyn FnMut(usize) -> Result<Tensor, CheckpointError>,
) -> Result<SavedModel, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(CheckpointError::io(dir))?;
    let sizes: Vec<u64> = metas.iter().map(TensorMeta::bytes).collect();
    let plan = plan_shards_of(&sizes, max_shard_size.max(1));
    let total_size: u64 = sizes.iter().sum();
    let n = plan.len();
    let names: Vec<String> = if n <= 1 {
        vec![SAFE_WEIGHTS_NAME.to_string()]
    } else {
        (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect()
    };
    let mut files = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (shard, name) in plan.iter().zip(&names) {
        let part: Vec<TensorMeta> = shard.iter().map(|&i| metas[i].clone()).collect();
        let path = dir.join(name);
        save_safetensors_fetched(&path, &part, &mut |k| fetch(shard[k]), HashMap::new())?;
        for meta in &part {
            weight_map.insert(meta.name.clone(), name.clone());
        }
        files.push(path);
    }
    if plan.is_empty() {
        let path = dir.join(SAFE_WEIGHTS_NAME);
        save_safetensors_fetched(
            &path,
            &[],
            &mut |_| unreachable!("no tensors"),
            HashMap::new(),
        )?;
        files.push(path);
    }
    let index = if n > 1 {
        let index = ShardIndex {
            metadata: BTreeMap::from([("total_size".to_string(), total_size.into())]),
            weight_map,
        };
        let path = dir.join(SAFE_WEIGHTS_INDEX_NAME);
        let json = serde_json::to_string_pretty(&index).expect("an index serialises");
        hearth_ops::durable::write_atomically(&path, |f| {
            std::io::Write::write_all(f, json.as_bytes())
        })
        .map_err(CheckpointError::io(&path))?;
        Some(path)
    } else {
        None
    };
    // Only now, with the new files in place, remove what belongs to an
    // earlier save.
    let keep: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    for entry in std::fs::read_dir(dir)
        .map_err(CheckpointError::io(dir))?
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let stale = !keep.contains(name.as_str())
            && (is_shard_name(&name)
                || (n > 1 && name == SAFE_WEIGHTS_NAME)
                || (n <= 1 && name == SAFE_WEIGHTS_INDEX_NAME));
        if stale {
            std::fs::remove_file(entry.path()).map_err(CheckpointError::io(&entry.path()))?;
        }
    }
    Ok(SavedModel {
        files,
        index,
        total_size,
    })
}

/// What a load found besides the tensors it set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Model tensors the checkpoint does not hold.
    pub missing: Vec<String>,
    /// Checkpoint tensors the model does not have.
    pub unexpected: Vec<String>,
}

/// A weight file and the tensor names its index says it holds (`None`: all).
pub(crate) type WeightFile = (PathBuf, Option<BTreeSet<String>>);

/// The weight files of `path`: a `.safetensors` file, an index file, or a
/// folder holding `model.safetensors.index.json` or `model.safetensors`.
/// Returns each file with the names it should hold (`None`: all).
pub(crate) fn weight_files(path: &Path) -> Result<Vec<WeightFile>, CheckpointError> {
    let bad = |message: String| CheckpointError::Format {
        path: path.into(),
        message,
    };
    let index_path = if path.is_dir() {
        let index = path.join(SAFE_WEIGHTS_INDEX_NAME);
        let single = path.join(SAFE_WEIGHTS_NAME);
        if index.is_file() {
            index
        } else if single.is_file() {
            return Ok(vec![(single, None)]);
        } else {
            return Err(bad(format!(
                "the folder holds neither {SAFE_WEIGHTS_INDEX_NAME} nor {SAFE_WEIGHTS_NAME}"
            )));
        }
    } else if path.extension().is_some_and(|e| e == "json") {
        path.to_path_buf()
    } else {
        return Ok(vec![(path.to_path_buf(), None)]);
    };
    let text = std::fs::read_to_string(&index_path).map_err(CheckpointError::io(&index_path))?;
    let index: ShardIndex = serde_json::from_str(&text).map_err(|e| CheckpointError::Format {
        path: index_path.clone(),
        message: format!("not a safetensors index ({e}); it needs a `weight_map` object"),
    })?;
    let folder = index_path.parent().unwrap_or(Path::new("."));
    let mut by_file: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (tensor, file) in index.weight_map {
        if file.contains(['/', '\\']) || file == ".." {
            return Err(CheckpointError::Format {
                path: index_path.clone(),
                message: format!("tensor `{tensor}` maps to {file:?}, outside the index's folder"),
            });
        }
        by_file.entry(file).or_default().insert(tensor);
    }
    Ok(by_file
        .into_iter()
        .map(|(file, names)| (folder.join(file), Some(names)))
        .collect())
}

/// Loads the weights at `path` (see `weight_files`: file, index or
/// folder) into `model` — each model tensor is overwritten in place, on its
/// own device. Files are memory-mapped and read tensor by tensor. A tensor
/// whose shape or dtype differs is an error naming it, the file and both
/// sides; with `strict`, missing or unexpected names are an error listing
/// them, else they are reported. Nothing is written to the model unless
/// every check passes.
pub fn load_checkpoint_in_model(
    model: &[(String, Tensor)],
    path: &Path,
    strict: bool,
) -> Result<LoadReport, CheckpointError> {
    let (writes, report) = stage_checkpoint_in_model(model, path, strict)?;
    tch::no_grad(|| {
        for (target, source) in writes {
            target.detach().copy_(&source);
        }
    });
    Ok(report)
}

/// What [`load_checkpoint_in_model`] would write, checked and read into
/// memory but not yet written: each model tensor with its value from the
/// file (for a caller that applies several parts all or nothing).
pub fn stage_checkpoint_in_model(
    model: &[(String, Tensor)],
    path: &Path,
    strict: bool,
) -> Result<(Vec<(Tensor, Tensor)>, LoadReport), CheckpointError> {
    let wanted: HashMap<&str, &Tensor> = model.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let files = weight_files(path)?;
    let mut maps = Vec::new();
    for (file, _) in &files {
        maps.push(open_mapped(file)?);
    }
    // First pass: check everything.
    let mut seen = BTreeSet::new();
    let mut unexpected = Vec::new();
    for ((file, expected_names), map) in files.iter().zip(&maps) {
        let st = map.tensors(file)?;
        let names: BTreeSet<String> = st.names().into_iter().map(str::to_string).collect();
        if let Some(expected) = expected_names {
            if let Some(absent) = expected.difference(&names).next() {
                return Err(CheckpointError::Format {
                    path: file.clone(),
                    message: format!("the index says it holds tensor `{absent}`, but it does not"),
                });
            }
        }
        for name in names {
            let Some(target) = wanted.get(name.as_str()) else {
                unexpected.push(name);
                continue;
            };
            let view = st.tensor(&name).map_err(|e| CheckpointError::Format {
                path: file.clone(),
                message: e.to_string(),
            })?;
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            if shape != target.size() {
                return Err(CheckpointError::Mismatch {
                    path: file.clone(),
                    name: name.clone(),
                    message: format!(
                        "shape {:?} in the file, {:?} in the model",
                        shape,
                        target.size()
                    ),
                });
            }
            if kind_of(view.dtype()) != Some(target.kind()) {
                return Err(CheckpointError::Mismatch {
                    path: file.clone(),
                    name: name.clone(),
                    message: format!(
                        "dtype {:?} in the file, {:?} in the model",
                        view.dtype(),
                        target.kind()
                    ),
                });
            }
            seen.insert(name);
        }
    }
    let missing: Vec<String> = model
        .iter()
        .map(|(n, _)| n.clone())
        .filter(|n| !seen.contains(n))
        .collect();
    unexpected.sort();
    if strict && (!missing.is_empty() || !unexpected.is_empty()) {
        return Err(CheckpointError::Keys {
            path: path.into(),
            missing,
            unexpected,
        });
    }
    // Second pass: read.
    let mut writes = Vec::with_capacity(seen.len());
    for ((file, _), map) in files.iter().zip(&maps) {
        let st = map.tensors(file)?;
        for name in st.names() {
            if let Some(target) = wanted.get(name) {
                let view = st.tensor(name).expect("checked above");
                let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
                let source = Tensor::from_data_size(view.data(), &shape, target.kind());
                writes.push((target.shallow_clone(), source));
            }
        }
    }
    let report = LoadReport {
        missing,
        unexpected,
    };
    Ok((writes, report))
}
