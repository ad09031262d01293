//! What every token dataset provides.

use rand_chacha::ChaCha8Rng;
use tch::Tensor;

/// Target value that the loss ignores (PyTorch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

/// One batch of training examples, on the CPU.
#[derive(Debug)]
pub struct Batch {
    /// `[batch, time]` int64 tokens.
    pub inputs: Tensor,
    /// `[batch, time]` int64 next tokens, [`IGNORE_INDEX`] where no loss is taken.
    pub targets: Tensor,
}

/// Prompts with their exact expected continuations, for generation evals.
#[derive(Debug)]
pub struct GenerationSet {
    /// `[n, prompt_len]` int64 prompts.
    pub prompts: Tensor,
    /// `[n, answer_len]` int64 answers the model should produce greedily.
    pub answers: Tensor,
}

/// A source of language-model training data.
pub trait TokenDataset {
    /// Number of distinct tokens.
    fn vocab_size(&self) -> i64;
    /// Length of each input sequence.
    fn seq_len(&self) -> i64;
    /// Draws a batch of `batch_size` examples from `rng`.
    fn sample_batch(&self, batch_size: i64, rng: &mut ChaCha8Rng) -> Batch;
    /// Held-out prompts and answers for an exact-match eval, if the task has one.
    fn generation_set(&self, _n: i64, _rng: &mut ChaCha8Rng) -> Option<GenerationSet> {
        None
    }
    /// Held-out batches for a validation loss, if the dataset keeps some.
    fn validation_batches(&self, _batch_size: i64) -> Vec<Batch> {
        Vec::new()
    }
    /// The training examples as numbered windows, for datasets that can
    /// be read in order (`sampling = "sequential"`).
    fn windows(&self) -> Option<&dyn Windows> {
        None
    }
}

/// Training examples numbered `0..count`, read by index.
pub trait Windows {
    /// Number of windows.
    fn count(&self) -> usize;
    /// The batch of windows `indices`, in that order.
    fn batch(&self, indices: &[usize]) -> Batch;
}
