//! The prepared data loader against Accelerate's samplers: seeded order
//! and sharding, resumable state, iterable datasets, split batches and
//! device placement.

use hearth_testkit as common;

use common::oracle;
use hearth::accelerator::Accelerator;
use hearth::data::{batches, epoch_order, shard_batches, DataLoader, Shard};
use serde_json::Value;
use tch::{Device, Tensor};

use crate::{ids, values, FakeWorld};

#[test]
fn seeded_order_and_sharding_match_accelerate_for_maps_and_streams() {
    let worlds = [
        "2:0:1:0", "2:0:0:0", "3:0:1:0", "2:1:1:0", "2:1:0:0", "3:0:1:1", "4:1:1:0",
    ];
    let mut args = vec!["10", "4", "42", "3"];
    args.extend(worlds);
    let theirs: Value = serde_json::from_str(&oracle("accelerate_sampler.py", &args)).unwrap();
    for epoch in 0..3u64 {
        let ours = epoch_order(10, true, 42, epoch);
        let expected: Vec<usize> =
            serde_json::from_value(theirs["orders"][epoch as usize].clone()).unwrap();
        assert_eq!(ours, expected, "epoch {epoch} order");
    }
    let order: Vec<usize> = (0..10).collect();
    for w in worlds {
        let f: Vec<usize> = w.split(':').map(|x| x.parse().unwrap()).collect();
        let all = batches(&order, 4, f[3] == 1);
        for rank in 0..f[0] {
            let shard = Shard {
                process_index: rank,
                num_processes: f[0],
                split_batches: f[1] == 1,
                even_batches: f[2] == 1,
            };
            let expected: Vec<Vec<usize>> =
                serde_json::from_value(theirs["shards"][w][rank].clone()).unwrap();
            assert_eq!(
                shard_batches(&all, 4, f[3] == 1, shard),
                expected,
                "world {w}, rank {rank}"
            );
            if let Some(streams) = theirs["streams"].get(w) {
                let expected: Vec<Vec<i64>> =
                    serde_json::from_value(streams[rank].clone()).unwrap();
                let ours: Vec<Vec<i64>> = DataLoader::iterable(Counter(10), 4)
                    .drop_last(f[3] == 1)
                    .sharded(shard)
                    .iter()
                    .map(|b| values(&b))
                    .collect();
                assert_eq!(ours, expected, "stream world {w}, rank {rank}");
            }
        }
    }
}

#[test]
fn skip_first_batches_applies_to_the_resumed_epoch_only() {
    let loader = DataLoader::new(ids(16), 4);
    loader.skip_first_batches(2);
    let resumed: Vec<Vec<i64>> = loader.iter().map(|b| values(&b)).collect();
    assert_eq!(resumed, vec![vec![8, 9, 10, 11], vec![12, 13, 14, 15]]);
    assert_eq!(loader.iter().count(), 4, "the next epoch is whole");
}

#[test]
fn a_restored_loader_sees_exactly_the_batches_the_first_would_have() {
    let make = || DataLoader::new(ids(10), 3).shuffle(7).drop_last(false);
    let first = make();
    let mut all_first = Vec::new();
    let mut saved = None;
    for epoch in 0..3 {
        for (i, b) in first.iter().enumerate() {
            if epoch == 1 && i == 2 {
                saved = Some(first.state());
            }
            all_first.push(values(&b));
        }
    }
    let state = saved.unwrap();
    // Saved while the third batch of epoch 1 was in hand: three are taken.
    assert_eq!((state.epoch, state.batches_seen, state.seed), (1, 3, 7));
    let second = make();
    second.load_state(state);
    let mut resumed = Vec::new();
    while second.state().epoch < 3 {
        resumed.extend(second.iter().map(|b| values(&b)));
    }
    // Epoch 0 has 4 batches; epoch 1's first three were taken before the save.
    assert_eq!(resumed, all_first[7..].to_vec());
    assert_ne!(
        all_first[..4],
        all_first[4..8],
        "epochs are shuffled differently"
    );
}

#[test]
fn the_last_batch_of_an_epoch_is_known_before_it_is_used() {
    let acc = Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_steps(3)
        .build()
        .unwrap();
    let mut acc = acc;
    let loader = acc.prepare(DataLoader::new(ids(4), 1)).unwrap();
    let ends: Vec<bool> = loader
        .iter()
        .map(|_| acc.gradient_state().end_of_dataloader())
        .collect();
    assert_eq!(ends, [false, false, false, true]);
    assert!(
        !acc.gradient_state().end_of_dataloader(),
        "reset once the epoch is over"
    );
}

#[test]
fn a_prepared_loader_reads_its_rank_s_share() {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .process_group(Box::new(FakeWorld { rank: 1, n: 2 }))
        .build()
        .unwrap();
    let loader = acc.prepare(DataLoader::new(ids(10), 3)).unwrap();
    let got: Vec<Vec<i64>> = loader.iter().map(|b| values(&b)).collect();
    // Batches [0 1 2] [3 4 5] [6 7 8] [9 + 0 1]: rank 1 takes the 2nd and 4th.
    assert_eq!(got, vec![vec![3, 4, 5], vec![9, 0, 1]]);
}

/// An endless stream 0, 1, 2, … (a new one each epoch).
struct Counter(i64);

impl hearth::data::IterableDataset for Counter {
    type Item = Tensor;
    fn stream(&self, _epoch: u64) -> Box<dyn Iterator<Item = Tensor> + '_> {
        Box::new((0..self.0).map(Tensor::from))
    }
}

#[test]
fn iterable_datasets_batch_drop_and_shard_like_accelerate() {
    let all: Vec<Vec<i64>> = DataLoader::iterable(Counter(7), 3)
        .iter()
        .map(|b| values(&b))
        .collect();
    assert_eq!(all, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]);
    let dropped = DataLoader::iterable(Counter(7), 3).drop_last(true);
    assert_eq!(dropped.iter().count(), 2);
    // Two processes: each takes its 3 of every 6; the short tail is
    // completed from the start (IterableDatasetShard without drop_last).
    let rank = |r| {
        DataLoader::iterable(Counter(7), 3)
            .sharded(Shard {
                process_index: r,
                num_processes: 2,
                ..Shard::default()
            })
            .iter()
            .map(|b| values(&b))
            .collect::<Vec<_>>()
    };
    assert_eq!(rank(0), vec![vec![0, 1, 2], vec![6, 0, 1]]);
    assert_eq!(rank(1), vec![vec![3, 4, 5], vec![2, 3, 4]]);
}

#[test]
fn an_epoch_left_early_is_read_again_and_its_end_mark_cleared() {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_steps(2)
        .build()
        .unwrap();
    let loader = acc.prepare(DataLoader::new(ids(6), 2).shuffle(3)).unwrap();
    let first: Vec<i64> = values(&loader.iter().next().unwrap());
    assert_eq!(loader.state().epoch, 0);
    let again: Vec<Vec<i64>> = loader.iter().map(|b| values(&b)).collect();
    assert_eq!(again[0], first, "the same epoch, from its start");
    assert_eq!(loader.state().epoch, 1);
    // Leave on the last batch: the end mark must not stick.
    for _ in loader.iter() {}
    let mut it = loader.iter();
    while it.next().is_some() {
        if acc.gradient_state().end_of_dataloader() {
            break;
        }
    }
    drop(it);
    assert!(!acc.gradient_state().end_of_dataloader());
}

#[test]
fn split_batches_that_do_not_divide_are_refused() {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .process_group(Box::new(FakeWorld { rank: 0, n: 2 }))
        .split_batches(true)
        .build()
        .unwrap();
    let err = acc.prepare(DataLoader::new(ids(10), 3)).err().unwrap();
    assert!(err.to_string().contains("batch size 3"), "{err}");
}

/// `device_placement(false)` (Accelerate's `device_placement=False`): a
/// prepared loader puts its batches nowhere (`device()` is `None`) and they
/// come as the loader made them; by default it puts them on the
/// accelerator's device. On a GPU, `host/hearth/tests/cuda/` checks where models and
/// batches end up, with `non_blocking` too.
#[test]
fn device_placement_off_leaves_batches_where_the_loader_made_them() {
    for (place, want) in [(true, Some(Device::Cpu)), (false, None)] {
        let mut acc = Accelerator::builder()
            .cpu(true)
            .device_placement(place)
            .dataloader_config(hearth::accelerator::DataLoaderConfiguration {
                non_blocking: true,
                ..Default::default()
            })
            .build()
            .unwrap();
        assert_eq!(acc.device_placement(), place);
        let loader = acc.prepare(DataLoader::new(ids(6), 3)).unwrap();
        assert_eq!(loader.device(), want);
        let batches: Vec<Vec<i64>> = loader.iter().map(|b| values(&b)).collect();
        assert_eq!(batches, vec![vec![0, 1, 2], vec![3, 4, 5]]);
    }
}
