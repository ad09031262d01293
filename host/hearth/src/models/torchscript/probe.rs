//! Probing a TorchScript model's forward pass once before training: an
//! error or an output hearth cannot train names the file and what the
//! model did.

use super::model::{last_line, pack_labels, ModelOutput, TorchScriptError, TorchScriptModel};
use std::path::Path;
use tch::{Device, Tensor};

impl TorchScriptModel {
    /// Runs `forward` once (evaluation mode, no gradients) on a `batch` ×
    /// `seq_len` batch of tokens below `vocab`, as the data gives them: an
    /// error, or an output that is not `[batch, seq_len, ≥ vocab]` logits,
    /// names the file and what the model did, before training starts. A
    /// model loaded lazily is probed once prepared ([`probe_forward`]).
    pub fn probe(&self, batch: i64, seq_len: i64, vocab: i64) -> Result<(), TorchScriptError> {
        let device = self.params[0].1.device();
        probe_forward(
            &self.path,
            self.output,
            device,
            [batch, seq_len, vocab],
            |x| tch::no_grad(|| self.try_forward(x, false)).map_err(|e| last_line(&e)),
        )
    }
}

/// [`TorchScriptModel::probe`] of the model at `path` whose forward pass
/// (evaluation mode, no gradients; the prepared model's, for one loaded
/// lazily) is `forward`: `shape` is the batch, the sequence length and the
/// data's vocabulary.
pub fn probe_forward(
    path: &Path,
    output: ModelOutput,
    device: Device,
    shape: [i64; 3],
    forward: impl FnOnce(&Tensor) -> Result<Tensor, String>,
) -> Result<(), TorchScriptError> {
    let [batch, seq_len, vocab] = shape;
    let err = |message: String| TorchScriptError {
        path: path.into(),
        message,
    };
    let tokens = Tensor::arange(batch * seq_len, (tch::Kind::Int64, device))
        .remainder(vocab)
        .view([batch, seq_len]);
    let shape = [batch, seq_len];
    let (input, needs) = match output {
        ModelOutput::Logits => (tokens, "forward must take [batch, time] token ids"),
        ModelOutput::Loss => (
            pack_labels(&tokens, &tokens),
            "with output = \"loss\", forward must take (input_ids, labels), each [batch, time]",
        ),
    };
    let out = forward(&input).map_err(|e| {
        err(format!(
            "its forward pass fails on a {shape:?} batch of int64 tokens below {vocab} (what the \
             data gives): {e}; {needs}"
        ))
    })?;
    let size = out.size();
    if output == ModelOutput::Loss {
        if !size.is_empty() || !out.is_floating_point() {
            return Err(err(format!(
                "its forward pass returns {:?} {size:?} for a {shape:?} batch; with output = \"loss\" hearth needs the loss, a floating-point scalar (or a tuple that starts with it)",
                out.kind()
            )));
        }
        return Ok(());
    }
    let fits = size.len() == 3 && size[..2] == shape && size[2] >= vocab;
    if !fits || !out.is_floating_point() {
        return Err(err(format!(
            "its forward pass returns {:?} {size:?} for a {shape:?} batch of tokens; hearth needs \
             [batch, time, vocab] floating-point logits with vocab at least {vocab} (the data's), \
             or set model.output = \"loss\" for a model that returns its loss",
            out.kind()
        )));
    }
    Ok(())
}
