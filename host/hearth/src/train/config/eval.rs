//! `[eval]`: the held-out evaluation at the end of a run (and every
//! `every` steps): exact-match accuracy for tasks that have answers,
//! validation loss for text.

use super::{ConfigError, Invalid};
use serde::Deserialize;

/// The `[eval]` section.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct EvalSection {
    /// Held-out examples for exact-match evals (default 1000).
    #[serde(default = "default_samples")]
    pub samples: i64,
    /// Also evaluate every this many steps (default: only at the end).
    pub every: Option<u64>,
    /// Examples per forward pass during eval (default 500).
    #[serde(default = "default_batch_size")]
    pub batch_size: i64,
}

impl Default for EvalSection {
    fn default() -> Self {
        Self {
            samples: default_samples(),
            every: None,
            batch_size: default_batch_size(),
        }
    }
}

fn default_samples() -> i64 {
    1000
}
fn default_batch_size() -> i64 {
    500
}

impl EvalSection {
    pub(super) fn validate(&self, invalid: &Invalid) -> Result<(), ConfigError> {
        if self.samples < 1 {
            return Err(invalid("eval.samples", "must be at least 1".into()));
        }
        if self.batch_size < 1 {
            return Err(invalid("eval.batch-size", "must be at least 1".into()));
        }
        if self.every == Some(0) {
            return Err(invalid("eval.every", "must be at least 1".into()));
        }
        Ok(())
    }
}
