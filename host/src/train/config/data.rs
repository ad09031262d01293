//! `[data]`: which dataset and the batch size.

use super::{only_for, ConfigError, Invalid};
use serde::Deserialize;
use std::path::PathBuf;

/// Which dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataKind {
    /// Sort a string of digits (`data::SortDigits`), with an exact-match eval.
    SortDigits,
    /// Bytes of a text file (`data::TextFile`), with a validation loss.
    TextFile,
    /// Uniform random tokens, for benchmarks (`data::RandomTokens`).
    RandomTokens,
}

/// The `[data]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DataSection {
    /// `sort-digits`, `text-file` or `random-tokens`.
    pub kind: DataKind,
    /// Examples per step (default 16).
    #[serde(default = "default_batch_size")]
    pub batch_size: i64,
    /// sort-digits: digits per string (default 8).
    pub digits: Option<i64>,
    /// text-file: the file, relative to the config's folder.
    pub path: Option<PathBuf>,
    /// text-file, random-tokens: tokens per sequence (default 128).
    pub seq_len: Option<i64>,
    /// random-tokens: number of distinct tokens (default 256).
    pub vocab_size: Option<i64>,
}

fn default_batch_size() -> i64 {
    16
}

impl DataSection {
    /// sort-digits: digits per string.
    pub fn digits(&self) -> i64 {
        self.digits.unwrap_or(8)
    }
    /// Tokens per sequence for text-file and random-tokens.
    pub fn seq_len(&self) -> i64 {
        self.seq_len.unwrap_or(128)
    }
    /// random-tokens: vocabulary size.
    pub fn vocab_size(&self) -> i64 {
        self.vocab_size.unwrap_or(256)
    }

    pub(super) fn validate(&self, invalid: &Invalid) -> Result<(), ConfigError> {
        let positive = |key: &str, v: i64| {
            if v < 1 {
                Err(invalid(key, format!("must be at least 1, got {v}")))
            } else {
                Ok(())
            }
        };
        positive("data.batch-size", self.batch_size)?;
        match self.kind {
            DataKind::SortDigits => {
                only_for(&self.path, "data.path", "\"text-file\"", invalid)?;
                only_for(
                    &self.seq_len,
                    "data.seq-len",
                    "\"text-file\" or \"random-tokens\"",
                    invalid,
                )?;
                only_for(
                    &self.vocab_size,
                    "data.vocab-size",
                    "\"random-tokens\"",
                    invalid,
                )?;
                positive("data.digits", self.digits())?;
            }
            DataKind::TextFile => {
                only_for(&self.digits, "data.digits", "\"sort-digits\"", invalid)?;
                only_for(
                    &self.vocab_size,
                    "data.vocab-size",
                    "\"random-tokens\"",
                    invalid,
                )?;
                if self.path.is_none() {
                    return Err(invalid(
                        "data.path",
                        "is required for kind = \"text-file\"".into(),
                    ));
                }
                positive("data.seq-len", self.seq_len())?;
            }
            DataKind::RandomTokens => {
                only_for(&self.digits, "data.digits", "\"sort-digits\"", invalid)?;
                only_for(&self.path, "data.path", "\"text-file\"", invalid)?;
                positive("data.seq-len", self.seq_len())?;
                if self.vocab_size() < 2 {
                    return Err(invalid("data.vocab-size", "must be at least 2".into()));
                }
            }
        }
        Ok(())
    }
}
