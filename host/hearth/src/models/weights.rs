//! How a built-in model's weights start: initialised as PyTorch does, or
//! unmaterialised — allocated and never written, so the memory behind them
//! is not taken until something writes it (FSDP's
//! `cpu-ram-efficient-loading`: the processes that receive rank 0's
//! weights never build their own).

use tch::nn::{self, Path};
use tch::{Kind, Tensor};

/// How a model's weights start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weights {
    /// PyTorch's default initialisation.
    Initialised,
    /// Allocated, never written: their values are whatever the memory
    /// holds until they are overwritten (by rank 0's, through
    /// `sync-module-states`).
    Unmaterialised,
}

impl Weights {
    /// A `Linear(i, o)` under `p` (`weight` [o, i] and `bias` [o]).
    pub(super) fn linear(self, p: Path, i: i64, o: i64) -> nn::Linear {
        match self {
            Self::Initialised => nn::linear(p, i, o, Default::default()),
            Self::Unmaterialised => nn::Linear {
                ws: empty(&p, "weight", &[o, i]),
                bs: Some(empty(&p, "bias", &[o])),
            },
        }
    }

    /// An `Embedding(n, d)`'s weight under `p`.
    pub(super) fn embedding(self, p: Path, n: i64, d: i64) -> Tensor {
        match self {
            Self::Initialised => nn::embedding(p, n, d, Default::default()).ws,
            Self::Unmaterialised => empty(&p, "weight", &[n, d]),
        }
    }
}

/// A trainable variable `name` under `p`, allocated and never written.
fn empty(p: &Path, name: &str, shape: &[i64]) -> Tensor {
    p.add(name, Tensor::empty(shape, (Kind::Float, p.device())), true)
}

/// An embedding lookup (`nn::Embedding`'s forward with its defaults).
pub(super) fn embed(weight: &Tensor, tokens: &Tensor) -> Tensor {
    Tensor::embedding(weight, tokens, -1, false, false)
}
