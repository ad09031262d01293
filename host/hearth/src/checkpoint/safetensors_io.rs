//! Reading and writing named tensors as safetensors.

use super::digest::Hashing;
use super::writeback::Writeback;
use hearth_ops::durable::replace_atomically;
pub(crate) use hearth_ops::tensor::{dtype_of, kind_of, tensor_bytes};
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo, TensorView, View};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// Why a checkpoint file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// An I/O error on `path`.
    #[error("failed to access {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid safetensors.
    #[error("{path} is not a valid safetensors file: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// A tensor in a file does not fit the model's tensor of that name.
    #[error("{path}: tensor `{name}` does not fit the model: {message}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Both shapes or dtypes.
        message: String,
    },
    /// With `strict`, the checkpoint and the model hold different names.
    #[error("{path} does not match the model (strict load): missing {missing:?}, unexpected {unexpected:?}; load with strict off to skip them")]
    Keys {
        /// The checkpoint.
        path: PathBuf,
        /// In the model, not in the checkpoint.
        missing: Vec<String>,
        /// In the checkpoint, not in the model.
        unexpected: Vec<String>,
    },
    /// A save would overwrite this existing folder.
    #[error("{0} already exists; a checkpoint is never overwritten — save under another name or remove it")]
    Exists(PathBuf),
    /// The folder is not a complete checkpoint.
    #[error("{path} is not a complete checkpoint: {why}")]
    Incomplete {
        /// The folder.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A file of the checkpoint no longer hashes as it did when written.
    #[error(
        "{path} is damaged: {why}; resume from an older checkpoint or restore this one from a copy"
    )]
    Damaged {
        /// The checkpoint folder.
        path: PathBuf,
        /// Which file changed, and its hashes.
        why: String,
    },
    /// Storage refused the save: a full file system, a used-up quota, a
    /// file size limit or a failing disk (see `checkpoint::storage`).
    #[error("{message}")]
    Storage {
        /// The checkpoint.
        path: PathBuf,
        /// Which file system, the bytes needed and free, what to do.
        message: String,
    },
    /// No checkpoint where one was looked for.
    #[error("no complete checkpoint in {0}")]
    NotFound(PathBuf),
    /// A checkpoint does not fit what is being restored.
    #[error("{path}: {message}")]
    State {
        /// The file or folder.
        path: PathBuf,
        /// What does not fit, and what to do.
        message: String,
    },
    /// A checkpoint hook failed: the save was abandoned or the load refused.
    #[error("checkpoint {path}: hook `{hook}` failed, so it was not {outcome}")]
    Hook {
        /// The checkpoint.
        path: PathBuf,
        /// The hook plugin's name.
        hook: String,
        /// What did not happen.
        outcome: &'static str,
        /// What the hook did.
        #[source]
        source: Box<hearth_plugins::PluginError>,
    },
    /// A tensor has a dtype safetensors cannot store.
    #[error("tensor `{name}` has dtype {kind:?}, which hearth cannot store in safetensors")]
    Dtype {
        /// The tensor's name.
        name: String,
        /// Its kind.
        kind: Kind,
    },
}

impl CheckpointError {
    /// Wraps an I/O error on `path` (for `map_err`).
    pub fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// Writes `tensors` to `path` atomically, with `{"format": "pt"}` metadata.
/// Returns the file's content hash ([`super::digest`]; none when hashes
/// are off).
pub fn save_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
) -> Result<Option<String>, CheckpointError> {
    save_safetensors_with(path, tensors, HashMap::new())
}

/// A tensor to write, known by its name, kind and shape before its values
/// are: what a streamed save lays out first ([`super::write_order`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Its name in the file.
    pub name: String,
    /// Its kind.
    pub kind: Kind,
    /// Its shape.
    pub shape: Vec<i64>,
}

impl TensorMeta {
    /// `t`'s name, kind and shape.
    pub fn of(name: &str, t: &Tensor) -> Self {
        Self {
            name: name.to_string(),
            kind: t.kind(),
            shape: t.size(),
        }
    }

    /// Bytes of its values.
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<i64>().max(0) as u64 * self.kind.elt_size_in_bytes() as u64
    }
}

/// [`save_safetensors`] with more `metadata` beside `{"format": "pt"}`.
pub(super) fn save_safetensors_with(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: HashMap<String, String>,
) -> Result<Option<String>, CheckpointError> {
    let metas: Vec<TensorMeta> = tensors.iter().map(|(n, t)| TensorMeta::of(n, t)).collect();
    save_safetensors_fetched(
        path,
        &metas,
        &mut |i| Ok(tensors[i].1.shallow_clone()),
        metadata,
    )
}

/// The order a safetensors file lays its tensors out in, as indices into
/// `tensors`: by descending dtype, then by name (the safetensors crate's
/// `prepare`), which is the order [`save_safetensors_fetched`] fetches them in.
pub(crate) fn layout_order(tensors: &[TensorMeta]) -> Result<Vec<usize>, CheckpointError> {
    let dtypes = tensors
        .iter()
        .map(|t| {
            dtype_of(t.kind).ok_or_else(|| CheckpointError::Dtype {
                name: t.name.clone(),
                kind: t.kind,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&l, &r| {
        dtypes[r]
            .cmp(&dtypes[l])
            .then(tensors[l].name.cmp(&tensors[r].name))
    });
    Ok(order)
}

/// A tensor of a streamed save: its values fetched when the writer gets to
/// it, and dropped once written.
struct Fetched<'a> {
    meta: &'a TensorMeta,
    dtype: Dtype,
    shape: Vec<usize>,
    value: std::cell::OnceCell<Tensor>,
    fetch: &'a dyn Fn(usize) -> Result<Tensor, CheckpointError>,
    index: usize,
    /// The first fetch that failed (the file is then not committed).
    failed: &'a RefCell<Option<CheckpointError>>,
    /// The file being written, whose writeback moves on before each tensor.
    writeback: &'a RefCell<Option<Writeback>>,
}

impl View for Fetched<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // Asked for just before its bytes are written: what was written so
        // far goes to disk meanwhile.
        if let Some(writeback) = self.writeback.borrow_mut().as_mut() {
            writeback.advance();
        }
        let value = self.value.get_or_init(|| {
            let fetched = (self.fetch)(self.index).and_then(|t| {
                let t = t.detach().to_device(Device::Cpu).contiguous();
                match t.size() == self.meta.shape && t.kind() == self.meta.kind {
                    true => Ok(t),
                    false => Err(CheckpointError::Format {
                        path: PathBuf::from(&self.meta.name),
                        message: format!(
                            "{} came as {:?} {:?}, not the {:?} {:?} the header says",
                            self.meta.name,
                            t.kind(),
                            t.size(),
                            self.meta.kind,
                            self.meta.shape
                        ),
                    }),
                }
            });
            fetched.unwrap_or_else(|e| {
                self.failed.borrow_mut().get_or_insert(e);
                Tensor::zeros(self.meta.shape.as_slice(), (self.meta.kind, Device::Cpu))
            })
        });
        Cow::Borrowed(tensor_bytes(value))
    }
    fn data_len(&self) -> usize {
        self.meta.bytes() as usize
    }
}

/// Writes the tensors `metas` describes to `path` atomically, with
/// `{"format": "pt"}` and `metadata`, each fetched by `fetch` (given its
/// index into `metas`) just before it is written and dropped after: the
/// file never has to be in memory whole. Fetches come in [`layout_order`].
/// A failed fetch fails the save, the file not committed.
pub(super) fn save_safetensors_fetched(
    path: &Path,
    metas: &[TensorMeta],
    fetch: &mut dyn FnMut(usize) -> Result<Tensor, CheckpointError>,
    mut metadata: HashMap<String, String>,
) -> Result<Option<String>, CheckpointError> {
    let order = layout_order(metas)?;
    let cell = RefCell::new(fetch);
    let fetch = |i: usize| (cell.borrow_mut())(i);
    let (writeback, failed) = (RefCell::new(None), RefCell::new(None));
    let views = || -> Vec<(&str, Fetched<'_>)> {
        order
            .iter()
            .map(|&i| {
                let meta = &metas[i];
                let view = Fetched {
                    meta,
                    dtype: dtype_of(meta.kind).expect("checked by layout_order"),
                    shape: meta.shape.iter().map(|&d| d as usize).collect(),
                    value: Default::default(),
                    fetch: &fetch,
                    index: i,
                    failed: &failed,
                    writeback: &writeback,
                };
                (meta.name.as_str(), view)
            })
            .collect()
    };
    metadata.insert("format".to_string(), "pt".to_string());
    // Streamed to the file tensor by tensor and hashed on the way, then
    // fsynced and renamed into place.
    let mut format_error = None;
    let mut digest = None;
    let written = replace_atomically(path, |tmp| {
        *writeback.borrow_mut() = Some(Writeback::new(tmp));
        let file = std::fs::File::create(tmp)?;
        let mut out = Hashing::new(BufWriter::with_capacity(1 << 20, file));
        write_safetensors(&mut out, views(), metadata).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(io) => io,
            other => {
                let message = other.to_string();
                format_error = Some(message.clone());
                std::io::Error::other(message)
            }
        })?;
        if failed.borrow().is_some() {
            return Err(std::io::Error::other("a tensor could not be fetched"));
        }
        let (buffered, hash) = out.finish();
        buffered.into_inner().map_err(|e| e.into_error())?;
        digest = hash;
        Ok(())
    });
    if let Some(e) = failed.into_inner() {
        return Err(e);
    }
    match (written, format_error) {
        (Ok(()), _) => Ok(digest),
        (Err(_), Some(message)) => Err(CheckpointError::Format {
            path: path.into(),
            message,
        }),
        (Err(source), None) => Err(CheckpointError::io(path)(source)),
    }
}

/// Writes a safetensors file to `out`, byte for byte as the safetensors
/// crate's `serialize` lays it out (its `prepare`), `data` already in
/// [`layout_order`]: an 8-byte little-endian header length; the header
/// JSON padded with spaces to a multiple of 8; the data. Written here,
/// rather than by `serialize_to_file`, so that the bytes pass through a
/// hasher on their way, and each tensor is dropped once written.
fn write_safetensors<V: View>(
    out: &mut Hashing<impl Write>,
    data: Vec<(&str, V)>,
    metadata: HashMap<String, String>,
) -> Result<(), safetensors::SafeTensorError> {
    let mut offset = 0;
    let infos = data
        .iter()
        .map(|(name, v)| {
            let n = v.data_len();
            let info = TensorInfo {
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                data_offsets: (offset, offset + n),
            };
            offset += n;
            (name.to_string(), info)
        })
        .collect();
    let header = Metadata::new(Some(metadata), infos)?;
    let mut header = serde_json::to_string(&header)?.into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(&header)?;
    for (_, v) in data {
        out.write_all_overlapped(&v.data())?;
    }
    Ok(())
}

/// A safetensors file mapped into memory.
pub(crate) struct Mapped(memmap2::Mmap);

impl Mapped {
    /// The file's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// Parses the header (cheap: the data stays on disk until read).
    pub(crate) fn tensors(&self, path: &Path) -> Result<SafeTensors<'_>, CheckpointError> {
        SafeTensors::deserialize(&self.0).map_err(|e| CheckpointError::Format {
            path: path.into(),
            message: e.to_string(),
        })
    }
}

/// Maps `path` read-only.
pub(crate) fn open_mapped(path: &Path) -> Result<Mapped, CheckpointError> {
    let file = std::fs::File::open(path).map_err(CheckpointError::io(path))?;
    // SAFETY: a read-only mapping; hearth never writes a file in place (all
    // writes go to a new file renamed over the old one).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(CheckpointError::io(path))?;
    Ok(Mapped(map))
}

/// Reads every tensor of a safetensors file (memory-mapped) onto `device`.
pub fn load_safetensors(
    path: &Path,
    device: Device,
) -> Result<Vec<(String, Tensor)>, CheckpointError> {
    let map = open_mapped(path)?;
    let st = map.tensors(path)?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        out.push((
            name.clone(),
            tensor_from_view(path, &name, &view)?.to_device(device),
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

pub(crate) fn tensor_from_view(
    path: &Path,
    name: &str,
    view: &TensorView,
) -> Result<Tensor, CheckpointError> {
    let kind = kind_of(view.dtype()).ok_or_else(|| CheckpointError::Format {
        path: path.into(),
        message: format!("tensor `{name}` has unsupported dtype {:?}", view.dtype()),
    })?;
    let shape = checked_shape(path, name, view.shape(), kind)?;
    Ok(Tensor::from_data_size(view.data(), &shape, kind))
}

/// `dims` as libtorch sizes, refused (naming the tensor and the file) when
/// a dimension or the bytes they hold do not fit in an `i64`.
pub(crate) fn checked_shape(
    path: &Path,
    name: &str,
    dims: &[usize],
    kind: Kind,
) -> Result<Vec<i64>, CheckpointError> {
    let bad = || CheckpointError::Format {
        path: path.into(),
        message: format!("tensor `{name}` has an impossible shape {dims:?}"),
    };
    let shape: Vec<i64> = dims
        .iter()
        .map(|&d| i64::try_from(d).map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(kind.elt_size_in_bytes() as i64, |n, &d| n.checked_mul(d))
        .ok_or_else(bad)?;
    Ok(shape)
}

/// Reads the tensor `name` of the safetensors file at `path` (mapped; only
/// that tensor's bytes are read), on the CPU.
pub fn read_safetensor(path: &Path, name: &str) -> Result<Tensor, CheckpointError> {
    let map = open_mapped(path)?;
    let st = map.tensors(path)?;
    let view = st.tensor(name).map_err(|_| CheckpointError::Format {
        path: path.into(),
        message: format!("it holds no tensor `{name}`"),
    })?;
    tensor_from_view(path, name, &view)
}

#[cfg(test)]
mod tests {

    #[test]
    fn files_are_byte_for_byte_what_the_safetensors_crate_writes() {
        let tensors = [
            (
                "b.weight",
                Tensor::from_slice(&[1.5f32, -2.0, 3.25, 0.0]).view([2, 2]),
            ),
            ("a.bias", Tensor::from_slice(&[7i64, -9])),
            (
                "c.half",
                Tensor::from_slice(&[0.5f32, 1.0, 2.0]).to_kind(Kind::BFloat16),
            ),
            ("d.empty", Tensor::zeros([0, 3], (Kind::Float, Device::Cpu))),
            ("a.mask", Tensor::from_slice(&[true, false, true])),
        ];
        let named: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(n, t)| (n.to_string(), t.shallow_clone()))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let digest = save_safetensors(&path, &named).unwrap();
        let ours = std::fs::read(&path).unwrap();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, t)| {
                let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
                (
                    n.to_string(),
                    TensorView::new(dtype_of(t.kind()).unwrap(), shape, tensor_bytes(t)).unwrap(),
                )
            })
            .collect();
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        let theirs = safetensors::serialize(views, Some(metadata)).unwrap();
        assert_eq!(ours, theirs);
        assert_eq!(digest.unwrap(), super::super::digest::of_bytes(&theirs));
    }

    use super::*;

    #[test]
    fn round_trips_names_dtypes_and_values() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.safetensors");
        let a = Tensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0]).view([2, 2]);
        let b = Tensor::from_slice(&[7i64, 8, 9]);
        let c = Tensor::from_slice(&[1.0f32, 2.0]).to_kind(Kind::BFloat16);
        save_safetensors(
            &path,
            &[
                ("a.weight".into(), a.shallow_clone()),
                ("b".into(), b.shallow_clone()),
                ("c".into(), c.shallow_clone()),
            ],
        )
        .unwrap();
        let back = load_safetensors(&path, Device::Cpu).unwrap();
        assert_eq!(
            back.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            ["a.weight", "b", "c"]
        );
        assert!(back[0].1.equal(&a) && back[1].1.equal(&b) && back[2].1.equal(&c));
        assert_eq!(back[2].1.kind(), Kind::BFloat16);
    }

    #[test]
    fn a_corrupt_file_names_itself() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        std::fs::write(&path, b"not a safetensors file").unwrap();
        let err = load_safetensors(&path, Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
    }
}
