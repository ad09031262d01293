//! Mixed precision against Accelerate and PyTorch: the fp16 step logic
//! and the grad scaler's settings, autocast kwargs, fp16 on the CPU,
//! clipping and unscaling at the sync step, and fp8's refusals.

use hearth_testkit as common;

use common::oracle;
use hearth::accelerator::Accelerator;
use hearth::optim::Sgd;
use hearth::precision::MixedPrecision;
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::{linear_schedule, sgd};

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
