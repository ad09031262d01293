//! Held-out evaluation: exact-match accuracy of greedy generation for tasks
//! with answers, mean validation loss for text.

use crate::data::{GenerationSet, TokenDataset};
use crate::models::Model;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

/// The result of an evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Evaluation {
    /// Fraction of held-out prompts whose greedy continuation is exactly right.
    ExactMatch {
        /// Accuracy in `[0, 1]`.
        accuracy: f64,
        /// Number of prompts.
        samples: i64,
    },
    /// Mean next-token cross-entropy on held-out text.
    ValidationLoss {
        /// Mean loss (nats per token).
        loss: f64,
        /// Number of scored tokens.
        tokens: i64,
    },
}

impl Evaluation {
    /// The number a schedule observes: accuracy for exact match (use
    /// `mode = "max"` with reduce-on-plateau), else the validation loss.
    pub fn metric(&self) -> f64 {
        match *self {
            Self::ExactMatch { accuracy, .. } => accuracy,
            Self::ValidationLoss { loss, .. } => loss,
        }
    }
}

impl std::fmt::Display for Evaluation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ExactMatch { accuracy, samples } => {
                write!(
                    f,
                    "eval exact-match accuracy: {accuracy:.4} ({samples} held-out samples)"
                )
            }
            Self::ValidationLoss { loss, tokens } => write!(
                f,
                "eval validation loss: {loss:.4} ({tokens} held-out tokens)"
            ),
        }
    }
}

/// Seed offset that keeps eval examples on a different stream from training.
const EVAL_STREAM: u64 = 0x5eed_e7a1;

/// Evaluates `model` on the dataset's held-out data, if it has any.
pub(crate) fn evaluate(
    model: &dyn Model,
    data: &dyn TokenDataset,
    seed: u64,
    samples: i64,
    batch_size: i64,
    device: Device,
) -> Option<Evaluation> {
    tch::no_grad(|| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ EVAL_STREAM);
        if let Some(set) = data.generation_set(samples, &mut rng) {
            return Some(exact_match(model, &set, batch_size, device));
        }
        let batches = data.validation_batches(batch_size);
        if batches.is_empty() {
            return None;
        }
        let (mut total, mut tokens) = (Tensor::zeros([], (Kind::Double, device)), 0i64);
        for batch in &batches {
            let targets = batch.targets.to_device(device);
            let logits = model.forward_t(&batch.inputs.to_device(device), false);
            let n = targets.numel() as i64;
            total += super::lm_loss(&logits, &targets).to_kind(Kind::Double) * n as f64;
            tokens += n;
        }
        Some(Evaluation::ValidationLoss {
            loss: f64::try_from(total).unwrap_or(f64::NAN) / tokens as f64,
            tokens,
        })
    })
}

fn exact_match(
    model: &dyn Model,
    set: &GenerationSet,
    batch_size: i64,
    device: Device,
) -> Evaluation {
    let n = set.prompts.size()[0];
    let answer_len = set.answers.size()[1];
    let mut correct = Tensor::zeros([], (Kind::Int64, device));
    for start in (0..n).step_by(batch_size as usize) {
        let len = batch_size.min(n - start);
        let mut seq = set.prompts.narrow(0, start, len).to_device(device);
        for _ in 0..answer_len {
            let logits = model.forward_t(&seq, false);
            let next = logits.select(1, -1).argmax(-1, true);
            seq = Tensor::cat(&[seq, next], 1);
        }
        let generated = seq.narrow(1, seq.size()[1] - answer_len, answer_len);
        let answers = set.answers.narrow(0, start, len).to_device(device);
        correct += generated
            .eq_tensor(&answers)
            .all_dim(1, false)
            .sum(Kind::Int64);
    }
    let correct = i64::try_from(correct).unwrap_or(0);
    Evaluation::ExactMatch {
        accuracy: correct as f64 / n as f64,
        samples: n,
    }
}
