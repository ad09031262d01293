//! Uniformly random tokens: a dataset for measuring throughput, as the peer
//! benchmark's `torch.randint` data.

use super::{Batch, TokenDataset};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tch::Tensor;

/// Random sequences of `seq_len + 1` tokens below `vocab_size`.
#[derive(Debug, Clone, Copy)]
pub struct RandomTokens {
    vocab_size: i64,
    seq_len: i64,
}

impl RandomTokens {
    /// A dataset of random tokens.
    pub fn new(vocab_size: i64, seq_len: i64) -> Self {
        Self {
            vocab_size,
            seq_len,
        }
    }
}

impl TokenDataset for RandomTokens {
    fn vocab_size(&self) -> i64 {
        self.vocab_size
    }
    fn seq_len(&self) -> i64 {
        self.seq_len
    }
    fn sample_batch(&self, batch_size: i64, rng: &mut ChaCha8Rng) -> Batch {
        let t = self.seq_len + 1;
        let data: Vec<i64> = (0..batch_size * t)
            .map(|_| rng.random_range(0..self.vocab_size))
            .collect();
        let data = Tensor::from_slice(&data).view([batch_size, t]);
        Batch {
            inputs: data.narrow(1, 0, self.seq_len),
            targets: data.narrow(1, 1, self.seq_len),
        }
    }
}
