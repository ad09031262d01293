//! What a checkpoint or weights file holds, and a full read of it: behind
//! `hearth checkpoint inspect` and `hearth checkpoint verify`.

use super::safetensors_io::{open_mapped, CheckpointError};
use super::state_dir::{verify_complete, verify_contents, MANIFEST_NAME};
use std::path::{Path, PathBuf};

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Its name.
    pub name: String,
    /// safetensors dtype (`F32`, `BF16`, …).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Bytes of data.
    pub bytes: usize,
}

/// The tensors of a safetensors file, by name. With `read_data`, every
/// tensor's bytes are read too (which checks they lie inside the file).
pub fn tensor_infos(path: &Path, read_data: bool) -> Result<Vec<TensorInfo>, CheckpointError> {
    let map = open_mapped(path)?;
    let st = map.tensors(path)?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        if read_data {
            // Touch every byte: a file cut short or a hole shows up here.
            let sum: u64 = view.data().iter().map(|&b| b as u64).sum();
            std::hint::black_box(sum);
        }
        out.push(TensorInfo {
            name,
            dtype: format!("{:?}", view.dtype()),
            shape: view.shape().to_vec(),
            bytes: view.data().len(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// A file of a checkpoint folder and, for safetensors, its tensors.
#[derive(Debug, Clone)]
pub struct FileReport {
    /// Name inside the folder.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Its tensors (safetensors files only).
    pub tensors: Vec<TensorInfo>,
}

/// Checks a checkpoint folder completely: its manifest, every file's size
/// and content hash, every safetensors file's header and data, every JSON
/// file's syntax.
/// Returns what it found, file by file.
pub fn verify_checkpoint(dir: &Path) -> Result<Vec<FileReport>, CheckpointError> {
    describe_checkpoint(dir, true)
}

/// What a complete checkpoint folder holds, file by file: its manifest and
/// sizes checked, the safetensors headers read, and with `read_data` every
/// tensor's bytes and every JSON file too (see [`verify_checkpoint`]).
pub fn describe_checkpoint(
    dir: &Path,
    read_data: bool,
) -> Result<Vec<FileReport>, CheckpointError> {
    let manifest = verify_complete(dir)?;
    if read_data {
        verify_contents(dir, &manifest)?;
    }
    let mut reports = Vec::new();
    for f in manifest.files {
        let path: PathBuf = dir.join(&f.name);
        let tensors = if f.name.ends_with(".safetensors") {
            // A file whose hash was just checked has had every byte read:
            // its tensors' data need not be read again, only its header.
            tensor_infos(&path, read_data && f.xxh3.is_none())?
        } else {
            Vec::new()
        };
        if read_data && f.name.ends_with(".json") {
            let text = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
            serde_json::from_slice::<serde_json::Value>(&text).map_err(|e| {
                CheckpointError::Format {
                    path: path.clone(),
                    message: format!("not valid JSON: {e}"),
                }
            })?;
        }
        reports.push(FileReport {
            name: f.name,
            size: f.size,
            tensors,
        });
    }
    Ok(reports)
}

/// True when `dir` looks like a checkpoint folder (it has a manifest, valid
/// or not).
pub fn is_checkpoint_dir(dir: &Path) -> bool {
    dir.join(MANIFEST_NAME).exists()
}
