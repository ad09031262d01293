//! Sharded data parallel (FSDP's SHARD_GRAD_OP and FULL_SHARD, activation
//! checkpointing) across real processes: this binary starts itself under
//! `mpirun`; each rank trains the bench GPT
//! (`shared/bench/peer_gpt_accelerate.py`'s sizes) with the accelerator
//! sharded by Block, and the parent checks that the weights equal those
//! of one process trained with the global batch, as DDP's do, and that
//! each process held about 1/N of the gradients and optimizer state (and,
//! FULL_SHARD, of the parameters).

use common::{mpirun_ok, results, scratch, CHILD, OUT};
use hearth_testkit as common;
/// A rank lost mid-step under FULL_SHARD: errors, not panics.
mod lost_rank;
mod refusals;
mod shard_grad_op;

use hearth::accelerator::Accelerator;
use hearth::data::DataLoader;
use hearth::models::{Gpt, GptConfig, Model};
use hearth::ops::AdamHyper;
use hearth::optim::Adam;
use hearth::parallel::{FsdpPlugin, ShardingStrategy};
use hearth::precision::MixedPrecision;
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// Optimizer steps of every run.
const STEPS: usize = 20;
/// Tokens per example (the bench GPT has 128 positions; 16 keep it quick).
const T: i64 = 16;

fn bench_gpt() -> GptConfig {
    GptConfig {
        vocab_size: 256,
        block_size: 128,
        d_model: 128,
        layers: 4,
        heads: 4,
    }
}

/// `examples` random token rows of T + 1, the same in every process.
fn pool(examples: usize) -> Vec<(Tensor, Tensor)> {
    tch::manual_seed(7);
    let tokens = Tensor::randint(256, [examples as i64, T + 1], (Kind::Int64, Device::Cpu));
    (0..examples as i64)
        .map(|i| {
            let row = tokens.get(i);
            (row.narrow(0, 0, T), row.narrow(0, 1, T))
        })
        .collect()
}

/// How a run is sharded and trained.
#[derive(Clone, Copy)]
struct Setup {
    strategy: Option<ShardingStrategy>,
    batch: usize,
    accumulation: usize,
    precision: MixedPrecision,
    /// Clip the gradients' norm of this type (2.0: L2, 1.0, infinity) at
    /// every step, to [`clip_max`] of it.
    clip: Option<f64>,
    /// Train a custom `VarStore` network with declared classes instead of
    /// the GPT.
    custom: bool,
    /// FSDP's activation checkpointing.
    checkpointing: bool,
}

impl Setup {
    fn parse(mode: &str) -> Self {
        let parts: Vec<&str> = mode.split(':').collect();
        Self {
            strategy: match parts[1] {
                "none" => None,
                s => Some(s.parse::<ShardingStrategy>().unwrap()),
            },
            batch: parts[2].parse().unwrap(),
            accumulation: parts[3].parse().unwrap(),
            precision: parts[4].parse().unwrap(),
            clip: parts[5]
                .strip_prefix("clip-")
                .map(|p| p.parse().expect("a norm type")),
            custom: parts[6] == "custom",
            checkpointing: parts[7] == "checkpointing",
        }
    }

    fn mode(&self) -> String {
        format!(
            "fsdp:{}:{}:{}:{}:{}:{}:{}",
            self.strategy.map_or("none", |s| s.as_str()),
            self.batch,
            self.accumulation,
            self.precision,
            self.clip
                .map_or("no-clip".to_string(), |p| format!("clip-{p}")),
            if self.custom { "custom" } else { "gpt" },
            if self.checkpointing {
                "checkpointing"
            } else {
                "no-checkpointing"
            }
        )
    }
}

/// Trains the bench GPT in `acc`'s world, each process from its own random
/// weights (`sync-module-states` makes them rank 0's); returns the weights
/// and, given a folder, saves the model there with `save_model`.
fn train(
    acc: &mut Accelerator,
    setup: Setup,
    seed: i64,
    save_to: Option<&Path>,
) -> HashMap<String, Tensor> {
    if setup.custom {
        return train_custom(acc, setup, seed);
    }
    tch::manual_seed(seed);
    let model = Gpt::new(bench_gpt(), Device::Cpu);
    let examples = STEPS * acc.num_processes() * setup.batch * setup.accumulation;
    let model = acc.prepare(model).unwrap();
    let params: Vec<Tensor> = model
        .named_parameters()
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    // eps 1e-6 instead of 1e-8: the attention's key biases get gradients
    // that are zero but for rounding (softmax ignores a constant added to
    // every key), and with eps 1e-8 AdamW turns that rounding into steps of
    // about lr, so any two runs that round differently (one process and
    // DDP included) part by ~1e-3 there. With 1e-6 those steps vanish and
    // every weight is compared at 2e-5.
    let hyper = AdamHyper {
        eps: 1e-6,
        ..AdamHyper::adamw(1e-3)
    };
    let opt = Adam::new(params, hyper);
    let (mut opt, loader) = acc
        .prepare((opt, DataLoader::new(pool(examples), setup.batch)))
        .unwrap();
    for (x, y) in loader.iter() {
        acc.accumulate(|| {
            let logits = model.forward_t(&x, true);
            let loss = logits
                .view([-1, 256])
                .cross_entropy_for_logits(&y.view([-1]));
            acc.backward(&loss).unwrap();
            if let Some(p) = setup.clip {
                acc.clip_grad_norm_(&mut opt, clip_max(p), p).unwrap();
            }
            opt.step().unwrap();
            opt.zero_grad();
        });
    }
    if let Some(dir) = save_to {
        acc.save_model(&model, dir, u64::MAX).unwrap();
    }
    acc.get_state_dict(&model).into_iter().collect()
}

/// The norm [`Setup::clip`] clips to: 1 for a sum (L1, L2), 0.01 for the
/// largest gradient, so that every step clips.
fn clip_max(norm_type: f64) -> f64 {
    if norm_type.is_infinite() {
        0.01
    } else {
        1.0
    }
}

/// A custom network (`VarStore` layers of class `Layer`, declared) trained
/// like [`train`] on regression data; sharded one layer per unit.
fn train_custom(acc: &mut Accelerator, setup: Setup, seed: i64) -> HashMap<String, Tensor> {
    use hearth::models::VarStoreModel;
    use tch::nn::{self, Module};
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let (l0, l1, l2) = (
        nn::linear(vs.root() / "layers" / 0, 6, 16, Default::default()),
        nn::linear(vs.root() / "layers" / 1, 16, 16, Default::default()),
        nn::linear(vs.root() / "layers" / 2, 16, 1, Default::default()),
    );
    // A layer the forward pass never uses: no process has a gradient for
    // it, so AdamW must leave it alone (no weight decay), as with DDP.
    let _unused = nn::linear(vs.root() / "layers" / 3, 5, 5, Default::default());
    let model = VarStoreModel::new(vs)
        .class("", "Net")
        .class("layers", "ModuleList")
        .class("layers.0", "Layer")
        .class("layers.1", "Layer")
        .class("layers.2", "Layer")
        .class("layers.3", "Layer");
    let vs = acc.prepare(model).unwrap();
    let examples = STEPS * acc.num_processes() * setup.batch * setup.accumulation;
    tch::manual_seed(123);
    let xs = Tensor::randn([examples as i64, 6], (Kind::Float, Device::Cpu));
    let ys = (xs.sum_dim_intlist(1, true, Kind::Float) * 0.5).sin();
    let data: Vec<(Tensor, Tensor)> = (0..examples as i64)
        .map(|i| (xs.get(i), ys.get(i)))
        .collect();
    let opt = Adam::new(vs.trainable_variables(), AdamHyper::adamw(1e-2));
    let (mut opt, loader) = acc
        .prepare((opt, DataLoader::new(data, setup.batch)))
        .unwrap();
    for (x, y) in loader.iter() {
        acc.accumulate(|| {
            let h = l1.forward(&l0.forward(&x).tanh()).tanh();
            let loss = l2.forward(&h).mse_loss(&y, tch::Reduction::Mean);
            acc.backward(&loss).unwrap();
            let p = setup.clip.unwrap_or(2.0);
            acc.clip_grad_norm_(&mut opt, clip_max(p), p).unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        });
    }
    vs.variables()
        .into_iter()
        .map(|(n, t)| (n, t.detach().copy()))
        .collect()
}

/// The accelerator of `setup`, whose collectives time out after `timeout`.
fn accelerator(setup: Setup, timeout: Duration) -> Accelerator {
    let mut builder = Accelerator::builder()
        .cpu(true)
        .mixed_precision(setup.precision)
        // fp16 on the CPU trains in float32 (as Accelerate's); with loss
        // scaling on, the scaler's overflow check runs over the shards.
        .cpu_loss_scaling(setup.precision == MixedPrecision::Fp16)
        .gradient_accumulation_steps(setup.accumulation)
        .timeout(timeout);
    if let Some(strategy) = setup.strategy {
        let class = if setup.custom { "Layer" } else { "Block" };
        builder = builder.fsdp(FsdpPlugin {
            sharding_strategy: Some(strategy),
            auto_wrap_policy: Some("transformer-based".into()),
            transformer_cls_names_to_wrap: Some(vec![class.into()]),
            sync_module_states: Some(true),
            activation_checkpointing: Some(setup.checkpointing),
            ..Default::default()
        });
    }
    builder
        .plugin_path(hearth::plugins::SearchPath::only([(
            hearth::plugins::PluginSource::BuiltIn,
            common::repo_root().join("target/plugins"),
        )]))
        .build()
        .unwrap()
}

/// One rank of a run; the mode is `fsdp:<strategy|none>:<b>:<ga>:<precision>`.
#[test]
fn child_fsdp() {
    let Some(mode) = std::env::var(CHILD).ok().filter(|m| m.starts_with("fsdp:")) else {
        return; // only under mpirun
    };
    let setup = Setup::parse(&mode);
    if setup.strategy.is_some_and(ShardingStrategy::hybrid) {
        // Two pretend machines of two processes each.
        let rank: usize = std::env::var("OMPI_COMM_WORLD_RANK")
            .unwrap()
            .parse()
            .unwrap();
        std::env::set_var("HEARTH_NODE_NAME", format!("machine-{}", rank / 2));
    }
    let mut acc = accelerator(setup, Duration::from_secs(120));
    let r = acc.process_index();
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    let weights = train(&mut acc, setup, 1000 + r as i64, Some(&out));
    let named: Vec<(String, Tensor)> = weights.into_iter().collect();
    hearth::checkpoint::save_safetensors(&out.join(format!("rank_{r}.safetensors")), &named)
        .unwrap();
    let stats = acc.gradient_sync_stats();
    let memory = acc.memory_stats();
    let result = serde_json::json!({
        "syncs": stats.syncs, "reduce_scatters": stats.reduce_scatters,
        "gathers": stats.gathers, "recomputed": stats.recomputed,
        "most_gathered": stats.most_gathered,
        "all_reduces": stats.all_reduces, "overlapped": stats.overlapped,
        "memory": memory, "largest_unit_bytes": largest_unit_bytes(),
    });
    std::fs::write(out.join(format!("rank_{r}.json")), result.to_string()).unwrap();
}

/// Bytes of the bench GPT's largest unit (a Block) when sharded by Block.
fn largest_unit_bytes() -> u64 {
    let _one_at_a_time = SEEDED.lock().unwrap_or_else(|p| p.into_inner());
    let model = Gpt::new(bench_gpt(), Device::Cpu);
    model
        .named_parameters()
        .iter()
        .filter(|(n, _)| n.starts_with("blocks.0."))
        .map(|(_, t)| (t.numel() * 4) as u64)
        .sum()
}

/// The weights of one process trained with the global batch.
fn reference(setup: Setup, processes: usize) -> HashMap<String, Tensor> {
    let single = Setup {
        strategy: None,
        batch: setup.batch * setup.accumulation * processes,
        accumulation: 1,
        ..setup
    };
    let mut acc = Accelerator::builder()
        .cpu(true)
        .mixed_precision(setup.precision)
        .cpu_loss_scaling(setup.precision == MixedPrecision::Fp16)
        .process_group(Box::new(hearth::comm::SingleProcess))
        .build()
        .unwrap();
    let _one_at_a_time = SEEDED.lock().unwrap_or_else(|p| p.into_inner());
    // Rank 0's seed: the weights every rank starts from.
    train(&mut acc, single, 1000, None)
}

/// The in-process reference runs one at a time: tch's seed is global to
/// the process, and the tests run on threads of one.
static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn read(path: &Path) -> HashMap<String, Tensor> {
    hearth::checkpoint::load_safetensors(path, Device::Cpu)
        .unwrap()
        .into_iter()
        .collect()
}

fn worst_difference(got: &HashMap<String, Tensor>, want: &HashMap<String, Tensor>) -> f64 {
    assert_eq!(got.len(), want.len());
    want.iter()
        .map(|(name, w)| {
            let g = &got[name];
            let d = (g - w).abs().max().double_value(&[]);
            if d > TOLERANCE {
                eprintln!("{name} differs by {d:e}");
            }
            d
        })
        .fold(0.0, f64::max)
}

/// Runs `setup` on `n` ranks; returns each rank's weights and report.
fn run(
    n: usize,
    setup: Setup,
) -> (
    Vec<HashMap<String, Tensor>>,
    Vec<serde_json::Value>,
    common::Scratch,
) {
    let dir = scratch(&format!("fsdp{n}"));
    mpirun_ok(
        n,
        &hearth_testkit::child!("child_fsdp"),
        &setup.mode(),
        &dir,
    );
    let weights = (0..n)
        .map(|r| read(&dir.join(format!("rank_{r}.safetensors"))))
        .collect();
    (weights, results(&dir, n), dir)
}

/// DDP's tolerance against one process with the global batch (as in
/// `mpi/ddp.rs`), met by sharding against both.
const TOLERANCE: f64 = 2e-5;

/// `strategy` on `n` ranks against DDP on `n` ranks and one process with
/// the global batch; returns the DDP and the sharded reports.
fn sharding_matches_ddp_and_one_process(
    strategy: ShardingStrategy,
    checkpointing: bool,
    n: usize,
    batch: usize,
    accumulation: usize,
    precision: MixedPrecision,
) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let ddp = Setup {
        strategy: None,
        batch,
        accumulation,
        precision,
        custom: false,
        // Clipping's norm sums the squares in another order when sharded;
        // in bf16 an ulp of difference in its coefficient flips the bf16
        // rounding of weights in the next forward pass, and from there the
        // runs part at bf16's precision. Without it, the bf16 runs are
        // compared at float32's tolerance.
        clip: (precision != MixedPrecision::Bf16).then_some(2.0),
        checkpointing: false,
    };
    let sharded = Setup {
        strategy: Some(strategy),
        checkpointing,
        ..ddp
    };
    let want = reference(ddp, n);
    let (ddp_ranks, ddp_reports, _a) = run(n, ddp);
    let (ranks, reports, dir) = run(n, sharded);
    let tolerance = match precision {
        MixedPrecision::No | MixedPrecision::Fp16 => TOLERANCE,
        // bf16 matmuls of one batch of N·b round otherwise than N of b.
        _ => 5e-2,
    };
    let ddp_distance = worst_difference(&ddp_ranks[0], &want);
    assert!(
        ddp_distance <= tolerance,
        "DDP on {n}: {ddp_distance:e} from one process"
    );
    for (r, got) in ranks.iter().enumerate() {
        let to_ddp = worst_difference(got, &ddp_ranks[r]);
        assert!(
            to_ddp <= TOLERANCE,
            "rank {r} of {n}: {to_ddp:e} from DDP's weights"
        );
        let to_one = worst_difference(got, &want);
        assert!(
            to_one <= tolerance,
            "rank {r} of {n}: {to_one:e} from one process's"
        );
    }
    // SHARD_GRAD_OP syncs once per optimizer step; FULL_SHARD
    // reduce-scatters each unit as backward finishes it, on every
    // micro-batch (the gradient shards add up).
    let full_shard = strategy.shards_parameters();
    let syncs = match full_shard {
        true => STEPS * accumulation,
        false => STEPS,
    };
    let micro_steps = STEPS * accumulation;
    for report in &reports {
        assert_eq!(report["syncs"], syncs, "{report}");
        // With activation checkpointing each backward recomputes the six
        // units (embedding, four blocks, head); FULL_SHARD alone keeps each
        // unit's graph from forward, its parameters' memory freed between.
        let recomputed = if checkpointing { 6 * micro_steps } else { 0 };
        assert_eq!(report["recomputed"], recomputed, "{report}");
        // FULL_SHARD gathers the root (embedding and head) and the four
        // blocks in forward, and the blocks again in backward (the root
        // stays gathered from the head's forward to the embedding's
        // backward). Preparing the optimizer, `save_model` and
        // `get_state_dict` gather the five units once each.
        let gathers = if full_shard {
            9 * micro_steps + 3 * 5
        } else {
            0
        };
        assert_eq!(report["gathers"], gathers, "{report}");
        // At most the root and one block whole at once, in training and
        // in `save_model` and `get_state_dict`, which gather unit by unit.
        let most = if full_shard { 2 } else { 0 };
        assert_eq!(report["most_gathered"], most, "{report}");
        if strategy == ShardingStrategy::NoShard {
            assert_eq!(report["reduce_scatters"], 0, "{report}");
            continue;
        }
        // Five units (the four blocks and the root) per sync, none all-reduced.
        assert_eq!(report["reduce_scatters"], 5 * syncs, "{report}");
        assert_eq!(report["all_reduces"], 0, "{report}");
    }
    // The saved model.safetensors: the whole weights, as a DDP run writes.
    let saved = read(&dir.join("model.safetensors"));
    assert_eq!(worst_difference(&saved, &ranks[0]), 0.0);
    (ddp_reports, reports)
}

/// Under FULL_SHARD each of `n` processes holds, between steps, its
/// shards of the parameters, gradients and optimizer state: at most 1/n
/// of what one DDP process holds, plus one unit's whole parameters
/// (FSDP's padding, bounded by one row a parameter, stays below that).
fn assert_full_shard_memory(n: usize, ddp: &[serde_json::Value], sharded: &[serde_json::Value]) {
    assert_eq!(ddp.len(), sharded.len());
    let total = |m: &serde_json::Value| {
        ["param_bytes", "grad_bytes", "optimizer_bytes"]
            .iter()
            .map(|k| m[k].as_u64().unwrap())
            .sum::<u64>()
    };
    for r in 0..ddp.len() {
        let (whole, shard) = (total(&ddp[r]["memory"]), total(&sharded[r]["memory"]));
        let unit = sharded[r]["largest_unit_bytes"].as_u64().unwrap();
        assert!(
            shard <= whole / n as u64 + unit,
            "rank {r} of {n}: {shard} bytes held, DDP {whole}, one unit {unit}"
        );
        let params = sharded[r]["memory"]["param_bytes"].as_u64().unwrap();
        let ddp_params = ddp[r]["memory"]["param_bytes"].as_u64().unwrap();
        assert!(
            params <= ddp_params / n as u64 + unit / 8,
            "rank {r}: parameters {params} of {ddp_params}: more than its shards"
        );
    }
}

#[test]
fn full_shard_on_two_ranks_trains_what_ddp_and_one_process_do_holding_half() {
    let (ddp, sharded) = sharding_matches_ddp_and_one_process(
        ShardingStrategy::FullShard,
        false,
        2,
        2,
        1,
        MixedPrecision::No,
    );
    assert_full_shard_memory(2, &ddp, &sharded);
}

#[test]
fn full_shard_with_activation_checkpointing_on_four_ranks_with_accumulation_trains_what_ddp_does() {
    let (ddp, sharded) = sharding_matches_ddp_and_one_process(
        ShardingStrategy::FullShard,
        true,
        4,
        1,
        2,
        MixedPrecision::No,
    );
    assert_full_shard_memory(4, &ddp, &sharded);
}

/// Under HYBRID each of the 4 processes holds a half of the optimizer
/// state: its machine's 2 processes share the shards (not all 4), and the
/// other machine holds the same halves.
fn assert_halves_on_each_machine(ddp: &[serde_json::Value], sharded: &[serde_json::Value]) {
    for (r, (d, s)) in ddp.iter().zip(sharded).enumerate() {
        let state = |m: &serde_json::Value| m["memory"]["optimizer_bytes"].as_f64().unwrap();
        let ratio = state(s) / state(d);
        assert!(
            (ratio - 0.5).abs() < 0.01,
            "rank {r}: {ratio} of DDP's optimizer state"
        );
    }
}

#[test]
fn hybrid_shard_on_two_pretend_machines_trains_what_ddp_and_one_process_do() {
    let (ddp, sharded) = sharding_matches_ddp_and_one_process(
        ShardingStrategy::HybridShard,
        false,
        4,
        1,
        2,
        MixedPrecision::No,
    );
    assert_halves_on_each_machine(&ddp, &sharded);
    assert_full_shard_memory(2, &ddp, &sharded);
}

#[test]
fn hybrid_shard_zero2_on_two_pretend_machines_trains_what_ddp_and_one_process_do() {
    let (ddp, sharded) = sharding_matches_ddp_and_one_process(
        ShardingStrategy::HybridShardZero2,
        false,
        4,
        1,
        1,
        MixedPrecision::No,
    );
    assert_halves_on_each_machine(&ddp, &sharded);
}

#[test]
fn activation_checkpointing_without_sharding_trains_what_ddp_does() {
    // The recomputed units' gradients reach DDP's bucket hooks as one
    // backward pass's would.
    sharding_matches_ddp_and_one_process(
        ShardingStrategy::NoShard,
        true,
        2,
        2,
        1,
        MixedPrecision::No,
    );
}

/// Clipping by the L1 norm and by the largest gradient when each process
/// holds shards of the gradients: the shards' norms are combined across
/// the processes (p-th powers summed; the largest taken) as one process
/// computes them over whole gradients.
#[test]
fn sharded_clipping_by_l1_and_infinity_norms_trains_what_one_process_does() {
    for (strategy, norm_type) in [
        (ShardingStrategy::ShardGradOp, f64::INFINITY),
        (ShardingStrategy::FullShard, 1.0),
    ] {
        let sharded = Setup {
            strategy: Some(strategy),
            batch: 3,
            accumulation: 1,
            precision: MixedPrecision::No,
            clip: Some(norm_type),
            // FULL_SHARD runs a hearth Model unit by unit: the GPT.
            custom: strategy == ShardingStrategy::ShardGradOp,
            checkpointing: false,
        };
        let want = reference(sharded, 2);
        let (ranks, _reports, _dir) = run(2, sharded);
        for (r, got) in ranks.iter().enumerate() {
            let worst = worst_difference(got, &want);
            assert!(
                worst <= TOLERANCE,
                "{strategy:?}, norm {norm_type}, rank {r}: {worst:e} from one process's weights"
            );
        }
    }
}
