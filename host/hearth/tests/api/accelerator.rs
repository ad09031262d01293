//! The Accelerator against Accelerate and PyTorch: accumulation (sync
//! pattern and scheduler rates from Accelerate itself), GA=k×b equals
//! GA=1×kb, the fp16 step logic, the data loader's seeded order and
//! sharding (from Accelerate's samplers), resumable loader state, RNG state
//! and `find_executable_batch_size` on a real libtorch out-of-memory error.

use hearth_testkit as common;

use common::oracle;
use hearth::accelerator::{
    find_executable_batch_size, Accelerator, BatchSizeError, GradientAccumulationPlugin, LrSchedule,
};
use hearth::data::{batches, epoch_order, shard_batches, DataLoader, Shard};
use hearth::ops::SgdHyper;
use hearth::optim::Sgd;
use hearth::plugins::PluginError;
use hearth::precision::MixedPrecision;
use serde_json::Value;
use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};

use crate::{serial, FakeWorld};

fn sgd(lr: f64, momentum: f64) -> SgdHyper {
    SgdHyper {
        lr,
        momentum,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    }
}

/// PyTorch's `LambdaLR` with `1 - step / total` (floored at 0).
struct Linear {
    base: f64,
    total: f64,
}

/// A `Linear` schedule from `base` to zero over 10 steps, boxed for `prepare`.
fn linear_schedule(base: f64) -> Box<dyn LrSchedule> {
    Box::new(Linear { base, total: 10.0 })
}

impl LrSchedule for Linear {
    fn lrs(&mut self, step: u64) -> Result<Vec<f64>, PluginError> {
        Ok(vec![self.base * (1.0 - step as f64 / self.total).max(0.0)])
    }
}

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

#[test]
fn fp16_skips_an_overflowing_step_and_halves_the_scale() {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .mixed_precision(MixedPrecision::Fp16)
        .cpu_loss_scaling(true)
        .build()
        .unwrap();
    let p = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let opt = Sgd::new(vec![p.shallow_clone()], sgd(0.1, 0.0));
    let schedule = linear_schedule(0.1);
    let (mut opt, mut sched) = acc.prepare((opt, schedule)).unwrap();
    let mut step = |scale_by: f64| {
        acc.backward(&(&p * scale_by).sum(Kind::Float)).unwrap();
        let norm = acc.clip_grad_norm_(&mut opt, 100.0, 2.0).unwrap().unwrap();
        opt.step().unwrap();
        sched.step().unwrap();
        opt.zero_grad();
        (
            opt.step_was_skipped(),
            acc.loss_scale().unwrap(),
            f64::try_from(norm).unwrap(),
            sched.steps(),
        )
    };
    let (skipped, scale, norm, _) = step(1.0);
    assert!(!skipped && scale == 65536.0);
    assert!(
        (norm - 2f64.sqrt()).abs() < 1e-5,
        "clipping saw unscaled gradients: {norm}"
    );
    let after_clean: Vec<f32> = Vec::try_from(&p).unwrap();
    assert_eq!(after_clean, vec![0.9, 0.9]);
    let (skipped, scale, _, sched_steps) = step(f64::NAN);
    assert!(skipped && acc.optimizer_step_was_skipped());
    assert_eq!(scale, 32768.0);
    assert_eq!(
        Vec::<f32>::try_from(&p).unwrap(),
        after_clean,
        "a skipped step leaves the weights"
    );
    assert_eq!(
        sched_steps, 1,
        "the scheduler does not step when the optimizer skipped"
    );
    let (skipped, scale, _, sched_steps) = step(1.0);
    assert!(!skipped && scale == 32768.0);
    assert_eq!(sched_steps, 2);
}

/// The builder's `grad_scaler` (Accelerate's `GradScalerKwargs`) against
/// `torch.amp.GradScaler` run live with the same settings: the scale after
/// each of a run of clean and overflowing steps (growth every 2 clean
/// steps by 3, backoff by 0.25 from 1024) and the weights at the end; and
/// `enabled = false`, where nothing is scaled (torch's scale reads 1).
#[test]
fn the_grad_scaler_settings_step_as_torchs_grad_scaler() {
    use hearth::precision::GradScalerConfig;
    let steps = [
        "ok", "ok", "nan", "ok", "ok", "ok", "nan", "nan", "ok", "ok",
    ];
    for enabled in [true, false] {
        let steps: Vec<&str> = if enabled {
            steps.to_vec()
        } else {
            vec!["ok"; 3]
        };
        let config = GradScalerConfig {
            init_scale: 1024.0,
            growth_factor: 3.0,
            backoff_factor: 0.25,
            growth_interval: 2,
            enabled,
        };
        let mut args = vec![
            "1024",
            "3",
            "0.25",
            "2",
            if enabled { "true" } else { "false" },
        ];
        args.extend(&steps);
        let theirs: Value = serde_json::from_str(&oracle("grad_scaler_steps.py", &args)).unwrap();

        let mut acc = Accelerator::builder()
            .cpu(true)
            .mixed_precision(MixedPrecision::Fp16)
            .cpu_loss_scaling(true)
            .grad_scaler(config)
            .build()
            .unwrap();
        let p = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut opt = acc
            .prepare(Sgd::new(vec![p.shallow_clone()], sgd(0.1, 0.0)))
            .unwrap();
        let mut scales = Vec::new();
        for step in &steps {
            let factor = if *step == "nan" { f64::NAN } else { 1.0 };
            let loss =
                (&p * Tensor::from_slice(&[factor, 1.0]).to_kind(Kind::Float)).sum(Kind::Float);
            acc.backward(&loss).unwrap();
            opt.step().unwrap();
            opt.zero_grad();
            // torch's disabled scaler reads 1.0; hearth has none.
            scales.push(acc.loss_scale().unwrap_or(1.0));
        }
        let want: Vec<f64> = theirs["scales"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(scales, want, "enabled = {enabled}");
        assert_eq!(acc.loss_scale().is_some(), enabled);
        let ours: Vec<f32> = Vec::try_from(&p).unwrap();
        let param: Vec<f32> = theirs["param"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(ours, param, "enabled = {enabled}");
    }
}

/// `autocast_with(&AutocastKwargs)` against Accelerate's
/// `autocast(autocast_handler=AutocastKwargs(..))` run live, on the CPU
/// under bf16: what a linear layer returns by default, with autocast off,
/// off inside an `autocast()` block and after it; and the cast cache off
/// inside `cache_enabled: Some(false)` and back after.
#[test]
fn autocast_kwargs_do_what_accelerates_do() {
    use hearth::accelerator::AutocastKwargs;
    use tch::nn::Module;
    let theirs: Value =
        serde_json::from_str(&oracle("accelerate_autocast_kwargs.py", &[])).unwrap();
    let acc = Accelerator::builder()
        .cpu(true)
        .mixed_precision(MixedPrecision::Bf16)
        .build()
        .unwrap();
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let lin = tch::nn::linear(vs.root(), 4, 4, Default::default());
    let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    let name = |t: Tensor| match t.kind() {
        Kind::BFloat16 => "bfloat16",
        Kind::Float => "float32",
        other => panic!("{other:?}"),
    };
    let off = AutocastKwargs {
        enabled: false,
        ..Default::default()
    };
    let mut ours = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        ours.insert(k.into(), v);
    };
    {
        let _on = acc.autocast();
        put("default", name(lin.forward(&x)).into());
    }
    {
        let _off = acc.autocast_with(&off);
        put("disabled", name(lin.forward(&x)).into());
    }
    {
        let _on = acc.autocast();
        {
            let _off = acc.autocast_with(&off);
            put("nested_disabled", name(lin.forward(&x)).into());
        }
        put("outer_again", name(lin.forward(&x)).into());
    }
    put("after", name(lin.forward(&x)).into());
    {
        let _no_cache = acc.autocast_with(&AutocastKwargs {
            cache_enabled: Some(false),
            ..Default::default()
        });
        put("cache_inside", hearth::ops::autocast_cache_enabled().into());
    }
    put("cache_after", hearth::ops::autocast_cache_enabled().into());
    assert_eq!(Value::Object(ours), theirs);
}

#[test]
fn fp16_on_the_cpu_trains_in_float32_as_accelerate_does() {
    let acc = Accelerator::builder()
        .cpu(true)
        .mixed_precision(MixedPrecision::Fp16)
        .build()
        .unwrap();
    assert_eq!(acc.loss_scale(), None);
    assert!(acc.autocast().is_none());
}

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

fn ids(n: i64) -> Vec<Tensor> {
    (0..n).map(Tensor::from).collect()
}

fn values(batch: &Tensor) -> Vec<i64> {
    Vec::try_from(batch).unwrap()
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
fn rng_state_round_trips() {
    let _serial = serial();
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    acc.set_seed(123, false, false);
    let state = acc.rng_state().unwrap();
    let a = Tensor::randn([5], (Kind::Float, Device::Cpu));
    let _ = Tensor::randn([7], (Kind::Float, Device::Cpu));
    acc.set_rng_state(&state).unwrap();
    let b = Tensor::randn([5], (Kind::Float, Device::Cpu));
    assert!(a.equal(&b));
}

#[test]
fn find_executable_batch_size_backs_off_on_a_real_out_of_memory_error() {
    let mut tried = Vec::new();
    let fits = find_executable_batch_size(64, |bs| {
        tried.push(bs);
        // Above 40, ask libtorch for a petabyte: its allocator refuses.
        let elems = if bs > 40 { 1i64 << 48 } else { 16 };
        Tensor::f_empty([elems], (Kind::Float, Device::Cpu)).map(|_| bs)
    })
    .unwrap();
    assert_eq!(fits, 40);
    assert_eq!(tried, vec![64, 57, 51, 45, 40]);
    let other = find_executable_batch_size(8, |_| {
        Tensor::f_zeros([2], (Kind::Float, Device::Cpu)).and_then(|t| t.f_view([3]))
    });
    assert!(matches!(other, Err(BatchSizeError::Failed(_))));
}

/// A world of `n` processes in which this one has index `rank`; nothing
/// is communicated (enough for what is decided per process).
#[test]
fn a_scheduler_steps_once_per_process_unless_batches_are_split() {
    for (split, per_step) in [(false, 2), (true, 1)] {
        let mut acc = Accelerator::builder()
            .cpu(true)
            .process_group(Box::new(FakeWorld { rank: 0, n: 2 }))
            .split_batches(split)
            // A bare parameter, in no model: deliberately not synchronised.
            .check_prepared(false)
            .build()
            .unwrap();
        let p = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let opt = Sgd::new(vec![p.shallow_clone()], sgd(1.0, 0.0));
        let schedule = linear_schedule(1.0);
        let (mut opt, mut sched) = acc.prepare((opt, schedule)).unwrap();
        for _ in 0..3 {
            acc.accumulate(|| {
                acc.backward(&p.sum(Kind::Float)).unwrap();
                opt.step().unwrap();
                sched.step().unwrap();
                opt.zero_grad();
            });
        }
        assert_eq!(sched.steps(), 3 * per_step, "split_batches = {split}");
        assert!((opt.lr() - (1.0 - (3 * per_step) as f64 / 10.0)).abs() < 1e-12);
    }
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

#[test]
fn scheduler_state_round_trips_and_sets_the_rate() {
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let make = |acc: &mut Accelerator| {
        let p = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let opt = Sgd::new(vec![p.shallow_clone()], sgd(1.0, 0.0));
        let schedule = linear_schedule(1.0);
        let prepared = acc.prepare((opt, schedule)).unwrap();
        (p, prepared)
    };
    let (p, (mut opt, mut sched)) = make(&mut acc);
    for _ in 0..4 {
        acc.accumulate(|| {
            acc.backward(&p.sum(Kind::Float)).unwrap();
            opt.step().unwrap();
            sched.step().unwrap();
            opt.zero_grad();
        });
    }
    let (step, bytes) = sched.state().unwrap();
    let (_, (opt2, mut sched2)) = make(&mut acc);
    assert_eq!(opt2.lr(), 1.0);
    sched2.load_state(step, &bytes).unwrap();
    assert_eq!(sched2.steps(), 4);
    assert!((opt2.lr() - 0.6).abs() < 1e-12 && (opt.lr() - 0.6).abs() < 1e-12);
}

#[test]
fn prepare_twice_is_harmless_and_unwrap_gives_the_model_back() {
    let _serial = serial();
    use hearth::models::{Gpt, GptConfig, Model};
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let gpt = Gpt::new(
        GptConfig {
            vocab_size: 11,
            block_size: 8,
            d_model: 16,
            layers: 1,
            heads: 2,
        },
        Device::Cpu,
    );
    let names: Vec<String> = gpt.named_parameters().into_iter().map(|(n, _)| n).collect();
    let opt = Sgd::new(
        gpt.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect::<Vec<_>>(),
        sgd(0.1, 0.0),
    );
    let (model, opt) = acc.prepare((gpt, opt)).unwrap();
    let (model, opt) = acc.prepare((model, opt)).unwrap();
    assert_eq!(opt.parameters().len(), names.len());
    let state = acc.get_state_dict(&model);
    assert_eq!(
        state.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
        names
    );
    let gpt: Gpt = acc.unwrap_model(model);
    assert_eq!(gpt.named_parameters().len(), names.len());
    acc.free_memory(opt).unwrap();
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

/// fp16 with CPU loss scaling, 2 accumulation steps, and SGD (lr 1) over a
/// zero parameter of `n` elements: the setup of the unscale and clipping
/// tests.
fn fp16_sgd_over_two_micro_batches(
    n: i64,
) -> (
    Accelerator,
    Tensor,
    hearth::accelerator::AcceleratedOptimizer,
) {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .mixed_precision(MixedPrecision::Fp16)
        .cpu_loss_scaling(true)
        .gradient_accumulation_steps(2)
        .build()
        .unwrap();
    let p = Tensor::zeros([n], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let opt = acc
        .prepare(Sgd::new(vec![p.shallow_clone()], sgd(1.0, 0.0)))
        .unwrap();
    (acc, p, opt)
}

#[test]
fn clipping_waits_for_the_sync_step_under_fp16() {
    // Clipping on a micro-batch that does not sync must neither unscale nor
    // clip: the next micro-batch's gradients still arrive scaled.
    let (acc, p, mut opt) = fp16_sgd_over_two_micro_batches(1);
    let mut norms = Vec::new();
    for _ in 0..2 {
        acc.accumulate(|| {
            acc.backward(&(&p * 3.0).sum(Kind::Float)).unwrap();
            norms.push(
                acc.clip_grad_norm_(&mut opt, 1e6, 2.0)
                    .unwrap()
                    .map(|n| f64::try_from(n).unwrap()),
            );
            opt.step().unwrap();
            opt.zero_grad();
        });
    }
    assert_eq!(norms[0], None);
    assert!((norms[1].unwrap() - 3.0).abs() < 1e-6, "{norms:?}");
    assert!((f64::try_from(&p).unwrap() + 3.0).abs() < 1e-6);
}

/// `unscale_gradients` (Accelerate's): at a sync step it divides the
/// prepared optimizer's gradients by the loss scale in place, once — a
/// second call and the step's own unscale leave them alone; on a
/// micro-batch that does not sync it does nothing.
#[test]
fn unscale_gradients_divides_by_the_scale_once_and_only_at_a_sync_step() {
    let (acc, p, mut opt) = fp16_sgd_over_two_micro_batches(1);
    let mut seen = Vec::new();
    for _ in 0..2 {
        acc.accumulate(|| {
            acc.backward(&(&p * 3.0).sum(Kind::Float)).unwrap();
            opt.unscale_gradients().unwrap();
            opt.unscale_gradients().unwrap();
            seen.push(f64::try_from(p.grad()).unwrap());
            opt.step().unwrap();
            opt.zero_grad();
        });
    }
    // Each micro-batch's loss is halved (2 accumulation steps) and scaled
    // by PyTorch's initial scale, 2^16.
    assert_eq!(seen, [1.5 * 65536.0, 3.0]);
    assert_eq!(f64::try_from(&p).unwrap(), -3.0);
}

#[test]
fn a_group_mixing_dtypes_steps_like_separate_groups() {
    // PyTorch's optimizers split a group by (device, dtype) before each
    // fused call; hearth makes one call per group, which libtorch's CPU
    // kernel handles tensor by tensor. (Unverified on CUDA: no GPU here.)
    use hearth::ops::AdamHyper;
    use hearth::optim::{Adam, Optimizer};
    let make = || {
        (
            Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true),
            Tensor::ones([2], (Kind::Double, Device::Cpu)).set_requires_grad(true),
        )
    };
    let hyper = AdamHyper {
        weight_decay: 0.0,
        ..AdamHyper::adamw(0.1)
    };
    let (a, b) = make();
    let (c, d) = make();
    let mut mixed = Adam::new(vec![a.shallow_clone(), b.shallow_clone()], hyper);
    let mut split = Adam::new(
        vec![
            hearth::optim::ParamGroup::new(vec![c.shallow_clone()]),
            hearth::optim::ParamGroup::new(vec![d.shallow_clone()]),
        ],
        hyper,
    );
    for _ in 0..3 {
        (&a * 2.0).sum(Kind::Float).backward();
        (&b * 3.0).sum(Kind::Double).backward();
        (&c * 2.0).sum(Kind::Float).backward();
        (&d * 3.0).sum(Kind::Double).backward();
        mixed.step().unwrap();
        split.step().unwrap();
        mixed.zero_grad();
        split.zero_grad();
    }
    assert!(a.equal(&c) && b.equal(&d));
    assert!(f64::try_from(a.get(0)).unwrap() < 1.0);
}

#[test]
fn clip_grad_value_clamps_the_unscaled_gradients_at_the_sync_step_only() {
    let (acc, p, mut opt) = fp16_sgd_over_two_micro_batches(2);
    let mut grads = Vec::new();
    for _ in 0..2 {
        acc.accumulate(|| {
            let weights = Tensor::from_slice(&[3.0f32, -0.25]);
            acc.backward(&(&p * weights).sum(Kind::Float)).unwrap();
            acc.clip_grad_value_(&mut opt, 1.0).unwrap();
            grads.push(Vec::<f32>::try_from(p.grad()).unwrap());
            opt.step().unwrap();
            opt.zero_grad();
        });
    }
    // Off-sync: untouched, still scaled (65536 × 3 / 2 accumulation steps).
    assert_eq!(grads[0], vec![98304.0, -8192.0]);
    // At the sync step: unscaled (3, -0.25 summed over two halves) then clamped.
    assert_eq!(grads[1], vec![1.0, -0.25]);
    assert_eq!(Vec::<f32>::try_from(&p).unwrap(), vec![-1.0, 0.25]);
}

#[test]
fn save_writes_from_the_main_process_only() {
    let dir = common::scratch("acc-save");
    let tensors = vec![(
        "w".to_string(),
        Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]),
    )];
    for rank in [1, 0] {
        let acc = Accelerator::builder()
            .cpu(true)
            .process_group(Box::new(FakeWorld { rank, n: 2 }))
            .build()
            .unwrap();
        let path = dir.join("extra.safetensors");
        assert_eq!(acc.save(&tensors, &path).unwrap(), rank == 0);
        assert_eq!(path.exists(), rank == 0, "rank {rank}");
    }
    let back =
        hearth::checkpoint::load_safetensors(&dir.join("extra.safetensors"), Device::Cpu).unwrap();
    assert_eq!(back[0].0, "w");
    assert!(back[0].1.equal(&tensors[0].1));
}

#[test]
fn a_model_in_a_world_without_collectives_is_refused_naming_the_broadcast() {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .process_group(Box::new(FakeWorld { rank: 0, n: 2 }))
        .build()
        .unwrap();
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let _layer = nn::linear(vs.root(), 2, 2, Default::default());
    let err = acc.prepare(vs).err().unwrap();
    let source = std::error::Error::source(&err).unwrap().to_string();
    assert!(err.to_string().contains("rank 0's parameters"), "{err}");
    assert!(
        source.contains("broadcast") && source.contains("no collectives"),
        "{source}"
    );
}

/// A schedule that returns the given rates at every step.
struct Fixed(Vec<f64>);
impl LrSchedule for Fixed {
    fn lrs(&mut self, _: u64) -> Result<Vec<f64>, PluginError> {
        Ok(self.0.clone())
    }
}

/// Issue 18, item 4: a schedule of the user's that returns the wrong
/// number of rates (or an impossible rate) is an error naming the count
/// and the groups, not silently ignored.
#[test]
fn a_schedule_returning_the_wrong_number_of_rates_is_an_error() {
    let _serial = serial();
    let prepare = |rates: Vec<f64>| {
        let mut acc = Accelerator::builder().cpu(true).build().unwrap();
        let params =
            |n| vec![Tensor::ones([n], (Kind::Float, Device::Cpu)).set_requires_grad(true)];
        let opt = Sgd::new(
            vec![
                hearth::optim::ParamGroup::new(params(2)),
                hearth::optim::ParamGroup::new(params(3)),
            ],
            sgd(0.1, 0.0),
        );
        let schedule: Box<dyn LrSchedule> = Box::new(Fixed(rates));
        acc.prepare((opt, schedule))
    };
    let (opt, mut sched) = prepare(vec![0.5, 0.25]).unwrap();
    sched.step().unwrap();
    assert_eq!(opt.lrs(), [0.5, 0.25]);
    let (opt, mut sched) = prepare(vec![0.5]).unwrap();
    sched.step().unwrap();
    assert_eq!(opt.lrs(), [0.5, 0.5], "one rate is for every group");
    let chain = |e: &dyn std::error::Error| {
        let mut text = e.to_string();
        let mut at = e.source();
        while let Some(cause) = at {
            text = format!("{text}: {cause}");
            at = cause.source();
        }
        text
    };
    // Prepare asks for the first rates already.
    let error = |rates| match prepare(rates) {
        Err(e) => chain(&e),
        Ok((_, mut sched)) => chain(&sched.step().unwrap_err()),
    };
    let e = error(vec![0.1, 0.2, 0.3]);
    assert!(
        e.contains("returned 3 rates") && e.contains("2 parameter groups"),
        "{e}"
    );
    let e = error(vec![f64::NAN, 0.1]);
    assert!(e.contains("NaN") && e.contains("finite"), "{e}");
}

/// Every value of `enum` in Accelerate's own list either parses to a hearth
/// value of the same spelling or is refused with `refusal` in the message;
/// every hearth value is one of Accelerate's. Returns the values refused.
fn same_spellings<T>(
    accelerate: &Value,
    name: &str,
    hearth: &[T],
    spell: impl Fn(&T) -> String,
    parse: impl Fn(&str) -> Result<T, String>,
    refusal: &str,
) -> Vec<String> {
    let theirs: Vec<String> = serde_json::from_value(accelerate[name].clone()).unwrap();
    let mut refused = Vec::new();
    for value in &theirs {
        match parse(value) {
            Ok(t) => assert_eq!(&spell(&t), value, "{name} {value}"),
            Err(e) => {
                assert!(e.contains(refusal), "{name} {value}: {e}");
                refused.push(value.clone());
            }
        }
        // Accelerate's enums are case-insensitive where hearth parses.
        if let Ok(t) = parse(&value.to_ascii_uppercase()) {
            assert_eq!(&spell(&t), value);
        }
    }
    for t in hearth {
        assert!(
            theirs.contains(&spell(t)),
            "{name} {} is not Accelerate's",
            spell(t)
        );
    }
    let unknown = parse("no-such-value")
        .err()
        .expect("an unknown value is refused");
    assert!(unknown.contains("no-such-value"), "{unknown}");
    refused
}

#[test]
fn accelerates_enum_values_parse_with_its_spellings_or_say_why_not() {
    use hearth::accelerator::{LoggerType, RngType};
    use hearth::comm::DistributedType;
    let accelerate: Value = serde_json::from_str(&oracle("accelerate_enums.py", &[])).unwrap();
    let refused = same_spellings(
        &accelerate,
        "DistributedType",
        &[
            DistributedType::No,
            DistributedType::MultiCpu,
            DistributedType::MultiGpu,
            DistributedType::Fsdp,
        ],
        |t| t.to_string(),
        str::parse,
        "hearth does not drive",
    );
    assert!(refused.contains(&"DEEPSPEED".to_string()), "{refused:?}");
    let refused = same_spellings(
        &accelerate,
        "PrecisionType",
        &[
            MixedPrecision::No,
            MixedPrecision::Bf16,
            MixedPrecision::Fp16,
        ],
        |t| t.to_string(),
        str::parse,
        "FP8 tensor cores",
    );
    assert_eq!(refused, ["fp8"]);
    same_spellings(
        &accelerate,
        "RNGType",
        &[RngType::Torch, RngType::Cuda, RngType::Generator],
        |t| t.to_string(),
        str::parse,
        "hearth does not drive",
    );
    let refused = same_spellings(
        &accelerate,
        "LoggerType",
        &[
            LoggerType::All,
            LoggerType::Tensorboard,
            LoggerType::Mlflow,
            LoggerType::Dvclive,
            LoggerType::Wandb,
        ],
        |t| t.to_string(),
        str::parse,
        "hearth has no tracker plugin",
    );
    assert!(refused.contains(&"aim".to_string()), "{refused:?}");
    // Config files spell them the same way.
    let t: DistributedType = serde_json::from_str("\"MULTI_GPU\"").unwrap();
    assert_eq!(t, DistributedType::MultiGpu);
    assert_eq!(
        serde_json::to_string(&DistributedType::Fsdp).unwrap(),
        "\"FSDP\""
    );
    let e = serde_json::from_str::<MixedPrecision>("\"fp8\"").unwrap_err();
    assert!(e.to_string().contains("FP8 tensor cores"), "{e}");
}

/// `device_placement(false)` (Accelerate's `device_placement=False`): a
/// prepared loader puts its batches nowhere (`device()` is `None`) and they
/// come as the loader made them; by default it puts them on the
/// accelerator's device. On a GPU, `tests/cuda.rs` checks where models and
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

/// Bad `DdpOptions` are refused when the accelerator is built, naming the
/// field and what to set (the same checks as `[distributed]`'s).
#[test]
fn bad_ddp_options_are_refused_when_the_accelerator_is_built() {
    use hearth::parallel::{CommHook, CommWrapper, DdpOptions, PowerSgdOptions};
    let refusal = |ddp: DdpOptions| {
        Accelerator::builder()
            .cpu(true)
            .ddp(ddp)
            .build()
            .err()
            .expect("refused")
            .to_string()
    };
    let e = refusal(DdpOptions {
        comm_hook: CommHook::BatchedPowerSgd,
        ..Default::default()
    });
    assert!(
        e.starts_with("DistributedDataParallelKwargs: comm_hook = batched_power_sgd"),
        "{e}"
    );
    let e = refusal(DdpOptions {
        comm_wrapper: CommWrapper::Bf16,
        ..Default::default()
    });
    assert!(
        e.contains("comm_wrapper = bf16") && e.contains("set comm_hook"),
        "{e}"
    );
    let e = refusal(DdpOptions {
        comm_hook: CommHook::PowerSgd,
        comm_state_option: PowerSgdOptions {
            warm_start: false,
            start_power_sgd_iter: 1,
            ..Default::default()
        },
        ..Default::default()
    });
    assert!(
        e.contains("start_powerSGD_iter = 1") && e.contains("use_error_feedback"),
        "{e}"
    );
    let e = refusal(DdpOptions {
        bucket_cap_mb: 0.0,
        ..Default::default()
    });
    assert!(e.contains("bucket_cap_mb"), "{e}");
}

#[test]
fn fp8_is_accepted_and_refused_with_what_it_would_need() {
    let err = Accelerator::builder()
        .cpu(true)
        .fp8_recipe(hearth::precision::Fp8RecipeKwargs::default())
        .build()
        .err()
        .expect("refused");
    assert_eq!(
        err.to_string(),
        "mixed precision \"fp8\" needs a CUDA GPU with FP8 tensor cores (compute capability \
         8.9 or newer: Ada, Hopper, Blackwell) and an FP8 backend; this process trains on the \
         CPU, which has none. Use \"bf16\" instead"
    );
    // Accelerate's recipe defaults.
    let recipe = hearth::precision::Fp8RecipeKwargs::default();
    assert_eq!(
        (
            recipe.fp8_format.as_str(),
            recipe.amax_history_len,
            recipe.margin,
            recipe.interval
        ),
        ("HYBRID", 1024, 0, 1)
    );
}

#[test]
fn get_tracker_logs_to_that_tracker_alone_and_names_the_ones_there_are() {
    use hearth::plugins::{load_tracker, Manifest, Value as Logged};
    let work = common::scratch("get-tracker");
    let tracker = |name: &str| {
        let dir = common::repo_root().join("target/plugins").join(name);
        let manifest =
            Manifest::read(&dir).expect("built-in plugins are installed: run `make plugins`");
        load_tracker(&manifest, &work.join(name)).unwrap()
    };
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let none = acc.get_tracker("jsonl").err().expect("no trackers yet");
    assert_eq!(
        none.to_string(),
        "jsonl is not one of the run's trackers (it has none); trackers are started by init_trackers"
    );
    acc.init_trackers("p", "r", vec![tracker("jsonl"), tracker("csv")], Vec::new());
    let jsonl = acc.get_tracker("jsonl").unwrap();
    assert_eq!(jsonl.name(), "jsonl");
    jsonl.log(vec![("only_jsonl".into(), Logged::Float(1.5))], 3);
    acc.log(vec![("both".into(), Logged::Float(2.5))], 4);
    let err = acc.get_tracker("wandb").err().expect("not there");
    assert_eq!(
        err.to_string(),
        "wandb is not one of the run's trackers (jsonl, csv); trackers are started by init_trackers"
    );
    acc.end_training().unwrap();
    let lines = std::fs::read_to_string(work.join("jsonl/metrics.jsonl")).unwrap();
    let lines: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["only_jsonl"], 1.5);
    assert_eq!(lines[1]["both"], 2.5);
    let csv = std::fs::read_to_string(work.join("csv/metrics.csv")).unwrap();
    assert!(!csv.contains("only_jsonl") && csv.contains("both"), "{csv}");
}

/// The tracker thread takes what was logged in batches, a second apart
/// (`accelerator/trackers.rs`): a value logged while it waits goes with
/// the next batch, and the end of training delivers what is left at once.
#[test]
fn trackers_take_logged_values_in_batches_and_the_end_delivers_the_rest() {
    use hearth::plugins::{load_tracker, Manifest, Value as Logged};
    use std::time::{Duration, Instant};
    let work = common::scratch("tracker-batches");
    let dir = common::repo_root().join("target/plugins/jsonl");
    let manifest =
        Manifest::read(&dir).expect("built-in plugins are installed: run `make plugins`");
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    acc.init_trackers(
        "p",
        "r",
        vec![load_tracker(&manifest, &work).unwrap()],
        Vec::new(),
    );
    let file = work.join("metrics.jsonl");
    let steps_in_file = || -> Vec<u64> {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        text.lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect()
    };
    acc.log(vec![("a".into(), Logged::Float(1.0))], 1);
    let waiting = Instant::now();
    while steps_in_file().is_empty() {
        assert!(
            waiting.elapsed() < Duration::from_secs(30),
            "step 1 never arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Step 1's batch was taken whole before it was written, so step 2 goes
    // with the next batch, a second later.
    let delivered = Instant::now();
    acc.log(vec![("a".into(), Logged::Float(2.0))], 2);
    std::thread::sleep(Duration::from_millis(200));
    let seen = steps_in_file();
    if delivered.elapsed() < Duration::from_millis(800) {
        assert_eq!(seen, [1], "step 2 waits for the next batch");
    }
    acc.end_training().unwrap();
    assert_eq!(steps_in_file(), [1, 2]);
}

/// A place in a world of 4 processes on 2 machines, without collectives.
struct Place {
    rank: usize,
}

impl hearth::comm::ProcessGroup for Place {
    fn process_index(&self) -> usize {
        self.rank
    }
    fn num_processes(&self) -> usize {
        4
    }
    fn local_process_index(&self) -> usize {
        self.rank % 2
    }
    fn num_local_processes(&self) -> usize {
        2
    }
    fn backend(&self) -> &'static str {
        "test"
    }
}

#[test]
fn save_and_save_object_write_on_the_main_process_or_each_machines_first() {
    let work = common::scratch("save-object");
    #[derive(serde::Serialize)]
    struct Summary {
        epoch: u32,
        losses: Vec<f64>,
    }
    let summary = Summary {
        epoch: 3,
        losses: vec![0.5, 0.25],
    };
    let tensors = vec![("w".to_string(), Tensor::from_slice(&[1.0f32, 2.0]))];
    for each_node in [false, true] {
        for rank in 0..4 {
            let acc = Accelerator::builder()
                .cpu(true)
                .process_group(Box::new(Place { rank }))
                .project_config(hearth::accelerator::ProjectConfiguration {
                    save_on_each_node: each_node,
                    ..Default::default()
                })
                .build()
                .unwrap();
            let json = work.join(format!("{each_node}-{rank}.json"));
            let st = work.join(format!("{each_node}-{rank}.safetensors"));
            let wrote = acc.save_object(&summary, &json).unwrap();
            assert_eq!(acc.save(&tensors, &st).unwrap(), wrote);
            // Accelerate: the main process, or each machine's local main.
            assert_eq!(
                wrote,
                rank == 0 || (each_node && rank == 2),
                "{each_node} {rank}"
            );
            assert_eq!(json.exists(), wrote);
            if wrote {
                let back: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
                assert_eq!(back, serde_json::json!({"epoch": 3, "losses": [0.5, 0.25]}));
                let w = hearth::checkpoint::read_safetensor(&st, "w").unwrap();
                assert_eq!(Vec::<f32>::try_from(&w).unwrap(), [1.0, 2.0]);
            }
        }
    }
}

/// `free_memory` (and `clear`) forget what Accelerate's forget, run live
/// (`tests/oracles/accelerate_free_memory.py`): the step counter goes back
/// to 0 and a later save holds no model, optimizer or scheduler.
#[test]
fn free_memory_forgets_what_accelerates_does() {
    let _serial = serial();
    let dir = common::scratch("free-memory");
    let oracle: Value = serde_json::from_str(
        oracle(
            "accelerate_free_memory.py",
            &[dir.join("accelerate").to_str().unwrap()],
        )
        .trim(),
    )
    .unwrap();
    let stems = |folder: std::path::PathBuf| -> Vec<String> {
        let mut stems: Vec<String> = std::fs::read_dir(folder)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .map(|f| f.split(['.', '_']).next().unwrap().to_string())
            .filter(|s| ["model", "optimizer", "scheduler"].contains(&s.as_str()))
            .collect();
        stems.sort();
        stems.dedup();
        stems
    };
    let accelerate_stems = |files: &Value| -> Vec<String> {
        let mut stems: Vec<String> = files
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                f.as_str()
                    .unwrap()
                    .split(['.', '_'])
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect();
        stems.dedup();
        stems
    };
    for clear in [false, true] {
        let mut acc = Accelerator::builder()
            .cpu(true)
            .gradient_accumulation_steps(2)
            .build()
            .unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let _layer = nn::linear(vs.root(), 3, 2, Default::default());
        let opt = Sgd::new(vs.trainable_variables(), sgd(0.1, 0.0));
        let (vs, opt) = acc.prepare((vs, opt)).unwrap();
        let sched = acc.prepare((opt, linear_schedule(0.1))).unwrap();
        for _ in 0..3 {
            acc.accumulate(|| ());
        }
        let before = acc
            .save_state(Some(&dir.join(format!("before-{clear}"))))
            .unwrap();
        assert_eq!(acc.step(), oracle["before"]["step"].as_u64().unwrap());
        assert_eq!(stems(before), accelerate_stems(&oracle["before"]["files"]));
        if clear {
            acc.clear((vs, sched)).unwrap();
        } else {
            acc.free_memory((vs, sched)).unwrap();
        }
        assert_eq!(acc.step(), oracle["after"]["step"].as_u64().unwrap());
        let after = acc
            .save_state(Some(&dir.join(format!("after-{clear}"))))
            .unwrap();
        assert_eq!(stems(after), accelerate_stems(&oracle["after"]["files"]));
        acc.accumulate(|| ());
        assert_eq!(
            acc.step(),
            oracle["after"]["step_after_one_more"].as_u64().unwrap()
        );
    }
}

/// Trackers by name (Accelerate's `log_with` and `init_trackers`): the
/// config is any serialisable value, flattened with dots; `log_scalars`
/// takes plain pairs; only the main process finds, loads and gives folders
/// to trackers; an unknown name is an error naming it.
#[test]
fn trackers_by_name_take_a_serialised_config_and_only_the_main_process_makes_their_folders() {
    let work = common::scratch("log-with");
    let config = serde_json::json!({"lr": 0.1, "model": {"layers": 2, "kind": "gpt"}, "tags": ["a"], "none": null});
    for rank in [0, 1] {
        let dir = work.join(format!("rank{rank}"));
        let mut acc = Accelerator::builder()
            .cpu(true)
            .process_group(Box::new(Place { rank }))
            .project_config(hearth::accelerator::ProjectConfiguration {
                project_dir: dir.clone(),
                ..Default::default()
            })
            .log_with(["jsonl"])
            .build()
            .unwrap();
        acc.init_trackers_named("proj", &config).unwrap();
        acc.log_scalars(&[("loss", 1.25), ("lr", 0.1)], 3);
        #[derive(serde::Serialize)]
        struct Eval {
            accuracy: f64,
            samples: u32,
        }
        #[derive(serde::Serialize)]
        struct Metrics {
            eval: Eval,
        }
        let eval = Eval {
            accuracy: 0.5,
            samples: 64,
        };
        acc.log_serialized(&Metrics { eval }, 4).unwrap();
        acc.end_training().unwrap();
        let folder = dir.join("trackers").join("jsonl");
        if rank == 1 {
            assert!(
                !dir.join("trackers").exists(),
                "rank 1 made {}",
                folder.display()
            );
            continue;
        }
        let written: Value =
            serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(written["project"], "proj");
        assert_eq!(
            written["config"],
            serde_json::json!({"lr": 0.1, "model.layers": 2, "model.kind": "gpt", "tags": "[\"a\"]"})
        );
        let lines: Vec<Value> = std::fs::read_to_string(folder.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(
            lines,
            [
                serde_json::json!({"step": 3, "loss": 1.25, "lr": 0.1}),
                serde_json::json!({"step": 4, "eval.accuracy": 0.5, "eval.samples": 64})
            ]
        );
    }
    let mut acc = Accelerator::builder()
        .cpu(true)
        .log_with(["no-such-tracker"])
        .build()
        .unwrap();
    let err = acc
        .init_trackers_named("proj", &config)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no plugin named `no-such-tracker`"), "{err}");
}
