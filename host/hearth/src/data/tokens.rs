//! Pre-tokenized data (`kind = "tokens"`): a flat file of token ids,
//! memory-mapped and never read whole — nanoGPT's `.bin` (little-endian
//! `uint16` or `uint32`, no header) or a 1-D NumPy `.npy`. Training
//! windows of `seq_len + 1` tokens are drawn at random (nanoGPT) or read in
//! order as numbered windows (`sampling = "sequential"`); validation takes
//! a second file or the file's last fraction.

use super::{Batch, TokenDataset, Windows};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tch::Tensor;

/// Why a data file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be read.
    #[error("failed to read dataset {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A file (the token cache) could not be written.
    #[error("failed to write {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not in the format its kind reads.
    #[error("dataset {path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong, where, and what to do.
        message: String,
    },
    /// A token id the model has no embedding for.
    #[error("dataset {path}: token {token} at position {index} (byte {offset}) is outside the vocabulary (vocab-size = {vocab}); set data.vocab-size to the tokenizer's vocabulary")]
    TokenOutOfRange {
        /// The file.
        path: PathBuf,
        /// The token's position in the file, counting tokens.
        index: u64,
        /// Its byte offset in the file.
        offset: u64,
        /// The id.
        token: i64,
        /// The vocabulary size.
        vocab: i64,
    },
    /// Too few tokens for one training or validation window.
    #[error("dataset {path}: the {part} part holds {tokens} tokens; seq-len {seq_len} needs at least {needed}")]
    TooShort {
        /// The file.
        path: PathBuf,
        /// `training` or `validation`.
        part: &'static str,
        /// Tokens it holds.
        tokens: u64,
        /// The configured sequence length.
        seq_len: i64,
        /// The smallest usable count.
        needed: u64,
    },
}

impl DataError {
    fn read(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| Self::Read {
            path: path.into(),
            source,
        }
    }
}

/// How ids are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenDtype {
    /// 1 byte (`|u1`).
    U8,
    /// 2 bytes, little-endian (nanoGPT's default).
    U16,
    /// 4 bytes, little-endian.
    U32,
    /// 4 bytes, little-endian, signed (`<i4`).
    I32,
    /// 8 bytes, little-endian, signed (`<i8`, NumPy's default integer).
    I64,
}

impl TokenDtype {
    /// Bytes per id.
    pub fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::U16 => 2,
            Self::U32 | Self::I32 => 4,
            Self::I64 => 8,
        }
    }

    /// NumPy's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "uint8",
            Self::U16 => "uint16",
            Self::U32 => "uint32",
            Self::I32 => "int32",
            Self::I64 => "int64",
        }
    }

    fn read(self, b: &[u8]) -> i64 {
        match self {
            Self::U8 => b[0] as i64,
            Self::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            Self::U32 => u32::from_le_bytes(b[..4].try_into().expect("4 bytes")) as i64,
            Self::I32 => i32::from_le_bytes(b[..4].try_into().expect("4 bytes")) as i64,
            Self::I64 => i64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        }
    }

    /// The dtype of a NumPy `descr` (`<u2`); `None` for one that is not
    /// an integer hearth reads.
    fn of_descr(descr: &str) -> Option<Self> {
        Some(match descr {
            "|u1" | "<u1" => Self::U8,
            "<u2" => Self::U16,
            "<u4" => Self::U32,
            "<i4" => Self::I32,
            "<i8" => Self::I64,
            _ => return None,
        })
    }
}

/// A memory-mapped file of token ids.
#[derive(Debug, Clone)]
pub struct TokenFile {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    /// Where the ids start (after a `.npy` header).
    offset: usize,
    dtype: TokenDtype,
    len: u64,
}

impl TokenFile {
    /// Maps `path`: a `.npy` (its header gives the dtype), else raw ids of
    /// `bin_dtype`.
    pub fn open(path: &Path, bin_dtype: TokenDtype) -> Result<Self, DataError> {
        let file = std::fs::File::open(path).map_err(DataError::read(path))?;
        // SAFETY: a read-only mapping of a file the run only reads.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(DataError::read(path))?;
        let (offset, dtype) = if path.extension().is_some_and(|e| e == "npy") {
            npy_header(path, &map)?
        } else {
            (0, bin_dtype)
        };
        let body = map.len() - offset;
        if body % dtype.size() != 0 {
            return Err(DataError::Format {
                path: path.into(),
                message: format!(
                    "{body} bytes of ids is not a multiple of {}'s {} bytes: the last {} bytes are a partial token (is data.dtype right?)",
                    dtype.name(),
                    dtype.size(),
                    body % dtype.size()
                ),
            });
        }
        Ok(Self {
            path: path.into(),
            len: (body / dtype.size()) as u64,
            map: Arc::new(map),
            offset,
            dtype,
        })
    }

    /// Number of ids.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the file holds no ids.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The id at `index`.
    pub fn get(&self, index: u64) -> i64 {
        let at = self.offset + index as usize * self.dtype.size();
        self.dtype.read(&self.map[at..at + self.dtype.size()])
    }

    /// Refuses the first id outside `0..vocab`, naming its position.
    pub fn check_vocab(&self, vocab: i64) -> Result<(), DataError> {
        let size = self.dtype.size();
        let body = &self.map[self.offset..];
        let bad = body
            .chunks_exact(size)
            .position(|b| !(0..vocab).contains(&self.dtype.read(b)));
        match bad {
            None => Ok(()),
            Some(i) => Err(DataError::TokenOutOfRange {
                path: self.path.clone(),
                index: i as u64,
                offset: (self.offset + i * size) as u64,
                token: self.dtype.read(&body[i * size..]),
                vocab,
            }),
        }
    }
}

/// The data offset and dtype of a 1-D `.npy` (format versions 1–3).
fn npy_header(path: &Path, map: &[u8]) -> Result<(usize, TokenDtype), DataError> {
    let bad = |message: String| DataError::Format {
        path: path.into(),
        message,
    };
    if map.len() < 10 || &map[..6] != b"\x93NUMPY" {
        return Err(bad("not a NumPy .npy file (no \\x93NUMPY magic)".into()));
    }
    let (len, start) = match map[6] {
        1 => (u16::from_le_bytes([map[8], map[9]]) as usize, 10),
        2 | 3 if map.len() >= 12 => (
            u32::from_le_bytes(map[8..12].try_into().expect("4 bytes")) as usize,
            12,
        ),
        v => {
            return Err(bad(format!(
                ".npy format version {v} is not one hearth reads"
            )))
        }
    };
    let header = map
        .get(start..start + len)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or_else(|| bad("the .npy header is cut short or not text".into()))?;
    let field = |key: &str| {
        let at = header.find(&format!("'{key}':"))? + key.len() + 3;
        Some(header[at..].trim_start())
    };
    let descr = field("descr")
        .and_then(|v| v.strip_prefix('\''))
        .and_then(|v| v.split('\'').next())
        .ok_or_else(|| bad("the .npy header has no descr".into()))?;
    let dtype = TokenDtype::of_descr(descr).ok_or_else(|| {
        bad(format!(
            "holds {descr}; token ids must be integers (uint8, uint16, uint32, int32 or int64, little-endian)"
        ))
    })?;
    if field("fortran_order").is_some_and(|v| v.starts_with("True")) {
        return Err(bad("is in Fortran order; save a 1-D array".into()));
    }
    let shape = field("shape")
        .and_then(|v| v.strip_prefix('('))
        .and_then(|v| v.split(')').next())
        .ok_or_else(|| bad("the .npy header has no shape".into()))?;
    let dims: Vec<&str> = shape
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    if dims.len() != 1 {
        return Err(bad(format!(
            "has shape ({shape}); token ids must be a 1-D array (flatten it)"
        )));
    }
    Ok((start + len, dtype))
}

/// A contiguous run of ids of one file.
#[derive(Debug, Clone)]
struct Part {
    file: TokenFile,
    start: u64,
    len: u64,
}

impl Part {
    fn window(&self, start: u64, width: usize, out: &mut Vec<i64>) {
        out.extend((0..width as u64).map(|i| self.file.get(self.start + start + i)));
    }
}

/// Where `kind = "tokens"` reads.
#[derive(Debug, Clone)]
pub struct TokensSpec<'a> {
    /// The training ids (and the validation ids when `val_path` is none).
    pub path: &'a Path,
    /// Held-out ids.
    pub val_path: Option<&'a Path>,
    /// The dtype of a `.bin`.
    pub dtype: TokenDtype,
    /// The fraction of `path` held out when there is no `val_path`.
    pub val_fraction: f64,
    /// Tokens per input sequence.
    pub seq_len: i64,
    /// The model's vocabulary.
    pub vocab_size: i64,
    /// Most validation windows scored.
    pub max_val_windows: usize,
}

/// Windows of pre-tokenized ids.
#[derive(Debug, Clone)]
pub struct Tokens {
    train: Part,
    val: Part,
    seq_len: i64,
    vocab_size: i64,
    max_val_windows: usize,
}

impl Tokens {
    /// Maps the files, checks every id against the vocabulary and that
    /// each part holds a window.
    pub fn open(spec: &TokensSpec) -> Result<Self, DataError> {
        let file = TokenFile::open(spec.path, spec.dtype)?;
        file.check_vocab(spec.vocab_size)?;
        let (train, val) = match spec.val_path {
            Some(val_path) => {
                let val = TokenFile::open(val_path, spec.dtype)?;
                val.check_vocab(spec.vocab_size)?;
                let (n, m) = (file.len(), val.len());
                (
                    Part {
                        file,
                        start: 0,
                        len: n,
                    },
                    Part {
                        file: val,
                        start: 0,
                        len: m,
                    },
                )
            }
            None => {
                let held = (file.len() as f64 * spec.val_fraction).round() as u64;
                let split = file.len() - held;
                (
                    Part {
                        file: file.clone(),
                        start: 0,
                        len: split,
                    },
                    Part {
                        file,
                        start: split,
                        len: held,
                    },
                )
            }
        };
        let needed = spec.seq_len as u64 + 1;
        for (part, name) in [(&train, "training"), (&val, "validation")] {
            if part.len < needed {
                return Err(DataError::TooShort {
                    path: part.file.path.clone(),
                    part: name,
                    tokens: part.len,
                    seq_len: spec.seq_len,
                    needed,
                });
            }
        }
        Ok(Self {
            train,
            val,
            seq_len: spec.seq_len,
            vocab_size: spec.vocab_size,
            max_val_windows: spec.max_val_windows.max(1),
        })
    }

    fn read(&self, part: &Part, starts: impl Iterator<Item = u64>) -> Batch {
        let width = self.seq_len as usize + 1;
        let mut data = Vec::new();
        let mut rows = 0;
        for s in starts {
            part.window(s, width, &mut data);
            rows += 1;
        }
        let data = Tensor::from_slice(&data).view([rows, width as i64]);
        Batch {
            inputs: data.narrow(1, 0, self.seq_len),
            targets: data.narrow(1, 1, self.seq_len),
        }
    }
}

/// Window k holds ids `[k·seq_len, (k+1)·seq_len]`: consecutive windows
/// overlap by the one id that is the last target of one and the first
/// input of the next, so every id but the first is a target once.
impl Windows for Tokens {
    fn count(&self) -> usize {
        ((self.train.len - 1) / self.seq_len as u64) as usize
    }
    fn batch(&self, indices: &[usize]) -> Batch {
        let t = self.seq_len as u64;
        self.read(&self.train, indices.iter().map(|&k| k as u64 * t))
    }
}

impl TokenDataset for Tokens {
    fn vocab_size(&self) -> i64 {
        self.vocab_size
    }
    fn seq_len(&self) -> i64 {
        self.seq_len
    }
    /// Windows starting anywhere in the training part (nanoGPT's
    /// `get_batch`).
    fn sample_batch(&self, batch_size: i64, rng: &mut ChaCha8Rng) -> Batch {
        let last = self.train.len - self.seq_len as u64 - 1;
        let starts: Vec<u64> = (0..batch_size)
            .map(|_| rng.random_range(0..=last))
            .collect();
        self.read(&self.train, starts.into_iter())
    }
    fn windows(&self) -> Option<&dyn Windows> {
        Some(self)
    }
    /// The validation part in windows of `seq_len + 1`, at most
    /// `[eval] samples` of them.
    fn validation_batches(&self, batch_size: i64) -> Vec<Batch> {
        let width = self.seq_len as u64 + 1;
        let count = ((self.val.len / width) as usize).min(self.max_val_windows);
        let starts: Vec<u64> = (0..count as u64).map(|k| k * width).collect();
        starts
            .chunks(batch_size.max(1) as usize)
            .map(|c| self.read(&self.val, c.iter().copied()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// A version-1 `.npy` of `ids` stored as `descr` (`<u2`, `<i8`).
    fn npy(ids: &[i64], descr: &str, shape: &str) -> Vec<u8> {
        let mut header =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend((header.len() as u16).to_le_bytes());
        bytes.extend(header.as_bytes());
        for &id in ids {
            match descr {
                "<u2" => bytes.extend((id as u16).to_le_bytes()),
                _ => bytes.extend(id.to_le_bytes()),
            }
        }
        bytes
    }

    fn spec(path: &Path, vocab: i64) -> TokensSpec<'_> {
        TokensSpec {
            path,
            val_path: None,
            dtype: TokenDtype::U16,
            val_fraction: 0.1,
            seq_len: 4,
            vocab_size: vocab,
            max_val_windows: 1000,
        }
    }

    #[test]
    fn windows_read_consecutive_ids_from_bin_and_npy_alike() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<i64> = (0..100).collect();
        let bin = dir.path().join("a.bin");
        std::fs::write(
            &bin,
            ids.iter()
                .flat_map(|&i| (i as u16).to_le_bytes())
                .collect::<Vec<u8>>(),
        )
        .unwrap();
        let npy_path = dir.path().join("a.npy");
        std::fs::write(&npy_path, npy(&ids, "<i8", "(100,)")).unwrap();
        for path in [&bin, &npy_path] {
            let data = Tokens::open(&spec(path, 100)).unwrap();
            let b = Windows::batch(&data, &[0, 3]);
            let x: Vec<i64> = Vec::try_from(b.inputs.reshape([-1])).unwrap();
            let y: Vec<i64> = Vec::try_from(b.targets.reshape([-1])).unwrap();
            assert_eq!(x, [0, 1, 2, 3, 12, 13, 14, 15]);
            assert_eq!(y, [1, 2, 3, 4, 13, 14, 15, 16]);
            // 90 training ids: windows of 5 starting every 4.
            assert_eq!(Windows::count(&data), 22);
            let sampled = data.sample_batch(50, &mut ChaCha8Rng::seed_from_u64(0));
            let x: Vec<i64> = Vec::try_from(sampled.inputs.reshape([-1])).unwrap();
            assert!(
                x.iter().all(|&t| t < 90),
                "training windows stay in the first 90"
            );
            let val = data.validation_batches(100);
            let first: Vec<i64> = Vec::try_from(val[0].inputs.get(0)).unwrap();
            assert_eq!(first, [90, 91, 92, 93]);
            assert_eq!(
                val[0].inputs.size(),
                [2, 4],
                "10 held-out ids: two windows of 5"
            );
        }
    }

    #[test]
    fn bad_files_are_refused_naming_the_file_and_the_place() {
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join("odd.bin");
        std::fs::write(&odd, [1u8, 0, 2]).unwrap();
        let e = Tokens::open(&spec(&odd, 10)).unwrap_err().to_string();
        assert!(
            e.contains("odd.bin") && e.contains("3 bytes") && e.contains("partial token"),
            "{e}"
        );

        let big = dir.path().join("big.bin");
        let ids: Vec<u8> = (0..50u16)
            .flat_map(|i| (if i == 37 { 300 } else { i % 7 }).to_le_bytes())
            .collect();
        std::fs::write(&big, ids).unwrap();
        let e = Tokens::open(&spec(&big, 256)).unwrap_err().to_string();
        assert!(
            e.contains("big.bin")
                && e.contains("token 300 at position 37 (byte 74)")
                && e.contains("vocab-size = 256"),
            "{e}"
        );

        let flat = dir.path().join("two.npy");
        std::fs::write(&flat, npy(&[1, 2, 3, 4], "<u2", "(2, 2)")).unwrap();
        let e = Tokens::open(&spec(&flat, 10)).unwrap_err().to_string();
        assert!(e.contains("two.npy") && e.contains("1-D"), "{e}");

        let floats = dir.path().join("f.npy");
        std::fs::write(&floats, npy(&[1, 2], "<f4", "(2,)")).unwrap();
        let e = Tokens::open(&spec(&floats, 10)).unwrap_err().to_string();
        assert!(
            e.contains("f.npy") && e.contains("<f4") && e.contains("integers"),
            "{e}"
        );

        let short = dir.path().join("short.bin");
        std::fs::write(&short, [0u8; 12]).unwrap();
        let e = Tokens::open(&spec(&short, 10)).unwrap_err().to_string();
        assert!(
            e.contains("short.bin") && e.contains("validation part holds 1 tokens"),
            "{e}"
        );
    }
}
