//! Held-out evaluation: exact-match accuracy of greedy generation for tasks
//! with answers, mean validation loss for text.

use super::loss::batch_loss;
use crate::data::{GenerationSet, TokenDataset};
#[cfg(test)]
use crate::models::Model;
use crate::models::ModelOutput;
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

/// What an evaluation scores: the prompts of an exact-match set drawn from
/// `seed` (`samples` of them), in forward passes of `batch_size`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    /// The run's seed.
    pub seed: u64,
    /// Prompts of an exact-match set.
    pub samples: i64,
    /// Examples per forward pass.
    pub batch_size: i64,
}

/// The part of the held-out data one process scores: prompts
/// `[index·n/count, (index+1)·n/count)` of an exact-match set, every
/// `count`-th validation batch from `index`. The shards of all processes
/// cover the data once, so their summed [`Scores`] are the whole evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shard {
    /// This process's shard.
    pub index: usize,
    /// How many shards (processes).
    pub count: usize,
}

/// What one shard scored: sums that add up across processes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Scores {
    /// True: exact match (`total` prompts right of `count`); false:
    /// validation loss (`total` summed token losses over `count` tokens).
    pub exact_match: bool,
    /// Prompts answered right, or the summed loss of the scored tokens.
    pub total: f64,
    /// Prompts, or scored tokens.
    pub count: i64,
}

impl Scores {
    /// `[total, count]` as float64, to be summed across processes.
    pub fn to_tensor(self) -> Tensor {
        Tensor::from_slice(&[self.total, self.count as f64])
    }

    /// These scores with `total` and `count` replaced by the sums in `t`.
    pub fn with_sums(self, t: &Tensor) -> Self {
        let sums = Vec::<f64>::try_from(t).expect("[total, count] as float64");
        Self {
            total: sums[0],
            count: sums[1].round() as i64,
            ..self
        }
    }

    /// The evaluation these sums give.
    pub fn evaluation(self) -> Evaluation {
        let mean = self.total / self.count as f64;
        if self.exact_match {
            Evaluation::ExactMatch {
                accuracy: mean,
                samples: self.count,
            }
        } else {
            Evaluation::ValidationLoss {
                loss: mean,
                tokens: self.count,
            }
        }
    }
}

/// Scores `model` on `shard` of the dataset's held-out data, if it has any
/// (every shard of a dataset has, even an empty one).
#[cfg(test)]
pub(crate) fn score(
    model: &dyn Model,
    output: ModelOutput,
    data: &dyn TokenDataset,
    plan: Plan,
    device: Device,
    shard: Shard,
) -> Option<Scores> {
    let forward = |x: &Tensor| Ok::<_, std::convert::Infallible>(model.forward_t(x, false));
    match try_score(&forward, output, data, plan, device, shard) {
        Ok(scores) => scores,
        Err(never) => match never {},
    }
}

/// [`score`] with the model's evaluation forward pass (`train` false)
/// given as `forward`, which can fail: a prepared model's collectives
/// under FULL_SHARD.
pub(crate) fn try_score<E>(
    forward: &dyn Fn(&Tensor) -> Result<Tensor, E>,
    output: ModelOutput,
    data: &dyn TokenDataset,
    plan: Plan,
    device: Device,
    shard: Shard,
) -> Result<Option<Scores>, E> {
    let Plan {
        seed,
        samples,
        batch_size,
    } = plan;
    tch::no_grad(|| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ EVAL_STREAM);
        if let Some(set) = data.generation_set(samples, &mut rng) {
            let n = set.prompts.size()[0];
            let (index, count) = (shard.index as i64, shard.count as i64);
            let (start, end) = (index * n / count, (index + 1) * n / count);
            // The largest shard's batches: every rank runs as many.
            let rounds = ((n + count - 1) / count + batch_size - 1) / batch_size;
            let correct = exact_match(forward, &set, start, end, batch_size, rounds, device)?;
            return Ok(Some(Scores {
                exact_match: true,
                total: correct as f64,
                count: end - start,
            }));
        }
        let batches = data.validation_batches(batch_size);
        if batches.is_empty() {
            return Ok(None);
        }
        let mut total = Tensor::zeros([], (Kind::Double, device));
        let mut tokens = Tensor::zeros([], (Kind::Int64, device));
        // Batch k goes to rank k % count, and every rank runs as many
        // forward passes as the rank with the most: a rank past the end
        // runs one row of the first batch again and counts nothing
        // (Accelerate's even_batches, whose repeats gather_for_metrics
        // drops).
        for round in 0..batches.len().div_ceil(shard.count) {
            let Some(batch) = batches.get(shard.index + round * shard.count) else {
                let row = |t: &Tensor| t.narrow(0, 0, 1).to_device(device);
                let first = &batches[0];
                let _ = batch_loss(forward, output, &row(&first.inputs), &row(&first.targets))?;
                continue;
            };
            let targets = batch.targets.to_device(device);
            let inputs = batch.inputs.to_device(device);
            let (loss, n) = batch_loss(forward, output, &inputs, &targets)?;
            // A batch with nothing to score adds nothing (its mean is NaN);
            // a NaN loss of a batch that scores something shows.
            let weighted = loss.to_kind(Kind::Double) * &n;
            total += weighted.where_self(&n.gt(0), &Tensor::zeros_like(&weighted));
            tokens += n;
        }
        Ok(Some(Scores {
            exact_match: false,
            total: f64::try_from(total).unwrap_or(f64::NAN),
            count: i64::try_from(tokens).unwrap_or(0),
        }))
    })
}

/// How many of prompts `[start, end)` the model's greedy continuation
/// answers exactly, in `rounds` batches of up to `batch_size`: rounds past
/// this range's own continue one prompt and count nothing, so that every
/// rank runs the same forward passes (under FULL_SHARD each one is a
/// collective).
fn exact_match<E>(
    forward: &dyn Fn(&Tensor) -> Result<Tensor, E>,
    set: &GenerationSet,
    start: i64,
    end: i64,
    batch_size: i64,
    rounds: i64,
    device: Device,
) -> Result<i64, E> {
    let answer_len = set.answers.size()[1];
    let mut correct = Tensor::zeros([], (Kind::Int64, device));
    for round in 0..rounds {
        // A round past this range continues one prompt and counts nothing.
        let from = start + round * batch_size;
        let (from, len, counts) = match from < end {
            true => (from, batch_size.min(end - from), true),
            false => (0, 1, false),
        };
        let mut seq = set.prompts.narrow(0, from, len).to_device(device);
        for _ in 0..answer_len {
            let logits = forward(&seq)?;
            let next = logits.select(1, -1).argmax(-1, true);
            seq = Tensor::cat(&[seq, next], 1);
        }
        if !counts {
            continue;
        }
        let generated = seq.narrow(1, seq.size()[1] - answer_len, answer_len);
        let answers = set.answers.narrow(0, from, len).to_device(device);
        correct += generated
            .eq_tensor(&answers)
            .all_dim(1, false)
            .sum(Kind::Int64);
    }
    Ok(i64::try_from(correct).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{SortDigits, TextFile};
    use crate::models::{Gpt, GptConfig};

    /// An evaluation of seed 3.
    fn plan(samples: i64, batch_size: i64) -> Plan {
        Plan {
            seed: 3,
            samples,
            batch_size,
        }
    }

    /// Sums of the shards of a world of `count`.
    fn summed(count: usize, scores: impl Fn(Shard) -> Scores) -> (f64, i64) {
        (0..count)
            .map(|index| scores(Shard { index, count }))
            .fold((0.0, 0), |(t, n), s| (t + s.total, n + s.count))
    }

    fn gpt(data: &dyn TokenDataset) -> Gpt {
        tch::manual_seed(0);
        let config = GptConfig {
            vocab_size: data.vocab_size(),
            block_size: data.seq_len(),
            d_model: 16,
            layers: 1,
            heads: 2,
        };
        Gpt::new(config, Device::Cpu)
    }

    /// A 3000-byte text file of scrambled bytes in windows of 8, and the
    /// folder that holds it.
    fn bytes_file() -> (tempfile::TempDir, TextFile) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("text.txt");
        let bytes: Vec<u8> = (0..3000u32).map(|i| (i * 7919 % 251) as u8).collect();
        std::fs::write(&path, bytes).unwrap();
        let text = TextFile::open(&path, 8).unwrap();
        (dir, text)
    }

    /// `model` after a few plain gradient steps on `data`.
    fn train(model: Gpt, data: &dyn TokenDataset, steps: usize) -> Gpt {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for _ in 0..steps {
            let batch = data.sample_batch(64, &mut rng);
            let logits = model.forward_t(&batch.inputs, true);
            crate::train::lm_loss(&logits, &batch.targets).backward();
            tch::no_grad(|| {
                for (_, mut p) in model.named_parameters() {
                    p -= p.grad() * 0.5;
                    p.zero_grad();
                }
            });
        }
        model
    }

    #[test]
    fn the_shards_of_any_world_add_up_to_the_whole_evaluation() {
        let _rng = crate::global_rng();
        // Two digits to sort, briefly trained: some answers right, not all.
        let digits = SortDigits::new(2);
        let model = train(gpt(&digits), &digits, 40);
        let exact = |shard| {
            score(
                &model,
                ModelOutput::Logits,
                &digits,
                plan(200, 7),
                Device::Cpu,
                shard,
            )
            .unwrap()
        };
        let whole = exact(Shard { index: 0, count: 1 });
        assert!(whole.exact_match && whole.count == 200);
        assert!(whole.total > 0.0 && whole.total < 200.0, "{whole:?}");
        for count in [2, 3, 4] {
            assert_eq!(summed(count, exact), (whole.total, 200), "{count} shards");
        }
        // More processes than prompts: the empty shards still add their zeros.
        let few = |shard| {
            score(
                &model,
                ModelOutput::Logits,
                &digits,
                plan(3, 7),
                Device::Cpu,
                shard,
            )
            .unwrap()
        };
        let three = few(Shard { index: 0, count: 1 });
        assert_eq!(summed(5, few), (three.total, 3));
        assert_eq!(few(Shard { index: 0, count: 5 }).count, 0);

        let (_dir, text) = bytes_file();
        let model = gpt(&text);
        let loss = |shard| {
            score(
                &model,
                ModelOutput::Logits,
                &text,
                plan(0, 4),
                Device::Cpu,
                shard,
            )
            .unwrap()
        };
        let whole = loss(Shard { index: 0, count: 1 });
        assert!(!whole.exact_match && whole.count > 0);
        for count in [2, 3] {
            let (total, tokens) = summed(count, loss);
            assert_eq!(tokens, whole.count, "{count} shards");
            assert!(
                (total - whole.total).abs() < 1e-9 * whole.total,
                "{count} shards"
            );
        }
    }

    /// A model that counts its forward passes.
    struct Counting<'a>(&'a Gpt, std::cell::Cell<usize>);

    impl Model for Counting<'_> {
        fn module_tree(&self) -> &crate::models::ModuleTree {
            self.0.module_tree()
        }
        fn units(&self) -> Vec<&dyn crate::models::Unit> {
            self.0.units()
        }
        fn forward_t(&self, tokens: &Tensor, train: bool) -> Tensor {
            self.1.set(self.1.get() + 1);
            self.0.forward_t(tokens, train)
        }
        fn named_parameters(&self) -> Vec<(String, Tensor)> {
            self.0.named_parameters()
        }
    }

    /// Every shard of a world runs as many forward passes, whether the
    /// batches or prompts divide among them or not: under FULL_SHARD each
    /// pass gathers the model's units, a collective, and a rank with one
    /// pass fewer left the others waiting until the collective timeout.
    #[test]
    fn every_shard_runs_as_many_forward_passes() {
        let _rng = crate::global_rng();
        let passes = |model: &Gpt, run: &dyn Fn(&dyn Model, Shard), count: usize| -> Vec<usize> {
            (0..count)
                .map(|index| {
                    let counting = Counting(model, std::cell::Cell::new(0));
                    run(&counting, Shard { index, count });
                    counting.1.get()
                })
                .collect()
        };
        let (_dir, text) = bytes_file();
        let model = gpt(&text);
        let batches = text.validation_batches(5).len();
        let uneven: Vec<usize> = (2..=7).filter(|count| batches % count != 0).collect();
        assert!(
            uneven.len() >= 3,
            "{batches} batches divide too evenly for the case"
        );
        for count in uneven {
            let run = |m: &dyn Model, shard| {
                score(
                    m,
                    ModelOutput::Logits,
                    &text,
                    plan(0, 5),
                    Device::Cpu,
                    shard,
                );
            };
            let seen = passes(&model, &run, count);
            assert!(
                seen.iter().all(|&n| n == seen[0]),
                "{count} shards of {batches} batches: {seen:?}"
            );
        }
        let digits = SortDigits::new(2);
        let model = gpt(&digits);
        for (samples, batch, count) in [(3, 7, 4), (201, 7, 2), (1001, 500, 2)] {
            let run = |m: &dyn Model, shard| {
                score(
                    m,
                    ModelOutput::Logits,
                    &digits,
                    plan(samples, batch),
                    Device::Cpu,
                    shard,
                );
            };
            let seen = passes(&model, &run, count);
            assert!(
                seen.iter().all(|&n| n == seen[0]) && seen[0] > 0,
                "{samples} prompts in batches of {batch} on {count} shards: {seen:?}"
            );
        }
    }
}
