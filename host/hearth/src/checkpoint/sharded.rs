//! Sharded checkpoints (FSDP's SHARDED_STATE_DICT) in the layout torch
//! 2.11's `HuggingFaceStorageReader` reads (`torch.distributed.checkpoint`):
//! a folder of safetensors files, one per process
//! (`shard-00001-model-00001-of-00001.safetensors`, …), each holding that
//! process's pieces of the tensors under their full names, with
//! `DCP_SHARDING_INFO` in the file's metadata giving where each piece
//! starts in the whole tensor. [`ShardedTensors`] reads any rows of any
//! tensor back, whatever number of processes wrote them;
//! [`merge_fsdp_weights`] makes one model file of them.

use super::safetensors_io::{kind_of, open_mapped, save_safetensors_with, CheckpointError, Mapped};
use super::{save_model, SavedModel};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// The metadata key of each piece's offsets (torch's `CUSTOM_METADATA_KEY`).
const SHARDING_INFO: &str = "DCP_SHARDING_INFO";

/// The folder a sharded save puts prepared model `i`'s shards in
/// (Accelerate's name for the same).
pub fn model_shards_dir(i: usize) -> String {
    format!("pytorch_model_fsdp_{i}")
}

/// The folder a sharded save puts prepared optimizer `i`'s state shards in
/// (Accelerate's name for the same).
pub fn optimizer_shards_dir(i: usize) -> String {
    format!("optimizer_{i}")
}

/// The file process `rank` writes in a sharded folder (torch's
/// `HuggingFaceStorageWriter(save_distributed=True)` name).
pub fn shard_file_name(rank: usize) -> String {
    format!("shard-{:05}-model-00001-of-00001.safetensors", rank + 1)
}

/// One piece of a tensor: its values and where they start in the whole.
pub struct Piece {
    /// The whole tensor's name (`blocks.0.qkv.weight`).
    pub name: String,
    /// The values (a CPU tensor, or one that can be copied to the CPU).
    pub values: Tensor,
    /// Where the piece starts, per dimension of the whole tensor.
    pub offsets: Vec<i64>,
}

impl Piece {
    /// A whole tensor as a piece (offsets all 0).
    pub fn whole(name: &str, values: Tensor) -> Self {
        let offsets = vec![0; values.dim()];
        Self {
            name: name.into(),
            values,
            offsets,
        }
    }

    /// Rows `[start, start + rows)` of a tensor.
    pub fn rows(name: &str, values: Tensor, start: i64) -> Self {
        let mut offsets = vec![0; values.dim()];
        offsets[0] = start;
        Self {
            name: name.into(),
            values,
            offsets,
        }
    }
}

/// The rows of a whole tensor that one process holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldRows {
    /// The first row.
    pub start: i64,
    /// How many rows.
    pub count: i64,
    /// The whole tensor's shape.
    pub whole: Vec<i64>,
}

/// Writes `pieces` to `path` (atomically), with the metadata torch's reader
/// needs to place them.
pub fn save_pieces(path: &Path, pieces: &[Piece]) -> Result<Option<String>, CheckpointError> {
    let info: serde_json::Map<String, serde_json::Value> = pieces
        .iter()
        .map(|p| {
            let offsets = serde_json::json!({ "saved_offsets": p.offsets });
            (p.name.clone(), offsets)
        })
        .collect();
    let metadata = HashMap::from([
        (
            SHARDING_INFO.to_string(),
            serde_json::Value::from(info).to_string(),
        ),
        ("DCP_VERSION".to_string(), "1.0".to_string()),
    ]);
    let tensors: Vec<(String, Tensor)> = pieces
        .iter()
        .map(|p| (p.name.clone(), p.values.shallow_clone()))
        .collect();
    save_safetensors_with(path, &tensors, metadata)
}

/// Where one piece lies: its file and its box in the whole tensor.
struct Located {
    file: usize,
    offsets: Vec<i64>,
    shape: Vec<i64>,
    /// Where its values are in its file.
    bytes: std::ops::Range<usize>,
}

/// One tensor of a sharded folder.
struct Entry {
    whole: Vec<i64>,
    kind: Kind,
    pieces: Vec<Located>,
}

/// The tensors of a sharded folder, read on demand (the files are mapped,
/// and only the rows asked for are copied).
pub struct ShardedTensors {
    dir: PathBuf,
    files: Vec<(PathBuf, Mapped)>,
    entries: BTreeMap<String, Entry>,
}

fn format_err(path: &Path, message: String) -> CheckpointError {
    CheckpointError::Format {
        path: path.into(),
        message,
    }
}

impl ShardedTensors {
    /// Opens every `*.safetensors` file of `dir` and reads their headers.
    /// A file without `DCP_SHARDING_INFO` holds whole tensors (as torch's
    /// reader takes it).
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(CheckpointError::io(dir))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(format_err(
                dir,
                "holds no .safetensors files (a sharded checkpoint folder has one per process)"
                    .into(),
            ));
        }
        let mut files = Vec::with_capacity(paths.len());
        let mut entries: BTreeMap<String, Entry> = BTreeMap::new();
        for (file, path) in paths.into_iter().enumerate() {
            let map = open_mapped(&path)?;
            // The header once (it is checked against the file's length);
            // each piece's bytes are then sliced from the mapping directly.
            let (header_len, header) = safetensors::SafeTensors::read_metadata(map.bytes())
                .map_err(|e| format_err(&path, e.to_string()))?;
            let data_start = 8 + header_len;
            let info: Option<serde_json::Value> = header
                .metadata()
                .as_ref()
                .and_then(|m| m.get(SHARDING_INFO))
                .map(|text| serde_json::from_str(text))
                .transpose()
                .map_err(|e| format_err(&path, format!("{SHARDING_INFO} is not JSON: {e}")))?;
            for (name, view) in header.tensors() {
                let kind = kind_of(view.dtype).ok_or_else(|| {
                    format_err(
                        &path,
                        format!("`{name}` has unsupported dtype {:?}", view.dtype),
                    )
                })?;
                let shape = super::safetensors_io::checked_shape(&path, &name, &view.shape, kind)?;
                let (begin, end) = view.data_offsets;
                let offsets: Vec<i64> = match &info {
                    None => vec![0; shape.len()],
                    Some(info) => info
                        .get(&name)
                        .and_then(|v| v.get("saved_offsets"))
                        .and_then(|v| serde_json::from_value(v.clone()).ok())
                        .ok_or_else(|| {
                            format_err(
                                &path,
                                format!("{SHARDING_INFO} has no offsets for `{name}`"),
                            )
                        })?,
                };
                if offsets.len() != shape.len() {
                    return Err(format_err(
                        &path,
                        format!(
                            "`{name}` has {} dimensions and {} offsets",
                            shape.len(),
                            offsets.len()
                        ),
                    ));
                }
                let entry = entries.entry(name.clone()).or_insert_with(|| Entry {
                    whole: vec![0; shape.len()],
                    kind,
                    pieces: Vec::new(),
                });
                if entry.kind != kind || entry.whole.len() != shape.len() {
                    return Err(format_err(
                        &path,
                        format!("`{name}` is {kind:?} with {} dimensions here, {:?} with {} in another file", shape.len(), entry.kind, entry.whole.len()),
                    ));
                }
                for (w, (o, s)) in entry.whole.iter_mut().zip(offsets.iter().zip(&shape)) {
                    let end = (*o >= 0).then(|| o.checked_add(*s)).flatten();
                    let end = end.ok_or_else(|| {
                        format_err(
                            &path,
                            format!("`{name}` has impossible offsets {offsets:?}"),
                        )
                    })?;
                    *w = (*w).max(end);
                }
                entry.pieces.push(Located {
                    file,
                    offsets,
                    shape,
                    bytes: data_start + begin..data_start + end,
                });
            }
            files.push((path, map));
        }
        Ok(Self {
            dir: dir.into(),
            files,
            entries,
        })
    }

    /// The tensors' names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The whole shape and kind of tensor `name`, if the folder has it.
    pub fn shape(&self, name: &str) -> Option<(&[i64], Kind)> {
        self.entries.get(name).map(|e| (e.whole.as_slice(), e.kind))
    }

    fn entry(&self, name: &str) -> Result<&Entry, CheckpointError> {
        self.entries.get(name).ok_or_else(|| {
            format_err(
                &self.dir,
                format!("holds no tensor `{name}` in any shard file"),
            )
        })
    }

    /// The whole tensor `name`.
    pub fn read(&self, name: &str) -> Result<Tensor, CheckpointError> {
        let entry = self.entry(name)?;
        match entry.whole.first() {
            Some(&rows) => self.read_rows(name, 0, rows),
            None => {
                let piece = &entry.pieces[0];
                Ok(self.rows_of_piece(piece, entry.kind, 0, 1, &[]))
            }
        }
    }

    /// Rows `[start, start + count)` of tensor `name` (cut along dimension 0),
    /// from whichever pieces hold them.
    pub fn read_rows(&self, name: &str, start: i64, count: i64) -> Result<Tensor, CheckpointError> {
        let entry = self.entry(name)?;
        let Some(&rows) = entry.whole.first() else {
            return Err(format_err(
                &self.dir,
                format!("`{name}` is a scalar; it has no rows"),
            ));
        };
        if start < 0 || count < 0 || start + count > rows {
            return Err(format_err(
                &self.dir,
                format!(
                    "`{name}` has {rows} rows; rows {start}..{} were asked for",
                    start + count
                ),
            ));
        }
        // Every row asked for must be in some piece, checked before the
        // output is allocated (a header cannot make a reader allocate more
        // than the files hold).
        let mut spans: Vec<(i64, i64)> = entry
            .pieces
            .iter()
            .filter_map(|p| {
                Some((
                    *p.offsets.first()?,
                    p.offsets[0].checked_add(*p.shape.first()?)?,
                ))
            })
            .map(|(a, b)| (a.max(start), b.min(start + count)))
            .filter(|(lo, hi)| lo < hi)
            .collect();
        spans.sort();
        let mut next = start;
        for (lo, hi) in spans {
            if lo > next {
                break;
            }
            next = next.max(hi);
        }
        if next < start + count {
            return Err(format_err(
                &self.dir,
                format!(
                    "no shard file holds row {next} of `{name}` (a process's file is missing?)"
                ),
            ));
        }
        let mut shape = entry.whole.clone();
        shape[0] = count;
        // Every row is written below.
        let out = Tensor::empty(shape.as_slice(), (entry.kind, tch::Device::Cpu));
        for piece in &entry.pieces {
            if piece.offsets[1..].iter().any(|&o| o != 0) || piece.shape[1..] != entry.whole[1..] {
                return Err(format_err(
                    &self.files[piece.file].0,
                    format!(
                        "`{name}` is cut along a dimension other than 0 (a piece at {:?} of shape {:?}); hearth reads pieces of whole rows only",
                        piece.offsets, piece.shape
                    ),
                ));
            }
            let (a, b) = (piece.offsets[0], piece.offsets[0] + piece.shape[0]);
            let (lo, hi) = (a.max(start), b.min(start + count));
            if lo >= hi {
                continue;
            }
            let values = self.rows_of_piece(piece, entry.kind, lo - a, hi - lo, &entry.whole[1..]);
            tch::no_grad(|| out.narrow(0, lo - start, hi - lo).copy_(&values));
        }
        Ok(out)
    }

    /// `count` rows of `piece` (of kind `kind`) from its row `first` (a
    /// scalar piece whole).
    fn rows_of_piece(
        &self,
        piece: &Located,
        kind: Kind,
        first: i64,
        count: i64,
        trailing: &[i64],
    ) -> Tensor {
        let data = &self.files[piece.file].1.bytes()[piece.bytes.clone()];
        if piece.shape.is_empty() {
            return Tensor::from_data_size(data, &[], kind);
        }
        let row_bytes = trailing.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
        let bytes = &data[first as usize * row_bytes..(first + count) as usize * row_bytes];
        let mut shape = vec![count];
        shape.extend_from_slice(trailing);
        Tensor::from_data_size(bytes, &shape, kind)
    }
}

/// The sharded folder to merge: `checkpoint_dir` itself, or the single
/// model's folder of a hearth checkpoint.
fn shards_folder(checkpoint_dir: &Path) -> Result<PathBuf, CheckpointError> {
    let model = checkpoint_dir.join(model_shards_dir(0));
    if model.is_dir() && !checkpoint_dir.join(model_shards_dir(1)).exists() {
        return Ok(model);
    }
    // A checkpoint folder's own files are whole state, not shards.
    let checkpoint = checkpoint_dir.join(super::MANIFEST_NAME).exists();
    let has_shards = !checkpoint
        && std::fs::read_dir(checkpoint_dir)
            .map_err(CheckpointError::io(checkpoint_dir))?
            .flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
    if has_shards {
        return Ok(checkpoint_dir.into());
    }
    let message = if model.is_dir() {
        format!(
            "holds the shards of several models; pass one folder, e.g. {}",
            model.display()
        )
    } else {
        "holds no shard files; pass a checkpoint saved with state-dict-type = \"SHARDED_STATE_DICT\", or its pytorch_model_fsdp_<i> or optimizer_<i> folder".into()
    };
    Err(format_err(checkpoint_dir, message))
}

/// Merges the shards of a SHARDED_STATE_DICT save into `output_path`
/// (Accelerate's `merge_fsdp_weights`): `model.safetensors`, or numbered
/// files with an index when they exceed `max_shard_size` bytes.
/// `checkpoint_dir` is a checkpoint folder with one model, or a
/// `pytorch_model_fsdp_<i>` or `optimizer_<i>` folder of one.
pub fn merge_fsdp_weights(
    checkpoint_dir: &Path,
    output_path: &Path,
    max_shard_size: Option<u64>,
) -> Result<SavedModel, CheckpointError> {
    let folder = shards_folder(checkpoint_dir)?;
    let shards = ShardedTensors::open(&folder)?;
    let tensors = shards
        .names()
        .map(|name| Ok((name.to_string(), shards.read(name)?)))
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    save_model(output_path, &tensors, max_shard_size.unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: i64, cols: i64) -> Tensor {
        Tensor::arange(n * cols, (Kind::Float, tch::Device::Cpu)).reshape([n, cols])
    }

    /// Writes `t` cut into `world` FSDP chunks, one file per process.
    fn write_cut(dir: &Path, name: &str, t: &Tensor, world: i64) {
        let n = t.size()[0];
        let chunk = (n + world - 1) / world;
        for r in 0..world {
            let start = (r * chunk).min(n);
            let count = (start + chunk).min(n) - start;
            let mut pieces = vec![];
            if count > 0 {
                pieces.push(Piece::rows(name, t.narrow(0, start, count), start));
            }
            if r == 0 {
                pieces.push(Piece::whole("step", Tensor::from(7.0f32)));
            }
            save_pieces(&dir.join(shard_file_name(r as usize)), &pieces).unwrap();
        }
    }

    #[test]
    fn rows_are_read_back_across_pieces_written_by_another_number_of_processes() {
        let dir = tempfile::tempdir().unwrap();
        let t = rows(10, 3);
        write_cut(dir.path(), "w", &t, 4); // rows 3, 3, 3, 1
        let shards = ShardedTensors::open(dir.path()).unwrap();
        assert_eq!(shards.shape("w").unwrap().0, [10, 3]);
        assert!(shards.read("w").unwrap().equal(&t));
        // As process 1 of 3 would own them: rows 4..8, from three pieces.
        assert!(shards
            .read_rows("w", 4, 4)
            .unwrap()
            .equal(&t.narrow(0, 4, 4)));
        assert_eq!(shards.read("step").unwrap().double_value(&[]), 7.0);
        assert!(shards.read_rows("w", 8, 3).is_err(), "past the end");
    }

    #[test]
    fn a_missing_process_file_is_named_not_read_as_zeros() {
        let dir = tempfile::tempdir().unwrap();
        write_cut(dir.path(), "w", &rows(10, 3), 4);
        std::fs::remove_file(dir.path().join(shard_file_name(2))).unwrap();
        let shards = ShardedTensors::open(dir.path()).unwrap();
        let err = shards.read("w").unwrap_err().to_string();
        assert!(err.contains("no shard file holds row 6 of `w`"), "{err}");
    }

    #[test]
    fn merging_gives_the_whole_tensors_in_one_file() {
        let dir = tempfile::tempdir().unwrap();
        let shards = dir.path().join(model_shards_dir(0));
        std::fs::create_dir(&shards).unwrap();
        let t = rows(5, 2);
        write_cut(&shards, "w", &t, 2);
        let out = dir.path().join("merged");
        let saved = merge_fsdp_weights(dir.path(), &out, None).unwrap();
        assert_eq!(saved.files, vec![out.join("model.safetensors")]);
        let merged =
            crate::checkpoint::load_safetensors(&saved.files[0], tch::Device::Cpu).unwrap();
        assert_eq!(merged[1].0, "w");
        assert!(merged[1].1.equal(&t));
    }
}
