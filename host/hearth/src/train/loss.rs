//! The language-modelling loss, taken by hearth from logits or by a model
//! that computes its own.

use crate::data::IGNORE_INDEX;
use crate::models::Model;
use crate::models::{pack_labels, ModelOutput};
use tch::{Kind, Reduction, Tensor};

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

/// transformers' causal-LM labels for `targets` (the next tokens of the
/// inputs): the labels line up with the inputs and the model shifts them,
/// so label t + 1 is target t; the first label is never scored, and the
/// last target has no input after it to go with.
pub fn causal_labels(targets: &Tensor) -> Tensor {
    let (b, t) = (targets.size()[0], targets.size()[1]);
    let first = Tensor::full([b, 1], IGNORE_INDEX, (Kind::Int64, targets.device()));
    Tensor::cat(&[first, targets.narrow(1, 0, t - 1)], 1)
}

/// The mean loss of one batch and the number of targets it averages
/// (a scalar tensor, so nothing waits for the device): the model's logits
/// scored by [`lm_loss`], or the loss a model with `output = "loss"`
/// returns for the inputs and [`causal_labels`].
pub fn batch_loss(
    model: &dyn Model,
    output: ModelOutput,
    inputs: &Tensor,
    targets: &Tensor,
    train: bool,
) -> (Tensor, Tensor) {
    match output {
        ModelOutput::Logits => {
            let loss = lm_loss(&model.forward_t(inputs, train), targets);
            (loss, targets.ne(IGNORE_INDEX).sum(Kind::Int64))
        }
        ModelOutput::Loss => {
            let labels = causal_labels(targets);
            let loss = model.forward_t(&pack_labels(inputs, &labels), train);
            let scored = labels.narrow(1, 1, labels.size()[1] - 1);
            (loss, scored.ne(IGNORE_INDEX).sum(Kind::Int64))
        }
    }
}
