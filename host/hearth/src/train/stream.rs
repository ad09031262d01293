//! Where each process's training batches come from, checkpointed so a
//! resumed run goes on where it stopped: random windows from a seeded
//! ChaCha stream per process, or (`sampling = "sequential"`) numbered
//! windows in epochs, every step's `batch-size × processes` windows shared
//! out by rank.

use crate::data::{epoch_order, Batch, TokenDataset};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A process's source of training batches.
pub(super) struct DataStream {
    /// Process r draws random windows from stream r of the seed.
    rng: ChaCha8Rng,
    /// Sequential sampling: where all processes stand (the same on each).
    cursor: Option<Cursor>,
    rank: usize,
    world: usize,
}

/// The position of sequential sampling.
struct Cursor {
    /// Epochs finished.
    epoch: u64,
    /// Windows of this epoch's order the processes have taken together.
    next: u64,
    /// A new order each epoch (else file order).
    shuffle: bool,
    seed: u64,
    /// The order of `epoch`, once computed.
    order: Option<(u64, Vec<usize>)>,
}

/// Bytes of the random stream's state: seed, stream, word position.
const RNG_STATE: usize = 56;

impl DataStream {
    /// Process `rank` of `world`; `sequential` with its shuffle, or random.
    pub(super) fn new(seed: u64, rank: usize, world: usize, sequential: Option<bool>) -> Self {
        // Different batches on every process, the same ones as before for
        // a world of one.
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(rank as u64);
        let cursor = sequential.map(|shuffle| Cursor {
            epoch: 0,
            next: 0,
            shuffle,
            seed,
            order: None,
        });
        Self {
            rng,
            cursor,
            rank,
            world,
        }
    }

    /// The next `batch_size` examples of this process.
    pub(super) fn next_batch(&mut self, data: &dyn TokenDataset, batch_size: i64) -> Batch {
        let Some(cursor) = &mut self.cursor else {
            return data.sample_batch(batch_size, &mut self.rng);
        };
        let windows = data
            .windows()
            .expect("validated: sequential sampling reads a dataset with windows");
        let per_step = (batch_size as usize * self.world) as u64;
        let count = windows.count() as u64;
        // A tail shorter than a step is left for the next epoch's order.
        if cursor.next + per_step > count {
            cursor.epoch += 1;
            cursor.next = 0;
        }
        if cursor
            .order
            .as_ref()
            .is_none_or(|(e, _)| *e != cursor.epoch)
        {
            let order = epoch_order(count as usize, cursor.shuffle, cursor.seed, cursor.epoch);
            cursor.order = Some((cursor.epoch, order));
        }
        let (_, order) = cursor.order.as_ref().expect("computed above");
        let from = (cursor.next + (self.rank * batch_size as usize) as u64) as usize;
        cursor.next += per_step;
        windows.batch(&order[from..from + batch_size as usize])
    }

    /// Refuses sequential sampling of fewer windows than one step takes
    /// (`batch_size × processes`), naming `config`.
    pub(super) fn check(
        &self,
        data: &dyn TokenDataset,
        batch_size: i64,
        config: &std::path::Path,
    ) -> Result<(), super::TrainError> {
        let (Some(_), Some(windows)) = (&self.cursor, data.windows()) else {
            return Ok(());
        };
        let needed = batch_size as usize * self.world;
        if windows.count() < needed {
            return Err(super::TrainError::TooFewWindows {
                config: config.into(),
                windows: windows.count(),
                needed,
            });
        }
        Ok(())
    }
}

impl crate::accelerator::Checkpointable for DataStream {
    /// The random stream's seed, stream and position, then for sequential
    /// sampling the epoch and the windows taken.
    fn state_dict(&self) -> Vec<u8> {
        let mut bytes = self.rng.get_seed().to_vec();
        bytes.extend(self.rng.get_stream().to_le_bytes());
        bytes.extend(self.rng.get_word_pos().to_le_bytes());
        if let Some(c) = &self.cursor {
            bytes.extend(c.epoch.to_le_bytes());
            bytes.extend(c.next.to_le_bytes());
        }
        bytes
    }
    /// Every process draws its own random windows.
    fn per_process(&self) -> bool {
        true
    }
    fn load_state_dict(&mut self, state: &[u8]) -> Result<(), String> {
        self.restore(state, false)
    }
    /// A process added on resume draws random windows from its own stream
    /// of the same seed, from where process 0 stood (its batches differ
    /// from every other process's, and the run stays reproducible); the
    /// sequential position is every process's.
    fn load_state_dict_of_process_zero(&mut self, state: &[u8]) -> Result<(), String> {
        self.restore(state, true)
    }
}

impl DataStream {
    fn restore(&mut self, state: &[u8], own_stream: bool) -> Result<(), String> {
        let sequential = self.cursor.is_some();
        let want = RNG_STATE + if sequential { 16 } else { 0 };
        if state.len() != want {
            let saved = match state.len() {
                RNG_STATE => "random windows",
                n if n == RNG_STATE + 16 => "sequential windows",
                n => return Err(format!("the data stream state is {want} bytes, not {n}")),
            };
            let now = if sequential { "sequential" } else { "random" };
            return Err(format!(
                "the checkpoint's run sampled {saved}; this config samples {now} windows (data.sampling)"
            ));
        }
        let int = |at: usize| u64::from_le_bytes(state[at..at + 8].try_into().expect("8 bytes"));
        let seed: [u8; 32] = state[..32].try_into().expect("32 bytes");
        let mut rng = ChaCha8Rng::from_seed(seed);
        let stream = if own_stream {
            self.rng.get_stream()
        } else {
            int(32)
        };
        rng.set_stream(stream);
        rng.set_word_pos(u128::from_le_bytes(
            state[40..56].try_into().expect("16 bytes"),
        ));
        self.rng = rng;
        if let Some(c) = &mut self.cursor {
            (c.epoch, c.next) = (int(56), int(64));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accelerator::Checkpointable;
    use crate::data::{Batch, Windows};
    use rand::RngCore;
    use tch::Tensor;

    #[test]
    fn a_process_added_on_resume_draws_its_own_stream_from_process_zeros_position() {
        let mut zero = DataStream::new(5, 0, 1, None);
        for _ in 0..37 {
            zero.rng.next_u32();
        }
        let saved = zero.state_dict();
        let mut own = DataStream::new(5, 0, 4, None);
        own.load_state_dict(&saved).unwrap();
        assert_eq!(
            own.rng.next_u64(),
            zero.rng.clone().next_u64(),
            "its own state, exactly"
        );
        let mut added = DataStream::new(5, 3, 4, None);
        added.load_state_dict_of_process_zero(&saved).unwrap();
        let mut want = DataStream::new(5, 3, 4, None).rng;
        want.set_word_pos(zero.rng.get_word_pos());
        assert_eq!(
            added.rng.next_u64(),
            want.next_u64(),
            "stream 3 at process 0's position"
        );
        assert_ne!(added.rng.next_u64(), zero.rng.next_u64());
        assert!(added.load_state_dict_of_process_zero(&saved[..10]).is_err());
    }

    /// Windows that are their own numbers.
    struct Numbered(usize);

    impl Windows for Numbered {
        fn count(&self) -> usize {
            self.0
        }
        fn batch(&self, indices: &[usize]) -> Batch {
            let ids: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
            let t = Tensor::from_slice(&ids).view([-1, 1]);
            Batch {
                inputs: t.shallow_clone(),
                targets: t,
            }
        }
    }

    impl TokenDataset for Numbered {
        fn vocab_size(&self) -> i64 {
            self.0 as i64
        }
        fn seq_len(&self) -> i64 {
            1
        }
        fn sample_batch(&self, _: i64, _: &mut ChaCha8Rng) -> Batch {
            unreachable!("sequential")
        }
        fn windows(&self) -> Option<&dyn Windows> {
            Some(self)
        }
    }

    /// The windows `world` processes take over `steps` steps of `batch`
    /// each, from `state` when given; and the state after.
    fn take(world: usize, batch: i64, steps: usize, state: Option<&[u8]>) -> (Vec<i64>, Vec<u8>) {
        let data = Numbered(23);
        let mut streams: Vec<DataStream> = (0..world)
            .map(|r| DataStream::new(9, r, world, Some(true)))
            .collect();
        if let Some(state) = state {
            for s in &mut streams {
                s.load_state_dict_of_process_zero(state).unwrap();
            }
        }
        let mut seen = Vec::new();
        for _ in 0..steps {
            for s in &mut streams {
                let b = s.next_batch(&data, batch);
                seen.extend(Vec::<i64>::try_from(b.inputs.view([-1])).unwrap());
            }
        }
        (seen, streams[0].state_dict())
    }

    #[test]
    fn sequential_windows_are_each_seen_once_an_epoch_on_any_number_of_processes_and_across_a_resume(
    ) {
        // 23 windows, 2 processes × batch 3 = 6 a step: 3 steps take 18
        // distinct windows; the 5 left are the next epoch's.
        let (two, state) = take(2, 3, 2, None);
        let mut epoch: Vec<i64> = two.clone();
        // Resumed on 3 processes (batch 2: 6 a step again), one more step
        // finishes the epoch's 18 windows; the next starts a new order.
        let (three, _) = take(3, 2, 2, Some(&state));
        epoch.extend(&three[..6]);
        let mut sorted = epoch.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 18, "each window of the epoch once: {epoch:?}");
        let (unbroken, _) = take(2, 3, 4, None);
        assert_eq!(
            unbroken[..18].to_vec(),
            epoch,
            "the same 18 as an unbroken run, in its order"
        );
        assert_eq!(three[6..], unbroken[18..], "epoch 1 goes on the same");
        assert_ne!(three[6..], unbroken[..6], "a new epoch, a new order");
        let mut random = DataStream::new(9, 0, 1, None);
        let refused = random.load_state_dict(&state).unwrap_err();
        assert!(refused.contains("sampled sequential windows"), "{refused}");
    }
}
