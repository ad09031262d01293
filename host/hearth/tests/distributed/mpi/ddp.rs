//! DDP across real ranks against one process with the whole batch:
//! accumulation, `sync_each_batch`, gradient buckets as views, bf16
//! compression, rank 0's buffers before each forward pass, and a model
//! prepared for evaluation only.

use common::{mpirun_ok, results, scratch, write_result, CHILD};
use hearth_testkit as common;

use super::values;

use hearth::accelerator::Accelerator;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// The DDP runs: a small network trained with AdamW for 20 optimizer
/// steps of `n × b × ga` examples each, from one fixed pool.
const STEPS: usize = 20;

fn pool(examples: usize) -> Vec<(Tensor, Tensor)> {
    tch::manual_seed(123);
    let xs = Tensor::randn([examples as i64, 6], (Kind::Float, Device::Cpu));
    let ys = (xs.sum_dim_intlist(1, true, Kind::Float) * 0.5).sin();
    (0..examples as i64)
        .map(|i| (xs.get(i), ys.get(i)))
        .collect()
}

/// Named weights, sorted by name.
type Weights = Vec<(String, Vec<f64>)>;

/// Trains in this process's world with `b` examples per process and
/// micro-batch; each process starts from its own random weights (seeded
/// by `seed`), so the result shows rank 0's were broadcast. Returns the
/// weights, the losses, and after each synchronising backward pass how
/// many gradients start where another ends in memory (views of one
/// bucket do; gradients allocated one by one do not).
fn train_ddp(
    acc: &mut Accelerator,
    b: usize,
    ga: usize,
    seed: i64,
) -> (Weights, Vec<f64>, Vec<usize>) {
    use hearth::data::DataLoader;
    use hearth::ops::AdamHyper;
    use hearth::optim::Adam;
    use tch::nn::{self, Module};
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 6, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "l2", 16, 1, Default::default()));
    let examples = STEPS * acc.num_processes() * b * ga;
    let vs = acc.prepare(vs).unwrap();
    let hyper = AdamHyper {
        weight_decay: 0.01,
        ..AdamHyper::adamw(0.01)
    };
    let opt = Adam::new(vs.trainable_variables(), hyper);
    let (mut opt, loader) = acc
        .prepare((opt, DataLoader::new(pool(examples), b)))
        .unwrap();
    let mut losses = Vec::new();
    let mut adjacent = Vec::new();
    let grads = vs.trainable_variables();
    for (x, y) in loader.iter() {
        acc.accumulate(|| {
            let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
            acc.backward(&loss).unwrap();
            if acc.sync_gradients() {
                let mut spans: Vec<(usize, usize)> = (grads.iter())
                    .map(|p| p.grad())
                    .map(|g| (g.data_ptr() as usize, g.numel() * 4))
                    .collect();
                spans.sort();
                adjacent.push(
                    spans
                        .windows(2)
                        .filter(|w| w[0].0 + w[0].1 == w[1].0)
                        .count(),
                );
            }
            opt.step().unwrap();
            opt.zero_grad();
            losses.push(f64::try_from(&loss).unwrap());
        });
    }
    let mut weights: Vec<(String, Vec<f64>)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, values(&t)))
        .collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    (weights, losses, adjacent)
}

/// One rank of a DDP run; the mode is `ddp:<b>:<ga>:<comm hook>`, with
/// `:each` for the accumulation plugin's `sync_each_batch` or `:view` for
/// `gradient_as_bucket_view`.
#[test]
fn child_ddp() {
    let Some(mode) = std::env::var(CHILD).ok().filter(|m| m.starts_with("ddp:")) else {
        return; // only under mpirun
    };
    let parts: Vec<&str> = mode.split(':').collect();
    let (b, ga): (usize, usize) = (parts[1].parse().unwrap(), parts[2].parse().unwrap());
    let comm_hook = match parts[3] {
        "bf16" => hearth::parallel::CommHook::Bf16,
        "fp16" => hearth::parallel::CommHook::Fp16,
        _ => hearth::parallel::CommHook::No,
    };
    let mut acc = Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_plugin(hearth::accelerator::GradientAccumulationPlugin {
            num_steps: ga,
            sync_each_batch: parts.get(4) == Some(&"each"),
            ..Default::default()
        })
        .timeout(Duration::from_secs(60))
        .ddp(hearth::parallel::DdpOptions {
            // Small buckets, so the two layers' gradients take several.
            bucket_cap_mb: 0.0002,
            comm_hook,
            gradient_as_bucket_view: parts.get(4) == Some(&"view"),
            ..Default::default()
        })
        .build()
        .unwrap();
    let r = acc.process_index();
    let (weights, losses, adjacent) = train_ddp(&mut acc, b, ga, 1000 + r as i64);
    let stats = acc.gradient_sync_stats();
    let result = serde_json::json!({
        "weights": weights, "losses": losses,
        "syncs": stats.syncs, "all_reduces": stats.all_reduces, "bytes": stats.bytes,
        "overlapped": stats.overlapped, "adjacent": adjacent,
    });
    write_result(r, &result);
}

/// The weights of one process training alone with batch `batch`.
fn reference(batch: usize) -> Vec<(String, Vec<f64>)> {
    // It seeds and draws from libtorch's global generator: one test at a
    // time (the harness runs tests on several threads).
    static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = SEEDED.lock().unwrap_or_else(|p| p.into_inner());
    let mut acc = Accelerator::builder()
        .cpu(true)
        .process_group(Box::new(hearth::comm::SingleProcess))
        .build()
        .unwrap();
    assert_eq!(acc.distributed_type(), hearth::comm::DistributedType::No);
    // Rank 0's seed: the weights every rank starts from.
    train_ddp(&mut acc, batch, 1, 1000).0
}

fn assert_same_weights(got: &serde_json::Value, want: &[(String, Vec<f64>)], tol: f64, what: &str) {
    let got: Vec<(String, Vec<f64>)> = serde_json::from_value(got.clone()).unwrap();
    assert_eq!(got.len(), want.len());
    for ((name, g), (_, w)) in got.iter().zip(want) {
        let worst = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(worst <= tol, "{what}: {name} differs by {worst:e}");
    }
}

/// DDP's promise: N processes with batch b train the weights one process
/// with batch N·b does.
fn ddp_matches_one_process(n: usize, b: usize, ga: usize) -> Vec<serde_json::Value> {
    ddp_matches_one_process_as(n, b, ga, "no")
}

/// [`ddp_matches_one_process`] with `hook` (and options) in the child's mode.
fn ddp_matches_one_process_as(n: usize, b: usize, ga: usize, hook: &str) -> Vec<serde_json::Value> {
    let dir = scratch(&format!("ddp{n}-{ga}"));
    mpirun_ok(
        n,
        &hearth_testkit::child!("child_ddp"),
        &format!("ddp:{b}:{ga}:{hook}"),
        &dir,
    );
    let ranks = results(&dir, n);
    let want = reference(n * b * ga);
    for (r, got) in ranks.iter().enumerate() {
        assert_same_weights(
            &got["weights"],
            &want,
            2e-5,
            &format!("{n} ranks, rank {r}"),
        );
    }
    ranks
}

/// The network's 4 tensors in 0.0002 MiB (52 floats) buckets: at the
/// first sync in reverse name order, l2.weight, l2.bias (17) | l1.weight
/// (96) | l1.bias (16); then rebuilt in the order backward produced the
/// gradients, l2.bias, l2.weight, l1.bias (33) | l1.weight (96). The first
/// bucket starts while backward still computes l1.weight's gradient.
fn assert_buckets(got: &serde_json::Value) {
    assert_eq!(got["all_reduces"], 3 + 2 * (STEPS - 1), "{got}");
    assert_eq!(got["overlapped"], STEPS, "{got}");
}

#[test]
fn ddp_on_two_ranks_trains_what_one_process_with_twice_the_batch_does() {
    let ranks = ddp_matches_one_process(2, 4, 1);
    for got in &ranks {
        assert_eq!(got["syncs"], STEPS);
        assert_buckets(got);
    }
}

#[test]
fn ddp_on_four_ranks_trains_what_one_process_with_four_times_the_batch_does() {
    ddp_matches_one_process(4, 2, 1);
}

#[test]
fn with_accumulation_gradients_cross_processes_only_on_sync_steps() {
    let ranks = ddp_matches_one_process(2, 3, 2);
    for got in &ranks {
        assert_eq!(got["losses"].as_array().unwrap().len(), 2 * STEPS);
        assert_eq!(got["syncs"], STEPS, "one sync per 2 micro-batches");
        assert_buckets(got);
    }
}

#[test]
fn sync_each_batch_communicates_every_micro_batch_and_trains_the_same_weights() {
    // Accelerate's GradientAccumulationPlugin(sync_each_batch=True): no
    // no_sync, so each micro-batch's backward averages the gradients; the
    // optimizer still steps every 2, and the sum of averages is the
    // average of the sums.
    let ranks = ddp_matches_one_process_as(2, 3, 2, "no:each");
    for got in &ranks {
        assert_eq!(got["losses"].as_array().unwrap().len(), 2 * STEPS);
        assert_eq!(got["syncs"], 2 * STEPS, "one sync per micro-batch");
    }
}

/// DDP's `gradient_as_bucket_view`: the gradients become views of the
/// buckets that are all-reduced — at the first sync l2.weight's and
/// l2.bias's gradients lie end to end (the first bucket, see
/// [`assert_buckets`]), at every later one l2.bias's, l2.weight's and
/// l1.bias's (the rebuilt first bucket) — and with accumulation the
/// training is the same, bit for bit, as without (and as one process with
/// twice the batch).
#[test]
fn gradient_as_bucket_view_puts_gradients_in_the_buckets_and_trains_the_same() {
    let plain = ddp_matches_one_process_as(2, 2, 2, "no");
    let view = ddp_matches_one_process_as(2, 2, 2, "no:view");
    for (p, v) in plain.iter().zip(&view) {
        assert_eq!(p["weights"], v["weights"]);
        assert_eq!(p["losses"], v["losses"]);
        let adjacent: Vec<u64> = serde_json::from_value(v["adjacent"].clone()).unwrap();
        assert_eq!(adjacent.len(), STEPS);
        assert_eq!(adjacent[0], 1, "{adjacent:?}");
        assert!(adjacent[1..].iter().all(|&a| a == 2), "{adjacent:?}");
    }
}

#[test]
fn bf16_compression_halves_the_bytes_and_stays_close() {
    let (n, b) = (2, 4);
    let full = scratch("ddp-full");
    mpirun_ok(
        n,
        &hearth_testkit::child!("child_ddp"),
        &format!("ddp:{b}:1:no"),
        &full,
    );
    let small = scratch("ddp-bf16");
    mpirun_ok(
        n,
        &hearth_testkit::child!("child_ddp"),
        &format!("ddp:{b}:1:bf16"),
        &small,
    );
    let (full, small) = (results(&full, n), results(&small, n));
    assert_eq!(
        full[0]["bytes"].as_u64().unwrap(),
        2 * small[0]["bytes"].as_u64().unwrap()
    );
    // Both ranks agree exactly, and the run stays near the full-precision one.
    assert_eq!(small[0]["weights"], small[1]["weights"]);
    let want: Vec<(String, Vec<f64>)> = serde_json::from_value(full[0]["weights"].clone()).unwrap();
    assert_same_weights(&small[0]["weights"], &want, 2e-2, "bf16 vs fp32 gradients");
    let differs = small[0]["weights"] != full[0]["weights"];
    assert!(differs, "bf16 rounding changed something");
}

/// One rank of a DDP run of a TorchScript model with BatchNorm; the mode is
/// `buffers:<model path>:<broadcast_buffers>`. Rank 1 starts from other
/// running statistics and every rank trains on its own batches; at the end
/// each takes one training forward pass of the same batch and reports its
/// buffers.
#[test]
fn child_buffers() {
    let Some(mode) = std::env::var(CHILD)
        .ok()
        .filter(|m| m.starts_with("buffers:"))
    else {
        return; // only under mpirun
    };
    let parts: Vec<&str> = mode.split(':').collect();
    let (path, broadcast_buffers) = (parts[1], parts[2] == "true");
    let mut acc = common::child_builder()
        .ddp(hearth::parallel::DdpOptions {
            broadcast_buffers,
            ..Default::default()
        })
        .build()
        .unwrap();
    let r = acc.process_index();
    let model = hearth::models::TorchScriptModel::load(path.as_ref(), Device::Cpu).unwrap();
    use hearth::models::Model;
    let buffers = |m: &dyn Model| -> Vec<(String, Vec<f64>)> {
        m.named_buffers()
            .iter()
            .map(|(n, b)| (n.clone(), values(b)))
            .collect()
    };
    tch::no_grad(|| {
        for (_, mut b) in model.named_buffers() {
            let _ = b.g_add_scalar_(r as i64 * 3);
        }
    });
    let model = acc.prepare(model).unwrap();
    let prepared = buffers(&model);
    let tokens = |seed: i64| {
        tch::manual_seed(seed);
        Tensor::randint(11, [16, 8], (Kind::Int64, Device::Cpu))
    };
    for step in 0..3 {
        let logits = model.forward_t(&tokens(100 * r as i64 + step), true);
        let _ = logits;
    }
    let _ = model.forward_t(&tokens(7), true);
    let result = serde_json::json!({"prepared": prepared, "end": buffers(&model)});
    write_result(r, &result);
}

/// A BatchNorm model's buffers (issue 18, item 3): prepared, every rank
/// holds rank 0's; with `broadcast_buffers` (DDP's default) they are rank
/// 0's again before each training forward pass, so one pass over the same
/// batch leaves every rank with the same statistics; without it, each keeps
/// those of its own batches.
#[test]
fn ddp_gives_every_rank_rank_0s_buffers_before_each_forward_pass() {
    let dir = scratch("mpi_buffers");
    let model = dir.join("bn.pt");
    common::oracle("batchnorm_lm.py", &[model.to_str().unwrap()]);
    let ranks = |broadcast: bool| {
        let out = dir.join(format!("broadcast_{broadcast}"));
        mpirun_ok(
            2,
            &hearth_testkit::child!("child_buffers"),
            &format!("buffers:{}:{broadcast}", model.display()),
            &out,
        );
        results(&out, 2)
    };
    let on = ranks(true);
    assert_eq!(
        on[0]["prepared"], on[1]["prepared"],
        "prepare sends rank 0's buffers"
    );
    let names: Vec<&str> = on[0]["end"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b[0].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "bn.num_batches_tracked",
            "bn.running_mean",
            "bn.running_var"
        ]
    );
    assert_ne!(
        on[0]["end"], on[0]["prepared"],
        "training updates the statistics"
    );
    assert_eq!(
        on[0]["end"], on[1]["end"],
        "rank 0's buffers before the last pass"
    );
    let off = ranks(false);
    assert_eq!(
        off[0]["prepared"], off[1]["prepared"],
        "prepare still sends rank 0's buffers"
    );
    assert_ne!(
        off[0]["end"], off[1]["end"],
        "without broadcast_buffers each rank keeps its own"
    );
}

/// One rank's view of a model prepared for training and one prepared with
/// `evaluation_mode`, each built from this rank's own seed.
#[test]
fn child_evaluation_mode() {
    if std::env::var(CHILD).as_deref() != Ok("evaluation") {
        return; // only under mpirun
    }
    use hearth::models::{Gpt, GptConfig, Model};
    let mut acc = common::child_builder().build().unwrap();
    let r = acc.process_index();
    let config = GptConfig {
        vocab_size: 11,
        block_size: 8,
        d_model: 16,
        layers: 1,
        heads: 2,
    };
    tch::manual_seed(100 + r as i64);
    let (train, eval) = (Gpt::new(config, Device::Cpu), Gpt::new(config, Device::Cpu));
    let train = acc.prepare(train).unwrap();
    let eval = acc.prepare_model(eval, true).unwrap();
    let sum = |m: &dyn Fn() -> Vec<(String, Tensor)>, grad: bool| -> f64 {
        m().iter()
            .map(|(_, p)| {
                let t = if grad { p.grad() } else { p.shallow_clone() };
                f64::try_from(t.sum(Kind::Double)).unwrap()
            })
            .sum()
    };
    let weights = (
        sum(&|| train.named_parameters(), false),
        sum(&|| eval.named_parameters(), false),
    );
    let x = Tensor::randint(11, [2, 8], (Kind::Int64, Device::Cpu));
    let loss =
        train.forward_t(&x, true).sum(Kind::Float) + eval.forward_t(&x, true).sum(Kind::Float);
    acc.backward(&loss).unwrap();
    let grads = (
        sum(&|| train.named_parameters(), true),
        sum(&|| eval.named_parameters(), true),
    );
    write_result(
        r,
        &serde_json::json!({"weights": [weights.0, weights.1], "grads": [grads.0, grads.1]}),
    );
}

/// Accelerate's `prepare_model(model, evaluation_mode=True)` makes no DDP
/// wrapper: such a model keeps each process's own weights and gradients,
/// while one prepared for training starts from rank 0's and averages.
#[test]
fn a_model_prepared_for_evaluation_is_not_data_parallel() {
    let dir = scratch("evaluation-mode");
    mpirun_ok(
        2,
        &hearth_testkit::child!("child_evaluation_mode"),
        "evaluation",
        &dir,
    );
    let ranks = results(&dir, 2);
    let at = |r: usize, what: &str, i: usize| ranks[r][what][i].as_f64().unwrap();
    assert_eq!(
        at(0, "weights", 0),
        at(1, "weights", 0),
        "trained: rank 0's weights"
    );
    assert_eq!(
        at(0, "grads", 0),
        at(1, "grads", 0),
        "trained: averaged gradients"
    );
    assert_ne!(
        at(0, "weights", 1),
        at(1, "weights", 1),
        "evaluated: each its own weights"
    );
    assert_ne!(
        at(0, "grads", 1),
        at(1, "grads", 1),
        "evaluated: gradients not averaged"
    );
}
