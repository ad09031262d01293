//! The algorithmic task of the default job: sort a string of digits.
//!
//! A sequence is `d1 … dn SEP s1 … sn` with `s` the digits sorted; the model
//! sees it shifted by one and is scored only on the sorted half. Tokens
//! `0..=9` are digits and `10` is the separator.

use super::{Batch, GenerationSet, TokenDataset, IGNORE_INDEX};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tch::Tensor;

/// The separator token between the digits and their sorted copy.
pub const SEP: i64 = 10;

/// Sorting `digits` decimal digits.
#[derive(Debug, Clone, Copy)]
pub struct SortDigits {
    digits: i64,
}

impl SortDigits {
    /// A task over strings of `digits` digits.
    pub fn new(digits: i64) -> Self {
        Self { digits }
    }

    fn example(&self, rng: &mut ChaCha8Rng) -> (Vec<i64>, Vec<i64>) {
        let input: Vec<i64> = (0..self.digits).map(|_| rng.random_range(0..10)).collect();
        let mut sorted = input.clone();
        sorted.sort_unstable();
        (input, sorted)
    }
}

impl TokenDataset for SortDigits {
    fn vocab_size(&self) -> i64 {
        11
    }
    fn seq_len(&self) -> i64 {
        2 * self.digits
    }
    fn sample_batch(&self, batch_size: i64, rng: &mut ChaCha8Rng) -> Batch {
        let n = self.digits as usize;
        let mut inputs = Vec::with_capacity(batch_size as usize * 2 * n);
        let mut targets = Vec::with_capacity(inputs.capacity());
        for _ in 0..batch_size {
            let (digits, sorted) = self.example(rng);
            let seq: Vec<i64> = digits.iter().copied().chain([SEP]).chain(sorted).collect();
            inputs.extend_from_slice(&seq[..2 * n]);
            // Position i predicts seq[i + 1]; only the sorted half is scored.
            targets.extend((0..2 * n).map(|i| if i + 1 > n { seq[i + 1] } else { IGNORE_INDEX }));
        }
        let shape = [batch_size, 2 * self.digits];
        Batch {
            inputs: Tensor::from_slice(&inputs).view(shape),
            targets: Tensor::from_slice(&targets).view(shape),
        }
    }
    fn generation_set(&self, n: i64, rng: &mut ChaCha8Rng) -> Option<GenerationSet> {
        let (mut prompts, mut answers) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let (digits, sorted) = self.example(rng);
            prompts.extend(digits.into_iter().chain([SEP]));
            answers.extend(sorted);
        }
        Some(GenerationSet {
            prompts: Tensor::from_slice(&prompts).view([n, self.digits + 1]),
            answers: Tensor::from_slice(&answers).view([n, self.digits]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn targets_are_the_sorted_digits_shifted_by_one() {
        let task = SortDigits::new(4);
        let batch = task.sample_batch(3, &mut ChaCha8Rng::seed_from_u64(1));
        assert_eq!(batch.inputs.size(), [3, 8]);
        let inputs: Vec<i64> = Vec::try_from(batch.inputs.get(0)).unwrap();
        let targets: Vec<i64> = Vec::try_from(batch.targets.get(0)).unwrap();
        let mut sorted = inputs[..4].to_vec();
        sorted.sort();
        assert_eq!(inputs[4], SEP);
        assert_eq!(&inputs[5..], &sorted[..3]);
        assert_eq!(&targets[..4], &[IGNORE_INDEX; 4]);
        assert_eq!(&targets[4..], &sorted[..]);
    }

    #[test]
    fn the_same_seed_gives_the_same_batches() {
        let task = SortDigits::new(6);
        let a = task.sample_batch(5, &mut ChaCha8Rng::seed_from_u64(7));
        let b = task.sample_batch(5, &mut ChaCha8Rng::seed_from_u64(7));
        assert!(a.inputs.equal(&b.inputs));
    }
}
