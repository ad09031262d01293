//! Gradient accumulation against Accelerate: the sync pattern and the
//! scheduler's rates from Accelerate itself, the accumulation plugin, and
//! GA=k×b equal to GA=1×kb.

use hearth_testkit as common;

use common::oracle;
use hearth::accelerator::{Accelerator, GradientAccumulationPlugin};
use hearth::data::DataLoader;
use hearth::optim::Sgd;
use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};

use crate::{linear_schedule, serial, sgd};

/// Runs Accelerate's accumulation oracle with `args` and the same loop here
/// on `acc` (ones through a 1→1 linear layer, SGD, the linear schedule over
/// 10 steps, a loader of `n` batches for `epochs`); checks every
/// micro-batch's sync flag and rate against Accelerate's and returns the
/// sync flags.
fn accumulate_like_accelerate(
    mut acc: Accelerator,
    n: usize,
    epochs: usize,
    args: &[&str],
) -> Vec<bool> {
    // [sync_gradients, lr, the scheduler's _step_count] per micro-batch.
    let expected: Vec<(bool, f64, u64)> =
        serde_json::from_str(&oracle("accelerate_accumulation.py", args)).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 1, 1, Default::default());
    let opt = Sgd::new(vs.trainable_variables(), sgd(1.0, 0.0));
    let data: Vec<Tensor> = (0..n)
        .map(|_| Tensor::ones([1], (Kind::Float, Device::Cpu)))
        .collect();
    let schedule = linear_schedule(1.0);
    // Any order: the scheduler comes first and still binds to the optimizer.
    let (mut sched, _vs, mut opt, loader) = acc
        .prepare((schedule, vs, opt, DataLoader::new(data, 1)))
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..epochs {
        for x in loader.iter() {
            acc.accumulate(|| {
                acc.backward(&layer.forward(&x).sum(Kind::Float)).unwrap();
                opt.step().unwrap();
                sched.step().unwrap();
                opt.zero_grad();
            });
            seen.push((acc.sync_gradients(), opt.lr(), sched.steps()));
        }
    }
    assert_eq!(seen.len(), expected.len(), "{args:?}");
    for (i, (ours, theirs)) in seen.iter().zip(&expected).enumerate() {
        assert_eq!(ours.0, theirs.0, "sync at micro-batch {i} ({args:?})");
        assert!(
            (ours.1 - theirs.1).abs() < 1e-12,
            "lr at micro-batch {i} ({args:?}): {} vs Accelerate's {}",
            ours.1,
            theirs.1
        );
        // PyTorch counts the step its constructor takes.
        assert_eq!(
            ours.2 + 1,
            theirs.2,
            "scheduler steps at micro-batch {i} ({args:?})"
        );
    }
    seen.iter().map(|s| s.0).collect()
}

#[test]
fn accumulation_syncs_and_schedules_exactly_like_accelerate() {
    let _serial = serial();
    let acc = Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_steps(2)
        .build()
        .unwrap();
    let flags = accumulate_like_accelerate(acc, 5, 2, &["2", "5", "2", "10"]);
    assert_eq!(
        flags,
        [false, true, false, true, true, false, true, false, true, true]
    );
}

#[test]
fn the_accumulation_plugin_syncs_and_schedules_like_accelerates() {
    let _serial = serial();
    for (sync_with_dataloader, adjust_scheduler) in [(false, true), (true, false), (false, false)] {
        let plugin = GradientAccumulationPlugin {
            num_steps: 3,
            sync_with_dataloader,
            adjust_scheduler,
            sync_each_batch: false,
        };
        let acc = Accelerator::builder()
            .cpu(true)
            .gradient_accumulation_plugin(plugin)
            .build()
            .unwrap();
        let flags = [sync_with_dataloader, adjust_scheduler].map(|f| (f as u8).to_string());
        let synced =
            accumulate_like_accelerate(acc, 5, 2, &["3", "5", "2", "10", &flags[0], &flags[1]]);
        // Without the loader's say, only every third micro-batch of the
        // ten (across the two epochs of five) syncs.
        let every_third = (1..=10).map(|i| i % 3 == 0).collect::<Vec<_>>();
        assert_eq!(synced == every_third, !sync_with_dataloader, "{plugin:?}");
    }
}

#[test]
fn both_accumulation_steps_and_the_plugin_are_refused_as_accelerate_does() {
    let err = Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_steps(4)
        .gradient_accumulation_plugin(GradientAccumulationPlugin::default())
        .build()
        .err()
        .expect("refused");
    assert_eq!(
        err.to_string(),
        "gradient_accumulation_steps(4) and gradient_accumulation_plugin(..) were both given; \
         give only the plugin, with num_steps = 4"
    );
    // Accelerate's defaults.
    assert_eq!(
        GradientAccumulationPlugin::default(),
        GradientAccumulationPlugin {
            num_steps: 1,
            adjust_scheduler: true,
            sync_with_dataloader: true,
            sync_each_batch: false
        }
    );
}

/// Trains a linear regression on 12 examples for 2 epochs with batch `b`
/// and `ga` accumulation steps; returns the final weights.
fn train_linear(b: usize, ga: usize) -> Tensor {
    tch::manual_seed(11);
    let xs = Tensor::randn([12, 3], (Kind::Float, Device::Cpu));
    let ys = Tensor::randn([12, 2], (Kind::Float, Device::Cpu));
    let data: Vec<(Tensor, Tensor)> = (0..12).map(|i| (xs.get(i), ys.get(i))).collect();
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 3, 2, Default::default());
    let mut acc = Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_steps(ga)
        .build()
        .unwrap();
    let opt = Sgd::new(vs.trainable_variables(), sgd(0.1, 0.9));
    let (mut opt, loader) = acc
        .prepare((opt, DataLoader::new(data, b).shuffle(5)))
        .unwrap();
    for _ in 0..2 {
        for (x, y) in loader.iter() {
            acc.accumulate(|| {
                let loss = layer.forward(&x).mse_loss(&y, Reduction::Mean);
                acc.backward(&loss).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
            });
        }
    }
    Tensor::cat(
        &[layer.ws.flatten(0, -1), layer.bs.unwrap().flatten(0, -1)],
        0,
    )
}

#[test]
fn accumulating_k_batches_of_b_equals_one_batch_of_k_times_b() {
    let _serial = serial();
    let one_big = train_linear(6, 1);
    let accumulated = train_linear(2, 3);
    let diff = f64::try_from((&one_big - &accumulated).abs().max()).unwrap();
    assert!(diff < 1e-6, "GA=3 × 2 and GA=1 × 6 differ by {diff}");
    // And it did train: different from no accumulation at batch 2.
    let plain = train_linear(2, 1);
    assert!(f64::try_from((&one_big - &plain).abs().max()).unwrap() > 1e-3);
}

#[test]
fn a_prepared_optimizer_waits_for_the_sync_step() {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_steps(2)
        .build()
        .unwrap();
    let p = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let mut opt = acc
        .prepare(Sgd::new(vec![p.shallow_clone()], sgd(1.0, 0.0)))
        .unwrap();
    let micro = |opt: &mut hearth::accelerator::AcceleratedOptimizer| {
        acc.accumulate(|| {
            acc.backward(&(&p * 2.0).sum(Kind::Float)).unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        })
    };
    micro(&mut opt);
    assert_eq!(f64::try_from(&p).unwrap(), 0.0, "no step before the sync");
    assert_eq!(
        f64::try_from(p.grad()).unwrap(),
        1.0,
        "gradients kept (2 / GA)"
    );
    micro(&mut opt);
    assert_eq!(
        f64::try_from(&p).unwrap(),
        -2.0,
        "one step with the summed gradient"
    );
    assert!(
        !p.grad().defined(),
        "gradients dropped after the sync (set_to_none)"
    );
}
