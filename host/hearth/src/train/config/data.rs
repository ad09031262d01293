//! `[data]`: which dataset and the batch size.

use super::{ConfigError, Invalid};
use crate::data::TokenDtype;
use serde::Deserialize;
use std::path::PathBuf;

/// Which dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DataKind {
    /// Sort a string of digits (`data::SortDigits`), with an exact-match eval.
    SortDigits,
    /// Bytes of a text file (`data::TextFile`), with a validation loss.
    TextFile,
    /// Uniform random tokens, for benchmarks (`data::RandomTokens`).
    RandomTokens,
    /// Pre-tokenized ids: a nanoGPT `.bin` or a 1-D `.npy` (`data::Tokens`).
    Tokens,
    /// JSON Lines documents, tokenized into a token cache.
    Jsonl,
    /// Parquet documents, tokenized into a token cache.
    Parquet,
}

impl DataKind {
    fn name(self) -> &'static str {
        match self {
            Self::SortDigits => "\"sort-digits\"",
            Self::TextFile => "\"text-file\"",
            Self::RandomTokens => "\"random-tokens\"",
            Self::Tokens => "\"tokens\"",
            Self::Jsonl => "\"jsonl\"",
            Self::Parquet => "\"parquet\"",
        }
    }
}

/// How training windows are drawn from `tokens` data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Sampling {
    /// Each process draws window starts at random from its own stream
    /// (nanoGPT).
    #[default]
    Random,
    /// Numbered windows in epochs, each process taking its share of every
    /// step's `batch-size × processes` windows.
    Sequential,
}

/// How a `.bin`'s ids are stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum BinDtype {
    /// 2 bytes (nanoGPT's, for vocabularies up to 65 536).
    #[default]
    Uint16,
    /// 4 bytes.
    Uint32,
}

/// The `[data]` section.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DataSection {
    /// The dataset.
    pub kind: DataKind,
    /// Examples per step (default 16).
    #[serde(default = "default_batch_size")]
    pub batch_size: i64,
    /// sort-digits: digits per string (default 8).
    pub digits: Option<i64>,
    /// text-file, tokens: the file, relative to the config's folder.
    pub path: Option<PathBuf>,
    /// text-file, random-tokens, tokens: tokens per sequence (default 128).
    pub seq_len: Option<i64>,
    /// random-tokens (default 256), tokens (required): distinct tokens.
    pub vocab_size: Option<i64>,
    /// tokens: held-out ids in a file of their own.
    pub val_path: Option<PathBuf>,
    /// tokens: the fraction of `path` held out without `val-path` (default 0.1).
    pub val_fraction: Option<f64>,
    /// tokens: how a `.bin` stores ids (default uint16).
    pub dtype: Option<BinDtype>,
    /// tokens: random (default) or sequential windows.
    pub sampling: Option<Sampling>,
    /// tokens with sequential sampling: a new order of windows each epoch,
    /// from the run's seed (default false: file order).
    pub shuffle: Option<bool>,
    /// jsonl, parquet: the field or column holding the text (default "text").
    pub text_field: Option<String>,
    /// jsonl, parquet: the Hugging Face `tokenizer.json`.
    pub tokenizer: Option<PathBuf>,
    /// jsonl, parquet: the token put after each document (default: the
    /// `eos_token` of `tokenizer_config.json` beside the tokenizer, else a
    /// well-known one the vocabulary holds).
    pub eos_token: Option<String>,
}

fn default_batch_size() -> i64 {
    16
}

impl DataSection {
    /// sort-digits: digits per string.
    pub fn digits(&self) -> i64 {
        self.digits.unwrap_or(8)
    }
    /// Tokens per sequence for text-file, random-tokens and tokens.
    pub fn seq_len(&self) -> i64 {
        self.seq_len.unwrap_or(128)
    }
    /// random-tokens and tokens: vocabulary size.
    pub fn vocab_size(&self) -> i64 {
        self.vocab_size.unwrap_or(256)
    }
    /// tokens: the `.bin` dtype.
    pub fn dtype(&self) -> TokenDtype {
        match self.dtype.unwrap_or_default() {
            BinDtype::Uint16 => TokenDtype::U16,
            BinDtype::Uint32 => TokenDtype::U32,
        }
    }
    /// jsonl, parquet: the text field or column.
    pub fn text_field(&self) -> &str {
        self.text_field.as_deref().unwrap_or("text")
    }
    /// tokens, jsonl, parquet: the held-out fraction.
    pub fn val_fraction(&self) -> f64 {
        self.val_fraction.unwrap_or(0.1)
    }
    /// How training windows are drawn.
    pub fn sampling(&self) -> Sampling {
        self.sampling.unwrap_or_default()
    }

    pub(super) fn validate(&self, invalid: &Invalid) -> Result<(), ConfigError> {
        use DataKind::*;
        let positive = |key: &str, v: i64| {
            if v < 1 {
                Err(invalid(key, format!("must be at least 1, got {v}")))
            } else {
                Ok(())
            }
        };
        positive("data.batch-size", self.batch_size)?;
        // Each optional key and the kinds it applies to.
        const IDS: &[DataKind] = &[Tokens, Jsonl, Parquet];
        const DOCUMENTS: &[DataKind] = &[Jsonl, Parquet];
        let keys: [(&str, bool, &[DataKind]); 12] = [
            ("digits", self.digits.is_some(), &[SortDigits]),
            (
                "path",
                self.path.is_some(),
                &[TextFile, Tokens, Jsonl, Parquet],
            ),
            (
                "seq-len",
                self.seq_len.is_some(),
                &[TextFile, RandomTokens, Tokens, Jsonl, Parquet],
            ),
            (
                "vocab-size",
                self.vocab_size.is_some(),
                &[RandomTokens, Tokens, Jsonl, Parquet],
            ),
            ("val-path", self.val_path.is_some(), IDS),
            ("val-fraction", self.val_fraction.is_some(), IDS),
            ("dtype", self.dtype.is_some(), &[Tokens]),
            ("sampling", self.sampling.is_some(), IDS),
            ("shuffle", self.shuffle.is_some(), IDS),
            ("text-field", self.text_field.is_some(), DOCUMENTS),
            ("tokenizer", self.tokenizer.is_some(), DOCUMENTS),
            ("eos-token", self.eos_token.is_some(), DOCUMENTS),
        ];
        for (key, set, kinds) in keys {
            if set && !kinds.contains(&self.kind) {
                let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
                return Err(invalid(
                    &format!("data.{key}"),
                    format!(
                        "only applies to kind = {}; remove it or change `kind`",
                        names.join(" or ")
                    ),
                ));
            }
        }
        let required = |set: bool, key: &str| {
            if set {
                Ok(())
            } else {
                Err(invalid(
                    key,
                    format!("is required for kind = {}", self.kind.name()),
                ))
            }
        };
        match self.kind {
            SortDigits => positive("data.digits", self.digits())?,
            TextFile => {
                required(self.path.is_some(), "data.path")?;
                positive("data.seq-len", self.seq_len())?;
            }
            RandomTokens => {
                positive("data.seq-len", self.seq_len())?;
                if self.vocab_size() < 2 {
                    return Err(invalid("data.vocab-size", "must be at least 2".into()));
                }
            }
            Tokens | Jsonl | Parquet => {
                required(self.path.is_some(), "data.path")?;
                if self.kind == Tokens {
                    required(self.vocab_size.is_some(), "data.vocab-size")?;
                } else {
                    required(self.tokenizer.is_some(), "data.tokenizer")?;
                }
                positive("data.seq-len", self.seq_len())?;
                positive("data.vocab-size", self.vocab_size())?;
                if self.val_path.is_some() && self.val_fraction.is_some() {
                    return Err(invalid(
                        "data.val-fraction",
                        "does not apply with data.val-path (the held-out ids are that file's)"
                            .into(),
                    ));
                }
                let f = self.val_fraction();
                if !(f > 0.0 && f < 1.0) {
                    return Err(invalid(
                        "data.val-fraction",
                        format!("must lie between 0 and 1, got {f}"),
                    ));
                }
                if self.shuffle.is_some() && self.sampling() != Sampling::Sequential {
                    return Err(invalid(
                        "data.shuffle",
                        "only applies with sampling = \"sequential\"".into(),
                    ));
                }
            }
        }
        Ok(())
    }
}
