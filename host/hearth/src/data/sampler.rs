//! Which dataset indices make up each batch of an epoch, and which of those
//! batches belong to this process — Accelerate's `SeedableRandomSampler`
//! and `BatchSamplerShard`, index for index.

use hearth_ops::randperm;

/// This process's place in the world and how batches are shared out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// Index of this process.
    pub process_index: usize,
    /// Number of processes.
    pub num_processes: usize,
    /// Each batch is split between the processes (batch size must divide
    /// by the world size) instead of each process taking whole batches.
    pub split_batches: bool,
    /// Every process gets the same number of batches: the last ones are
    /// completed with samples from the start of the epoch.
    pub even_batches: bool,
}

impl Default for Shard {
    fn default() -> Self {
        Self {
            process_index: 0,
            num_processes: 1,
            split_batches: false,
            even_batches: true,
        }
    }
}

/// The sample order of one epoch: `torch.randperm(n)` from a generator
/// seeded with `seed + epoch` (the order Accelerate's seedable sampler
/// gives, so a run can be compared with one made by Accelerate), or `0..n`
/// without shuffling. The generator is private: the training's random
/// streams (CPU and CUDA) are not touched.
pub fn epoch_order(n: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    if !shuffle {
        return (0..n).collect();
    }
    let perm = randperm(n as i64, seed.wrapping_add(epoch)).expect("randperm of a length");
    Vec::<i64>::try_from(perm)
        .expect("randperm gives int64")
        .into_iter()
        .map(|i| i as usize)
        .collect()
}

/// Cuts an order into batches of `batch_size` (the last one shorter unless
/// `drop_last` drops it), like `torch.utils.data.BatchSampler`.
pub fn batches(order: &[usize], batch_size: usize, drop_last: bool) -> Vec<Vec<usize>> {
    order
        .chunks(batch_size)
        .filter(|b| !drop_last || b.len() == batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}

/// The batches of `all` (made with `batch_size` and `drop_last`) that this
/// process sees, as Accelerate's `BatchSamplerShard` gives them. A world of
/// one sees every batch unchanged (Accelerate does not shard it either).
pub fn shard_batches(
    all: &[Vec<usize>],
    batch_size: usize,
    drop_last: bool,
    shard: Shard,
) -> Vec<Vec<usize>> {
    if shard.num_processes <= 1 {
        return all.to_vec();
    }
    if shard.split_batches {
        split(all, batch_size, drop_last, shard)
    } else {
        whole(all, batch_size, drop_last, shard)
    }
}

fn split(all: &[Vec<usize>], batch_size: usize, drop_last: bool, s: Shard) -> Vec<Vec<usize>> {
    let per = batch_size / s.num_processes;
    let part = |b: &[usize]| -> Vec<usize> {
        let lo = (per * s.process_index).min(b.len());
        let hi = (per * (s.process_index + 1)).min(b.len());
        b[lo..hi].to_vec()
    };
    let mut out: Vec<Vec<usize>> = all
        .iter()
        .filter(|b| b.len() == batch_size)
        .map(|b| part(b))
        .collect();
    let (Some(first), Some(last)) = (all.first(), all.last()) else {
        return out;
    };
    if !drop_last && last.len() < batch_size {
        if !s.even_batches {
            if last.len() > per * s.process_index {
                out.push(part(last));
            }
        } else {
            let mut initial = first.clone();
            while initial.len() < batch_size {
                initial.extend_from_within(..);
            }
            let mut padded = last.clone();
            padded.extend(initial);
            out.push(part(&padded));
        }
    }
    out
}

fn whole(all: &[Vec<usize>], batch_size: usize, drop_last: bool, s: Shard) -> Vec<Vec<usize>> {
    let n = s.num_processes;
    let mut out = Vec::new();
    let mut initial: Vec<usize> = Vec::new();
    let mut to_yield: Option<&Vec<usize>> = None;
    for (idx, batch) in all.iter().enumerate() {
        if !drop_last && idx < n {
            initial.extend(batch);
        }
        if idx % n == s.process_index {
            to_yield = Some(batch);
        }
        if idx % n == n - 1 && batch.len() == batch_size {
            out.extend(to_yield.take().cloned());
        }
    }
    if drop_last || initial.is_empty() {
        return out;
    }
    if !s.even_batches {
        out.extend(to_yield.filter(|b| !b.is_empty()).cloned());
        return out;
    }
    if let Some(b) = to_yield.filter(|b| b.len() == batch_size) {
        out.push(b.clone());
    }
    while initial.len() < n * batch_size {
        initial.extend_from_within(..);
    }
    let mut idx = all.len() - 1;
    let mut batch = all[idx].clone();
    if batch.len() == batch_size {
        batch.clear();
        idx += 1;
    }
    let mut cycle = 0;
    while idx % n != 0 || !batch.is_empty() {
        let end = cycle + batch_size - batch.len();
        batch.extend_from_slice(&initial[cycle..end]);
        if idx % n == s.process_index {
            out.push(std::mem::take(&mut batch));
        }
        cycle = end;
        batch.clear();
        idx += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_order_and_the_epoch_changes_it() {
        let _rng = crate::global_rng();
        let a = epoch_order(16, true, 42, 0);
        assert_eq!(a, epoch_order(16, true, 42, 0));
        assert_ne!(a, epoch_order(16, true, 42, 1));
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..16).collect::<Vec<_>>());
    }

    #[test]
    fn drawing_an_order_leaves_the_global_generator_alone() {
        let _rng = crate::global_rng();
        use tch::{Device, Kind, Tensor};
        tch::manual_seed(5);
        let expected = Tensor::rand([3], (Kind::Float, Device::Cpu));
        tch::manual_seed(5);
        let _ = epoch_order(10, true, 1, 0);
        assert!(Tensor::rand([3], (Kind::Float, Device::Cpu)).equal(&expected));
    }

    #[test]
    fn world_of_two_whole_batches_even() {
        let _rng = crate::global_rng();
        // 10 items, batch 3: [0,1,2] [3,4,5] [6,7,8] [9]; Accelerate pads the
        // short tail from the start so both ranks get two full batches.
        let all = batches(&(0..10).collect::<Vec<_>>(), 3, false);
        let shard = |i| Shard {
            process_index: i,
            num_processes: 2,
            ..Shard::default()
        };
        assert_eq!(
            shard_batches(&all, 3, false, shard(0)),
            vec![vec![0, 1, 2], vec![6, 7, 8]]
        );
        assert_eq!(
            shard_batches(&all, 3, false, shard(1)),
            vec![vec![3, 4, 5], vec![9, 0, 1]]
        );
    }
}
