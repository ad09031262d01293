//! The GPU paths: fp16 with loss scaling, bf16 autocast, CUDA generator
//! state, NCCL, offloading, CUDA graphs. They need a CUDA device, so they
//! are ignored by default (all but the check that the CUDA graph library
//! loads); on a GPU machine run `cargo test --release -p hearth --test cuda
//! -- --include-ignored` (tests/gpu/checklist.sh does).

use hearth::accelerator::{Accelerator, LrSchedule};
use hearth::models::{Gpt, GptConfig, Model};
use hearth::ops::{AdamHyper, SgdHyper};
use hearth::optim::{Adam, Sgd};
use hearth::plugins::PluginError;
use hearth::precision::MixedPrecision;
use tch::{Device, Kind, Tensor};

/// The GPT the training tests use: 16 tokens, 8 positions, d=64, 2 layers.
const SMALL_GPT: GptConfig = GptConfig {
    vocab_size: 16,
    block_size: 8,
    d_model: 64,
    layers: 2,
    heads: 4,
};

fn cuda() -> Device {
    assert!(
        hearth::ops::cuda::is_available(),
        "this test needs a CUDA GPU"
    );
    Device::Cuda(0)
}

struct Constant;
impl LrSchedule for Constant {
    fn lrs(&mut self, _: u64) -> Result<Vec<f64>, PluginError> {
        Ok(vec![0.1])
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp16_on_cuda_scales_skips_and_backs_off() {
    let device = cuda();
    let mut acc = Accelerator::builder()
        .mixed_precision(MixedPrecision::Fp16)
        .build()
        .unwrap();
    assert_eq!(acc.device(), device);
    let p = Tensor::ones([4], (Kind::Float, device)).set_requires_grad(true);
    let opt = Sgd::new(
        vec![p.shallow_clone()],
        SgdHyper {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        },
    );
    let schedule: Box<dyn LrSchedule> = Box::new(Constant);
    let (mut opt, mut sched) = acc.prepare((opt, schedule)).unwrap();
    let mut step = |factor: f64| {
        let y = {
            let _autocast = acc.autocast().expect("fp16 autocasts on CUDA");
            let w = Tensor::ones([4, 4], (Kind::Float, device));
            let y = p.unsqueeze(0).matmul(&w);
            assert_eq!(y.kind(), Kind::Half, "matmul runs in fp16 under autocast");
            y
        };
        acc.backward(&(y.to_kind(Kind::Float).sum(Kind::Float) * factor))
            .unwrap();
        let norm =
            f64::try_from(acc.clip_grad_norm_(&mut opt, 1e9, 2.0).unwrap().unwrap()).unwrap();
        opt.step().unwrap();
        sched.step().unwrap();
        opt.zero_grad();
        (opt.step_was_skipped(), acc.loss_scale().unwrap(), norm)
    };
    // The loss is scaled by 8 below 1 so that its scaled gradients fit in
    // fp16: at the initial scale 2^16 a gradient of 1 is 65536, past fp16's
    // largest finite 65504, and PyTorch's GradScaler skips that step too.
    let (skipped, scale, norm) = step(0.125);
    assert!(!skipped);
    assert_eq!(scale, 65536.0);
    assert!((norm - 1.0).abs() < 1e-3, "unscaled gradient norm {norm}");
    let (skipped, scale, _) = step(f64::NAN);
    assert!(skipped && scale == 32768.0);
    let (skipped, _, _) = step(0.125);
    assert!(!skipped);
    // A gradient of 1 overflows at 2^15 too (×4 through the matmul):
    // skipped, and the scale halves again.
    let (skipped, scale, _) = step(1.0);
    assert!(skipped && scale == 16384.0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_gpt_trains_under_bf16_and_fp16_on_cuda() {
    let device = cuda();
    for mode in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
        tch::manual_seed(0);
        let mut acc = Accelerator::builder()
            .mixed_precision(mode)
            .gradient_accumulation_steps(2)
            .build()
            .unwrap();
        let config = SMALL_GPT;
        let model = Gpt::new(config, Device::Cpu);
        let opt = Adam::new(
            model
                .named_parameters()
                .into_iter()
                .map(|(_, t)| t)
                .collect::<Vec<_>>(),
            AdamHyper {
                weight_decay: 0.0,
                ..AdamHyper::adamw(3e-3)
            },
        );
        let (model, mut opt) = acc.prepare((model, opt)).unwrap();
        assert!(model
            .named_parameters()
            .iter()
            .all(|(_, t)| t.device() == device));
        let x = Tensor::randint(16, [8, 8], (Kind::Int64, device));
        let mut losses = Vec::new();
        for _ in 0..60 {
            let loss = acc.accumulate(|| {
                let logits = model.forward_t(&x, true);
                assert_eq!(logits.kind(), Kind::Float, "prepared outputs are fp32");
                let loss = logits
                    .view([-1, 16])
                    .cross_entropy_for_logits(&x.view([-1]));
                acc.backward(&loss).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
                f64::try_from(&loss).unwrap()
            });
            losses.push(loss);
        }
        assert!(
            losses[losses.len() - 1] < losses[0] * 0.5,
            "{mode}: loss {} → {}",
            losses[0],
            losses[losses.len() - 1]
        );
    }
}

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

/// The NCCL backend in a world of one GPU (one GPU cannot hold two NCCL
/// ranks): the communicator is created, every collective runs on the
/// group's stream after libtorch's, and its values come back.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_world_of_one_runs_every_collective() {
    use hearth::comm::{NcclGroup, NcclPlace, ProcessGroup, ReduceOp};
    let device = cuda();
    let place = NcclPlace {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        device: 0,
    };
    let group = NcclGroup::init(place, std::time::Duration::from_secs(60), |id| {
        Ok(id.expect("rank 0 makes the id"))
    })
    .unwrap();
    // Written by libtorch just before: the collective must see it.
    let x = Tensor::arange(6, (Kind::Float, device)).view([3, 2]) * 2.0;
    let mut sum = x.copy();
    group.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
    assert_eq!(
        Vec::<f32>::try_from(sum.view([-1]).to_device(Device::Cpu)).unwrap(),
        [0., 2., 4., 6., 8., 10.]
    );
    let mean = group
        .all_reduce_start(&x, ReduceOp::Mean)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(mean.device(), device);
    assert!(mean.equal(&x));
    let gathered = group.all_gather(&x).unwrap();
    assert_eq!(gathered.size(), [3, 2]);
    assert!(gathered.equal(&x));
    let scattered = group.reduce_scatter(&x, ReduceOp::Max).unwrap();
    assert!(scattered.equal(&x));
    let mut b = x.copy();
    group.broadcast(&mut b, 0).unwrap();
    assert!(b.equal(&x));
    // A CPU tensor goes through the GPU and comes back on the CPU.
    let cpu = group.all_gather(&Tensor::from_slice(&[7i64])).unwrap();
    assert_eq!(
        (cpu.device(), Vec::<i64>::try_from(&cpu).unwrap()),
        (Device::Cpu, vec![7])
    );
    assert_eq!(
        group.all_gather_bytes(b"hearth").unwrap(),
        vec![b"hearth".to_vec()]
    );
    assert_eq!(
        group.broadcast_bytes(b"rank 0".to_vec(), 0).unwrap(),
        b"rank 0"
    );
    group.barrier().unwrap();
    let e = group
        .all_reduce_start(&x.to_kind(Kind::Int64), ReduceOp::Mean)
        .err()
        .unwrap();
    assert!(e.to_string().contains("convert it to float32"), "{e}");
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

/// The CUDA graph library hearth embeds loads and has every function
/// hearth calls, also where there is no GPU (it then needs libtorch_cuda,
/// which hearth loads only with a driver, so this test loads it itself).
#[test]
fn the_embedded_cuda_graph_library_loads() {
    if !cfg!(feature = "cuda") {
        return;
    }
    let torch_lib = hearth::ops::cuda::libtorch_folder().expect("libtorch_cpu is mapped");
    let path =
        std::ffi::CString::new(torch_lib.join("libtorch_cuda.so").to_str().unwrap()).unwrap();
    // SAFETY: a valid path; the handle stays open for the test process.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(
        !handle.is_null(),
        "libtorch_cuda.so did not load from {}",
        torch_lib.display()
    );
    hearth::ops::cuda_graph::check_embedded_library().unwrap();
}

/// `run.cuda-graph`: the captured and replayed step trains as the eager
/// one (same data, same linear schedule read from the GPU between replays,
/// clipping inside the graph), in fp32 and under bf16 autocast; the graph
/// is captured after the warm-up steps and replayed on every later step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_training_step_trains_as_the_eager_one() {
    cuda();
    let dir = std::env::temp_dir().join(format!("hearth-cuda-graph-{}", std::process::id()));
    let steps = 40u64;
    for precision in ["no", "bf16"] {
        let mut weights = Vec::new();
        for graph in [false, true] {
            let text = format!(
                r#"[run]
name = "graph-{graph}"
steps = {steps}
log-every = 10
device = "cuda"
mixed-precision = "{precision}"
cuda-graph = {graph}

[model]
kind = "gpt"
d-model = 64
layers = 2
heads = 4

[data]
kind = "sort-digits"
digits = 6
batch-size = 32

[optimizer]
kind = "adamw"
lr = 3e-3
max-grad-norm = 0.5

[scheduler]
name = "linear"
warmup-steps = 5
"#
            );
            let path = dir.join(format!("{precision}-{graph}.toml"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
            let config = hearth::train::TrainConfig::from_toml(&text, &path).unwrap();
            let options = hearth::train::RunOptions {
                output_dir: Some(dir.join(precision)),
                quiet: true,
                ..Default::default()
            };
            let summary = hearth::train::run(&config, &options).unwrap();
            eprintln!(
                "{precision} cuda-graph={graph}: loss {:.4}, {:.0} tokens/s, {:?}",
                summary.final_loss, summary.tokens_per_sec, summary.cuda_graph
            );
            if graph {
                let stats = summary.cuda_graph.expect("a graphed run reports its graph");
                let warmup = hearth::train::CUDA_GRAPH_WARMUP_STEPS;
                assert_eq!(stats.warmup_steps, warmup);
                assert_eq!(stats.captured_at_step, Some(warmup + 1));
                assert_eq!(stats.replays, steps - warmup);
            } else {
                assert!(summary.cuda_graph.is_none());
            }
            // By name: a safetensors header is a map, read in no set order.
            let named: std::collections::BTreeMap<String, Tensor> =
                Tensor::read_safetensors(&summary.model_path)
                    .unwrap()
                    .into_iter()
                    .collect();
            weights.push(named);
        }
        let (eager, graphed) = (&weights[0], &weights[1]);
        assert_eq!(
            eager.keys().collect::<Vec<_>>(),
            graphed.keys().collect::<Vec<_>>()
        );
        for ((name, a), b) in eager.iter().zip(graphed.values()) {
            let diff = f64::try_from((a - b).abs().max()).unwrap();
            let scale = f64::try_from(a.abs().max()).unwrap();
            assert!(
                diff <= 1e-3 * scale.max(1.0),
                "{precision}: {name} differs by {diff} between the eager and the captured step"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Half-precision logits on a GPU (float16 by `_log_softmax` reading them
/// as they are, bfloat16 cast first; `lm_loss`) are scored as float32 ones:
/// the loss and the logits' gradient are those of casting them to float32
/// first, as autocast does, to within one rounding of the gradient to the
/// logits' precision.
#[test]
#[ignore = "needs a CUDA GPU"]
fn half_logits_are_scored_on_cuda_as_float32_ones() {
    let device = cuda();
    tch::manual_seed(3);
    for kind in [Kind::BFloat16, Kind::Half] {
        let logits = (Tensor::randn([4, 96, 1000], (Kind::Float, device)) * 4.0).to_kind(kind);
        let targets = Tensor::randint(1000, [4, 96], (Kind::Int64, device));
        let _ = targets.narrow(1, 0, 7).fill_(hearth::data::IGNORE_INDEX);
        let ours = logits.detach().set_requires_grad(true);
        let loss = hearth::train::lm_loss(&ours, &targets);
        loss.backward();
        let cast = logits.detach().set_requires_grad(true);
        let reference = cast
            .to_kind(Kind::Float)
            .view([-1, 1000])
            .cross_entropy_loss::<Tensor>(
                &targets.view([-1]),
                None,
                tch::Reduction::Mean,
                hearth::data::IGNORE_INDEX,
                0.0,
            );
        reference.backward();
        assert_eq!(loss.kind(), Kind::Float, "{kind:?}: a float32 loss");
        let (a, b) = (
            f64::try_from(&loss).unwrap(),
            f64::try_from(&reference).unwrap(),
        );
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{kind:?}: loss {a} vs {b}");
        let (ga, gb) = (ours.grad(), cast.grad());
        assert_eq!(ga.kind(), kind, "the gradient in the logits' precision");
        let diff = f64::try_from(
            (ga.to_kind(Kind::Float) - gb.to_kind(Kind::Float))
                .abs()
                .max(),
        )
        .unwrap();
        let scale = f64::try_from(gb.to_kind(Kind::Float).abs().max()).unwrap();
        assert!(
            diff <= scale / 128.0,
            "{kind:?}: gradients differ by {diff} (largest {scale})"
        );
    }
}

/// bfloat16 logits on a GPU are scored by hearth's own kernels, and their
/// loss and gradient are libtorch's — `cross_entropy` of the logits cast
/// to float32, the gradient cast back — to float32 rounding: the loss to
/// 1e-5, each gradient element to one bfloat16 step (the two float32
/// values may fall on either side of a rounding boundary) plus 1e-4 of the
/// largest gradient a row can have (the loss's gradient over the scored
/// rows): where a target's probability is near 1, `p - 1` cancels, and
/// both sides' float32 log-sum-exp (a few ulps of up to ~100 here) leaves
/// an error of that order in either. Shapes: GPT-2's
/// vocabulary (8 values per load), an odd one (one at a time), rows that
/// start off 16 bytes, peaked and flat rows, targets at both ends,
/// ignored rows, and a batch with every row ignored (NaN, as libtorch).
#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_cross_entropy_kernels_agree_with_libtorch() {
    let device = cuda();
    hearth::ops::cuda_loss::available(0).expect("the kernels compile and load on this GPU");
    tch::manual_seed(11);
    let ignore = hearth::data::IGNORE_INDEX;
    for (rows, vocab, spread, offset) in [
        (512, 50304, 4.0, 0),
        (300, 1001, 8.0, 0),
        (64, 4096, 30.0, 1),
        (33, 8, 1.0, 0),
    ] {
        let name = format!("{rows}x{vocab} (spread {spread}, offset {offset})");
        let backing = (Tensor::randn([rows * vocab + offset], (Kind::Float, device)) * spread)
            .to_kind(Kind::BFloat16);
        let logits = backing.narrow(0, offset, rows * vocab).view([rows, vocab]);
        let targets = Tensor::randint(vocab, [rows], (Kind::Int64, device));
        let _ = targets.narrow(0, 0, 5).fill_(ignore);
        let _ = targets.narrow(0, 5, 1).fill_(0);
        let _ = targets.narrow(0, 6, 1).fill_(vocab - 1);
        let ours = logits.detach().set_requires_grad(true);
        let loss = hearth::ops::cuda_loss::bf16_cross_entropy(&ours, &targets, ignore)
            .expect("the kernels take these logits");
        (&loss * 3.0).backward();
        let cast = logits.detach().set_requires_grad(true);
        let reference = cast.to_kind(Kind::Float).cross_entropy_loss::<Tensor>(
            &targets,
            None,
            tch::Reduction::Mean,
            ignore,
            0.0,
        );
        (&reference * 3.0).backward();
        assert_eq!(loss.kind(), Kind::Float, "{name}: a float32 loss");
        let (a, b) = (
            f64::try_from(&loss).unwrap(),
            f64::try_from(&reference).unwrap(),
        );
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{name}: loss {a} vs {b}");
        let (ga, gb) = (
            ours.grad().to_kind(Kind::Float),
            cast.grad().to_kind(Kind::Float),
        );
        assert_eq!(
            ours.grad().kind(),
            Kind::BFloat16,
            "{name}: a bf16 gradient"
        );
        let scored = i64::try_from(targets.ne(ignore).sum(Kind::Int64)).unwrap();
        let allowed = gb.abs() / 128.0 + 1e-4 * 3.0 / scored as f64;
        let over = i64::try_from((&ga - &gb).abs().gt_tensor(&allowed).sum(Kind::Int64)).unwrap();
        let worst = f64::try_from((&ga - &gb).abs().max()).unwrap();
        assert_eq!(
            over, 0,
            "{name}: {over} gradient elements off by more than a bf16 step (worst {worst})"
        );
        let ignored = f64::try_from(ours.grad().narrow(0, 0, 5).abs().sum(Kind::Float)).unwrap();
        assert_eq!(ignored, 0.0, "{name}: ignored rows get no gradient");
    }
    let logits = Tensor::randn([4, 64], (Kind::Float, device)).to_kind(Kind::BFloat16);
    let none = Tensor::full([4], ignore, (Kind::Int64, device));
    let loss = hearth::ops::cuda_loss::bf16_cross_entropy(&logits, &none, ignore).unwrap();
    assert!(
        f64::try_from(&loss).unwrap().is_nan(),
        "every row ignored: NaN, as libtorch"
    );
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
