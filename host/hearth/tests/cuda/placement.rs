//! Where tensors live: device placement of batches and models, the CUDA
//! generator's state, out-of-memory back-off, cpu-offload, dispatched
//! models, pinned host memory and async saves from the GPU.

use super::{cuda, SMALL_GPT};
use hearth::accelerator::Accelerator;
use hearth::models::{Gpt, Model};
use hearth::ops::{AdamHyper, SgdHyper};
use hearth::optim::{Adam, Sgd};
use hearth::precision::MixedPrecision;
use tch::{Device, Kind, Tensor};

/// Accelerate's `device_placement` and `DataLoaderConfiguration.non_blocking`
/// on a GPU: by default a prepared VarStore and a prepared loader's batches
/// are on the GPU (non-blocking copies give the same values); with
/// `device_placement(false)` both stay on the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_placement_and_non_blocking_decide_where_batches_and_models_go() {
    use hearth::data::DataLoader;
    let cuda = cuda();
    let examples =
        || -> Vec<Tensor> { (0..4i64).map(|i| Tensor::from_slice(&[i, i + 1])).collect() };
    for (place, non_blocking) in [(true, false), (true, true), (false, false)] {
        let mut acc = Accelerator::builder()
            .device(cuda)
            .device_placement(place)
            .non_blocking(non_blocking)
            .build()
            .unwrap();
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let _ = tch::nn::linear(vs.root(), 2, 2, Default::default());
        let (vs, loader) = acc.prepare((vs, DataLoader::new(examples(), 2))).unwrap();
        let want = if place { cuda } else { Device::Cpu };
        assert_eq!(loader.device(), place.then_some(cuda));
        for t in vs.trainable_variables() {
            assert_eq!(t.device(), want, "model, placement {place}");
        }
        let batches: Vec<Tensor> = loader.iter().collect();
        assert_eq!(batches.len(), 2);
        for (i, b) in batches.iter().enumerate() {
            assert_eq!(b.device(), want, "batch, placement {place}");
            let values = Vec::<i64>::try_from(&b.to_device(Device::Cpu).reshape([-1])).unwrap();
            let i = 2 * i as i64;
            assert_eq!(values, vec![i, i + 1, i + 1, i + 2]);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_generator_state_round_trips() {
    let device = cuda();
    let acc = Accelerator::builder().build().unwrap();
    acc.set_seed(5, false, false);
    let state = acc.rng_state().unwrap();
    assert!(!state.cuda.is_empty());
    let a = Tensor::randn([8], (Kind::Float, device));
    acc.set_rng_state(&state).unwrap();
    let b = Tensor::randn([8], (Kind::Float, device));
    assert!(a.equal(&b));
}

/// `find_executable_batch_size` on a real CUDA out-of-memory error: each
/// try asks the caching allocator for `batch size × 4 GiB`, so the first
/// sizes exceed any GPU of today and the search backs off (emptying the
/// cache between tries) to the first size that fits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn find_executable_batch_size_backs_off_on_a_real_cuda_out_of_memory() {
    use hearth::accelerator::find_executable_batch_size;
    let device = cuda();
    const GIB4: i64 = 1 << 30; // float32 elements: 4 GiB
    let mut tried = Vec::new();
    let fits = find_executable_batch_size(256, |bs| {
        tried.push(bs);
        Tensor::f_empty([bs as i64 * GIB4], (Kind::Float, device)).map(|mut t| {
            let _ = t.f_fill_(1.0).unwrap();
            bs
        })
    })
    .unwrap();
    assert!(tried.len() > 1, "256 × 4 GiB fitted: {tried:?}");
    assert_eq!(tried.last(), Some(&fits));
    assert!(
        fits >= 2,
        "2 × 4 GiB should fit on any GPU this runs on: {tried:?}"
    );
    eprintln!("tried {tried:?}: {fits} × 4 GiB fits");
    // The failed tries left nothing behind: the same size fits again.
    assert!(Tensor::f_empty([fits as i64 * GIB4], (Kind::Float, device)).is_ok());
}

/// One GPT trained 6 SGD steps on the GPU: plainly, and prepared with
/// `strategy` and `cpu-offload` in a world of one (ZeRO-Offload on one GPU).
/// Returns the losses, the final weights (on the CPU) and where the
/// optimizer state and the model's parameters were between steps.
fn train_offloaded(
    strategy: Option<hearth::parallel::ShardingStrategy>,
    precision: MixedPrecision,
) -> (Vec<f64>, Vec<Tensor>, Vec<Device>, usize) {
    use hearth::parallel::FsdpPlugin;
    let device = cuda();
    let mut builder = Accelerator::builder().mixed_precision(precision);
    if let Some(strategy) = strategy {
        builder = builder.fsdp(FsdpPlugin {
            sharding_strategy: Some(strategy),
            auto_wrap_policy: Some("transformer-based".into()),
            transformer_cls_names_to_wrap: Some(vec!["Block".into()]),
            cpu_offload: Some(true),
            ..Default::default()
        });
    }
    let mut acc = builder.build().unwrap();
    tch::manual_seed(0);
    let config = SMALL_GPT;
    let model = Gpt::new(config, Device::Cpu);
    let params = model
        .named_parameters()
        .into_iter()
        .map(|(_, t)| t)
        .collect::<Vec<_>>();
    // SGD with momentum: AdamW's division by its second moment would
    // magnify the rounding differences of a CPU step into lr-sized ones
    // for gradients that are zero but for rounding (see the parity oracle).
    let opt = Sgd::new(
        params,
        SgdHyper {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 1e-3,
            nesterov: false,
        },
    );
    let (model, mut opt) = acc.prepare((model, opt)).unwrap();
    let x = Tensor::randint(16, [8, 8], (Kind::Int64, Device::Cpu)).to_device(device);
    let mut losses = Vec::new();
    for _ in 0..6 {
        let loss = model
            .forward_t(&x, true)
            .view([-1, 16])
            .cross_entropy_for_logits(&x.view([-1]));
        acc.backward(&loss).unwrap();
        acc.clip_grad_norm_(&mut opt, 0.5, 2.0).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        losses.push(f64::try_from(&loss).unwrap());
    }
    // The optimizer's parameters (the shards when sharded) and its state.
    let state: Vec<Device> = opt
        .with_inner(|o| o.state_dict())
        .tensors
        .iter()
        .map(|(_, t)| t.device())
        .chain(opt.parameters().iter().map(Tensor::device))
        .collect();
    let held_on_gpu = model
        .named_parameters()
        .iter()
        .filter(|(_, t)| t.device() == device && t.numel() > 0)
        .count();
    let weights = acc
        .get_state_dict(&model)
        .into_iter()
        .map(|(_, t)| t.to_device(Device::Cpu))
        .collect();
    (losses, weights, state, held_on_gpu)
}

/// `cpu-offload` on a GPU: the shards and the optimizer state live in host
/// memory, the GPU holds (under FULL_SHARD) no whole parameter between
/// steps, and training gives what it gives without offloading, to the
/// rounding of the optimizer on the CPU instead of the GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cpu_offload_keeps_shards_and_optimizer_state_in_host_memory() {
    use hearth::parallel::ShardingStrategy;
    let (want_losses, want, state, on_gpu) = train_offloaded(None, MixedPrecision::No);
    assert!(
        state.iter().all(|d| *d == cuda()),
        "plain: state on the GPU"
    );
    assert!(on_gpu > 0);
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
        let (losses, got, state, on_gpu) = train_offloaded(Some(strategy), MixedPrecision::No);
        assert!(
            !state.is_empty() && state.iter().all(|d| *d == Device::Cpu),
            "{strategy:?}: optimizer state in host memory: {state:?}"
        );
        if strategy == ShardingStrategy::FullShard {
            assert_eq!(
                on_gpu, 0,
                "FULL_SHARD holds no whole parameter between steps"
            );
        }
        for (a, b) in losses.iter().zip(&want_losses) {
            assert!(
                (a - b).abs() < 1e-4,
                "{strategy:?}: losses {losses:?} vs {want_losses:?}"
            );
        }
        for (g, w) in got.iter().zip(&want) {
            let worst = f64::try_from((g - w).abs().max()).unwrap();
            assert!(worst < 1e-5, "{strategy:?}: weights differ by {worst:e}");
        }
    }
    // fp16: the loss scale stays on the GPU with the loss, the gradients
    // it unscales are in host memory; the same steps as without offload.
    let (want_losses, ..) = train_offloaded(None, MixedPrecision::Fp16);
    let (losses, ..) = train_offloaded(Some(ShardingStrategy::FullShard), MixedPrecision::Fp16);
    for (a, b) in losses.iter().zip(&want_losses) {
        assert!(
            (a - b).abs() < 1e-3,
            "fp16: losses {losses:?} vs {want_losses:?}"
        );
    }
}

/// A GPT mapped over GPU 0, the CPU and the disk (Accelerate's
/// `dispatch_model` with a GPU main device: CPU and disk modules are
/// offloaded and run on GPU 0) gives the CPU model's logits, and between
/// runs GPU 0 holds only the modules mapped to it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_dispatched_gpt_runs_its_offloaded_modules_on_gpu_0() {
    use hearth::big_model::{
        dispatch_model, load_checkpoint_in_model, DeviceMap, DispatchOptions, LoadOptions,
        MapDevice,
    };
    let device = cuda();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    tch::manual_seed(5);
    let original = Gpt::new(SMALL_GPT, Device::Cpu);
    hearth::checkpoint::save_model(&ckpt, &original.named_parameters(), 1 << 30).unwrap();
    let x = Tensor::randint(SMALL_GPT.vocab_size, [2, 8], (Kind::Int64, Device::Cpu));
    let plain = tch::no_grad(|| original.forward_t(&x, false));
    let map: DeviceMap = [
        ("tok", MapDevice::Gpu(0)),
        ("pos", MapDevice::Cpu),
        ("blocks.0", MapDevice::Gpu(0)),
        ("blocks.1", MapDevice::Disk),
        ("ln", MapDevice::Cpu),
        ("head", MapDevice::Gpu(0)),
    ]
    .into_iter()
    .map(|(k, d)| (k.to_string(), d))
    .collect();
    let model = Gpt::unmaterialised(SMALL_GPT, Device::Cpu);
    let options = LoadOptions {
        device_map: Some(map.clone()),
        offload_folder: Some(dir.path().join("offload")),
        ..Default::default()
    };
    load_checkpoint_in_model(&model, &ckpt, &options).unwrap();
    let dispatched = dispatch_model(
        Box::new(model),
        &map,
        &DispatchOptions {
            offload_dir: Some(dir.path().join("offload")),
            ..Default::default()
        },
    )
    .unwrap();
    let logits = dispatched.forward(&x).unwrap();
    assert_eq!(
        logits.device(),
        Device::Cpu,
        "the output comes back to the input's device"
    );
    assert!(logits.allclose(&plain, 1e-4, 1e-4, false));
    for (name, t) in dispatched.model().named_parameters() {
        let on_gpu = ["tok.", "blocks.0.", "head."]
            .iter()
            .any(|p| name.starts_with(p));
        assert_eq!(t.numel() > 0, on_gpu, "{name}");
        if on_gpu {
            assert_eq!(t.device(), device, "{name}");
        }
    }
}

/// `to_pinned_host` gives page-locked memory holding the values, from a
/// GPU and from the host. (It once asked `Tensor::to` for pinned memory,
/// which aten grants only to non-blocking copies: the offload shards, their
/// gradients and the async save's buffers were pageable, copied at 1.3-7
/// GB/s where pinned memory copies at ~50.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn to_pinned_host_gives_page_locked_memory() {
    let device = cuda();
    let host = Tensor::randn([1000, 37], (Kind::Float, Device::Cpu));
    for (from, t) in [
        ("GPU", host.to_device(device)),
        ("host", host.shallow_clone()),
    ] {
        let pinned = hearth::ops::to_pinned_host(&t).unwrap();
        assert_eq!(pinned.device(), Device::Cpu, "from the {from}");
        assert!(pinned.is_pinned(device), "from the {from}: pageable memory");
        assert!(pinned.equal(&host), "from the {from}: other values");
    }
    // A strided view comes out whole and contiguous.
    let view = host.to_device(device).transpose(0, 1);
    let pinned = hearth::ops::to_pinned_host(&view).unwrap();
    assert!(pinned.is_pinned(device) && pinned.equal(&host.transpose(0, 1)));
}

/// An asynchronous save stages a GPU's tensors in pinned host memory; from
/// the second save on the copies are queued without waiting, and training
/// goes on at once. Steps queued right behind the copies change the
/// weights in place, yet the checkpoint holds the weights of its moment.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_async_save_on_cuda_holds_the_weights_of_its_moment() {
    use hearth::accelerator::ProjectConfiguration;
    use tch::nn::{self, Module};
    let device = cuda();
    let dir = hearth_testkit::scratch("cuda-async");
    let mut acc = Accelerator::builder()
        .project_config(ProjectConfiguration {
            project_dir: dir.to_path_buf(),
            automatic_checkpoint_naming: true,
            async_save: true,
            ..Default::default()
        })
        .build()
        .unwrap();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    // 64 MiB of weights and twice that of Adam's state: copies that take
    // long enough for a missing wait to show.
    let big = nn::linear(vs.root() / "big", 4096, 4096, Default::default());
    let opt = Adam::new(vs.trainable_variables(), AdamHyper::adamw(1e-3));
    let (vs, mut opt) = acc.prepare((vs, opt)).unwrap();
    let x = Tensor::randn([64, 4096], (Kind::Float, device));
    let mut step = |acc: &mut Accelerator| {
        let loss = big.forward(&x).square().mean(Kind::Float);
        acc.backward(&loss).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    };
    let weights = |vs: &nn::VarStore| {
        hearth::models::sorted_variables(vs)
            .into_iter()
            .map(|(n, t)| (n, t.to_device(Device::Cpu)))
            .collect::<Vec<_>>()
    };
    step(&mut acc);
    let first = acc.save_state(None).unwrap();
    acc.wait_for_checkpoint().unwrap();
    step(&mut acc);
    let at_save = weights(&vs);
    let second = acc.save_state(None).unwrap();
    for _ in 0..20 {
        step(&mut acc);
    }
    acc.wait_for_checkpoint().unwrap();
    let saved = |dir: &std::path::Path| {
        let mut named = Tensor::read_safetensors(dir.join("model.safetensors")).unwrap();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    };
    let (first, second) = (saved(&first), saved(&second));
    assert_eq!(second.len(), at_save.len());
    for ((name, saved), (expected_name, expected)) in second.iter().zip(&at_save) {
        assert_eq!(name, expected_name);
        assert!(
            saved.equal(expected),
            "{name}: the checkpoint holds other weights than at its save"
        );
    }
    assert!(
        !first[1].1.equal(&second[1].1),
        "the two saves hold different weights"
    );
    assert!(
        !at_save[1].1.equal(&weights(&vs)[1].1),
        "training went on changing them"
    );
}
