//! A byte-level language-modelling dataset from one text file: every byte is
//! a token (vocabulary 256); training windows are drawn at random from the
//! first 90 % of the file and the last 10 % is held out for validation.

use super::{Batch, TokenDataset};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use tch::Tensor;

/// Why a text file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TextFileError {
    /// The file could not be read.
    #[error("failed to read text dataset {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file has too few bytes for one training and one validation window.
    #[error("text dataset {path} has {len} bytes; seq-len {seq_len} needs at least {needed} (90 % train, 10 % validation, each one window + 1)")]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The configured sequence length.
        seq_len: i64,
        /// The smallest usable length.
        needed: usize,
    },
}

/// Bytes of a text file as tokens.
#[derive(Debug, Clone)]
pub struct TextFile {
    bytes: Vec<u8>,
    split: usize,
    seq_len: i64,
}

impl TextFile {
    /// Reads `path` and checks it holds enough bytes for `seq_len`.
    pub fn open(path: &Path, seq_len: i64) -> Result<Self, TextFileError> {
        let bytes = std::fs::read(path).map_err(|source| TextFileError::Read {
            path: path.into(),
            source,
        })?;
        let window = seq_len as usize + 1;
        let needed = 10 * window;
        if bytes.len() < needed {
            return Err(TextFileError::TooShort {
                path: path.into(),
                len: bytes.len(),
                seq_len,
                needed,
            });
        }
        let split = bytes.len() * 9 / 10;
        Ok(Self {
            bytes,
            split,
            seq_len,
        })
    }

    fn window_batch(&self, starts: &[usize]) -> Batch {
        let t = self.seq_len as usize;
        let mut data = Vec::with_capacity(starts.len() * (t + 1));
        for &s in starts {
            data.extend(self.bytes[s..s + t + 1].iter().map(|&b| b as i64));
        }
        let data = Tensor::from_slice(&data).view([starts.len() as i64, t as i64 + 1]);
        Batch {
            inputs: data.narrow(1, 0, self.seq_len),
            targets: data.narrow(1, 1, self.seq_len),
        }
    }
}

impl TokenDataset for TextFile {
    fn vocab_size(&self) -> i64 {
        256
    }
    fn seq_len(&self) -> i64 {
        self.seq_len
    }
    fn sample_batch(&self, batch_size: i64, rng: &mut ChaCha8Rng) -> Batch {
        let last_start = self.split - self.seq_len as usize - 1;
        let starts: Vec<usize> = (0..batch_size)
            .map(|_| rng.random_range(0..=last_start))
            .collect();
        self.window_batch(&starts)
    }
    fn validation_batches(&self, batch_size: i64) -> Vec<Batch> {
        let window = self.seq_len as usize + 1;
        let starts: Vec<usize> = (self.split..=self.bytes.len() - window)
            .step_by(window)
            .collect();
        starts
            .chunks(batch_size.max(1) as usize)
            .map(|c| self.window_batch(c))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn windows_are_consecutive_bytes_and_validation_is_held_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.txt");
        let text: Vec<u8> = (0..200u8).collect();
        std::fs::write(&path, &text).unwrap();
        let ds = TextFile::open(&path, 8).unwrap();
        let batch = ds.sample_batch(4, &mut ChaCha8Rng::seed_from_u64(0));
        let x: Vec<i64> = Vec::try_from(batch.inputs.get(0)).unwrap();
        let y: Vec<i64> = Vec::try_from(batch.targets.get(0)).unwrap();
        assert_eq!(&x[1..], &y[..7]);
        assert!(
            x.iter().all(|&b| b < 180),
            "training windows stay in the first 90 %"
        );
        let val = ds.validation_batches(64);
        let first: Vec<i64> = Vec::try_from(val[0].inputs.get(0)).unwrap();
        assert_eq!(first[0], 180);
    }

    #[test]
    fn a_short_file_is_refused_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.txt");
        std::fs::write(&path, b"tiny").unwrap();
        let err = TextFile::open(&path, 8).unwrap_err().to_string();
        assert!(
            err.contains(&path.display().to_string()) && err.contains("4 bytes"),
            "{err}"
        );
    }
}
