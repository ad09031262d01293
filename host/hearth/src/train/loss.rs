//! The language-modelling loss, taken by hearth from logits or by a model
//! that computes its own.

use crate::data::IGNORE_INDEX;
use crate::models::{pack_labels, ModelOutput};
use tch::{Kind, Reduction, Tensor};

/// Mean next-token cross-entropy of `[batch, time, vocab]` logits against
/// `[batch, time]` targets, ignoring [`IGNORE_INDEX`] targets (PyTorch's
/// `F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))`).
///
/// float16 logits on a GPU (a model under `mixed-precision = "fp16"`) go
/// through `_log_softmax(half_to_float=true)`, which reads them as they are
/// and writes float32 log-probabilities in one kernel, and whose backward
/// writes the gradient in float16: the values of casting to float32 first
/// (what autocast does), without the two casting passes over a `[tokens,
/// vocab]` tensor (at GPT-2's vocabulary, 2.4 GB each way per 8 k tokens).
/// libtorch has that variant for float16 on CUDA only. bfloat16 logits on
/// a GPU go through hearth's own two kernels
/// ([`hearth_ops::cuda_loss::bf16_cross_entropy`]: one read of the logits
/// forward, one read and a bfloat16 write backward), where they can run;
/// half-precision logits elsewhere are cast to float32 first.
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = logits.size()[2];
    let flat = logits.reshape([-1, vocab]);
    let targets = targets.reshape([-1]);
    if flat.kind() == Kind::BFloat16 && flat.device().is_cuda() {
        if let Some(loss) = hearth_ops::cuda_loss::bf16_cross_entropy(&flat, &targets, IGNORE_INDEX)
        {
            return loss;
        }
    }
    if flat.kind() == Kind::Half && flat.device().is_cuda() {
        return flat.internal_log_softmax(1, true).g_nll_loss::<Tensor>(
            &targets,
            None,
            Reduction::Mean,
            IGNORE_INDEX,
        );
    }
    // Elsewhere half-precision logits are scored in float32, as autocast's
    // float32 list has it.
    let half = matches!(flat.kind(), Kind::Half | Kind::BFloat16);
    let flat = if half {
        flat.to_kind(Kind::Float)
    } else {
        flat
    };
    flat.cross_entropy_loss::<Tensor>(&targets, None, Reduction::Mean, IGNORE_INDEX, 0.0)
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
/// (a scalar tensor, so nothing waits for the device): the logits
/// `forward` gives scored by [`lm_loss`], or the loss a model with
/// `output = "loss"` returns for the inputs and [`causal_labels`].
/// `forward` can fail (a prepared model's
/// [`try_forward_t`](crate::accelerator::PreparedModel::try_forward_t)).
pub fn batch_loss<E>(
    forward: impl Fn(&Tensor) -> Result<Tensor, E>,
    output: ModelOutput,
    inputs: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, Tensor), E> {
    Ok(match output {
        ModelOutput::Logits => {
            let loss = lm_loss(&forward(inputs)?, targets);
            (loss, targets.ne(IGNORE_INDEX).sum(Kind::Int64))
        }
        ModelOutput::Loss => {
            let labels = causal_labels(targets);
            let loss = forward(&pack_labels(inputs, &labels))?;
            let scored = labels.narrow(1, 1, labels.size()[1] - 1);
            (loss, scored.ne(IGNORE_INDEX).sum(Kind::Int64))
        }
    })
}
