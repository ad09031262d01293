//! The language-modelling loss.

use crate::data::IGNORE_INDEX;
use tch::{Reduction, Tensor};

/// Mean next-token cross-entropy of `[batch, time, vocab]` logits against
/// `[batch, time]` targets, ignoring [`IGNORE_INDEX`] targets (PyTorch's
/// `F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))`).
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = logits.size()[2];
    logits.reshape([-1, vocab]).cross_entropy_loss::<Tensor>(
        &targets.reshape([-1]),
        None,
        Reduction::Mean,
        IGNORE_INDEX,
        0.0,
    )
}
