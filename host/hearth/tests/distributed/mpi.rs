//! Collectives across real processes: this test binary starts itself under
//! `mpirun` (Open MPI, installed by `make setup`); the child test
//! `child_collectives` runs in each rank and prints what it got, and the
//! parent checks it against the values of the distributed issue.

use common::{mpirun, mpirun_ok, results, scratch, write_result, Limited, CHILD, OUT};
use hearth_testkit as common;
/// DistributedDataParallelKwargs checked against PyTorch's DDP.
mod ddp_kwargs;
/// `join_uneven_inputs` checked against PyTorch's `Join`.
mod join;
/// A checkpoint of fewer processes loaded on more.
mod more_processes;

use hearth::accelerator::Accelerator;
use hearth::comm::{DistError, ReduceOp};
use std::process::Command;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(Kind::Double).view([-1])).unwrap()
}

/// One rank's results, written to `$HEARTH_MPI_OUT/rank_<r>.json`.
#[test]
fn child_collectives() {
    let Ok(mode) = std::env::var(CHILD) else {
        return; // only under mpirun
    };
    let mut acc = Accelerator::builder()
        .cpu(true)
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let r = acc.process_index();
    if mode == "exit" && r == 1 {
        std::process::exit(3);
    }
    if mode == "hang" && r == 1 {
        std::thread::sleep(Duration::from_secs(60));
    }
    let x = Tensor::from_slice(&[1.0f32 + 2.0 * r as f32, 2.0 + 2.0 * r as f32]);
    let started = Instant::now();
    let sum = match acc.reduce(&x, ReduceOp::Sum) {
        Ok(sum) => sum,
        Err(e @ DistError::Timeout { .. }) => {
            eprintln!(
                "rank {r}: {e} after {:.1} s",
                started.elapsed().as_secs_f64()
            );
            std::process::exit(1);
        }
        Err(e) => panic!("{e}"),
    };
    let mean = acc.reduce(&x, ReduceOp::Mean).unwrap();
    // 0.1 and 0.2: a mean divided in float32 misses float64's by ~1e-8.
    let mean_f64 = acc
        .reduce(
            &Tensor::from_slice(&[0.1f64 * (r + 1) as f64]),
            ReduceOp::Mean,
        )
        .unwrap();
    let max = acc.reduce(&x, ReduceOp::Max).unwrap();
    let min = acc.reduce(&x.to_kind(Kind::Int64), ReduceOp::Min).unwrap();
    let gathered = acc.gather(&x).unwrap();
    let scalars = acc.gather(&Tensor::from(r as f64 * 10.0)).unwrap();
    // Rank r has r + 1 rows of 3.
    let rows = Tensor::full([r as i64 + 1, 3], r as f64, (Kind::Float, Device::Cpu));
    let unequal = acc.gather(&rows).unwrap();
    // Rank 1's rows are 4 wide: every process refuses the gather, together.
    let width = if r == 1 { 4 } else { 3 };
    let mismatch = acc
        .gather(&Tensor::zeros([1, width], (Kind::Float, Device::Cpu)))
        .unwrap_err()
        .to_string();
    let broadcast = acc.broadcast(&x, 0).unwrap();
    let objects: Vec<usize> = acc.gather_object(&r).unwrap();
    let word: String = acc.broadcast_object(&format!("from rank {r}"), 1).unwrap();
    // 9 examples, batch 5: rank 1's batch ends with example 0 again.
    let ids: Vec<Tensor> = (0..9).map(|i| Tensor::from(i as i64)).collect();
    let loader = acc.prepare(hearth::data::DataLoader::new(ids, 5)).unwrap();
    let (mut batches, mut gathered_ids, mut metric_ids) = (vec![], vec![], vec![]);
    for batch in loader.iter() {
        batches.push(values(&batch));
        gathered_ids.push(values(&acc.gather(&batch).unwrap()));
        metric_ids.push(values(&acc.gather_for_metrics(&batch).unwrap()));
    }
    acc.wait_for_everyone().unwrap();
    let result = serde_json::json!({
        "batches": batches, "gathered_ids": gathered_ids, "metric_ids": metric_ids,
        "rank": r,
        "world": acc.num_processes(),
        "local": acc.process_group().local_process_index(),
        "backend": acc.process_group().backend(),
        "sum": values(&sum), "mean": values(&mean), "max": values(&max), "min": values(&min),
        "min_kind": format!("{:?}", min.kind()),
        "mean_f64": f64::try_from(&mean_f64).unwrap(), "mean_f64_kind": format!("{:?}", mean_f64.kind()),
        "gather": values(&gathered), "scalars": values(&scalars),
        "unequal_shape": unequal.size(), "unequal": values(&unequal), "mismatch": mismatch,
        "broadcast": values(&broadcast), "objects": objects, "word": word,
    });
    write_result(r, &result);
}

/// One rank of the Accelerate-helpers comparison: the same inputs as
/// `tests/oracles/accelerate_collectives.py`, the same keys in its JSON.
#[test]
fn child_process_helpers() {
    if std::env::var(CHILD).as_deref() != Ok("helpers") {
        return; // only under mpirun
    }
    let mut acc = common::child_builder()
        .dataloader_config(hearth::accelerator::DataLoaderConfiguration {
            dispatch_batches: true,
            ..Default::default()
        })
        .build()
        .unwrap();
    assert_eq!(
        acc.distributed_type(),
        hearth::comm::DistributedType::MultiCpu
    );
    let (r, n) = (acc.process_index(), acc.num_processes());
    let rows =
        |t: &Tensor| -> Vec<Vec<f64>> { (0..t.size()[0]).map(|i| values(&t.get(i))).collect() };
    let (mut split, mut split_tensor, mut pad) = (
        serde_json::Map::new(),
        serde_json::Map::new(),
        serde_json::Map::new(),
    );
    for length in 0..8usize {
        for padding in [false, true] {
            if length == 0 && padding {
                continue;
            }
            let key = format!("{length}:{}", u8::from(padding));
            let items: Vec<usize> = (0..length).collect();
            split.insert(
                key.clone(),
                acc.split_between_processes(&items, padding).into(),
            );
            let table = Tensor::arange(length as i64 * 2, (Kind::Float, Device::Cpu)).view([-1, 2]);
            let mine = acc.split_tensor_between_processes(&table, padding);
            split_tensor.insert(key, rows(&mine).into());
        }
    }
    let x = Tensor::arange(((r + 1) * (r + 2)) as i64, (Kind::Float, Device::Cpu))
        .view([r as i64 + 1, r as i64 + 2])
        + 1.0;
    for (dim, value, first) in [
        (0i64, 0.0, false),
        (1, -1.0, true),
        (-1, 7.0, false),
        (-2, 0.0, true),
        (2, 5.0, false),
    ] {
        let padded = acc.pad_across_processes(&x, dim, value, first).unwrap();
        pad.insert(
            format!("{dim}:{value}:{}", u8::from(first)),
            rows(&padded).into(),
        );
    }
    if r == n - 1 {
        acc.set_trigger();
    }
    let triggers = [acc.check_trigger().unwrap(), acc.check_trigger().unwrap()];
    tch::manual_seed(100 + r as i64);
    let own_draw = values(&Tensor::rand([3], (Kind::Float, Device::Cpu)));
    acc.synchronize_rng_state().unwrap();
    let synced_draw = values(&Tensor::rand([3], (Kind::Float, Device::Cpu)));
    // Not in Accelerate: the reduce-scatter of [1+2r, 2+2r].
    let x = Tensor::from_slice(&[1.0f32 + 2.0 * r as f32, 2.0 + 2.0 * r as f32]);
    let scattered = if 2 % n == 0 {
        values(&acc.reduce_scatter(&x, ReduceOp::Sum).unwrap())
    } else {
        vec![]
    };
    // Which processes run a function, and who goes first: rank 0 writes a
    // file after a pause; every process then looks for it.
    let runs = serde_json::json!({
        "main": acc.on_main_process(|| r),
        "local_main": acc.on_local_main_process(|| r),
        "last": acc.on_last_process(|| r),
        "process_1": acc.on_process(1, || r),
        "local_process_1": acc.on_local_process(1, || r),
    });
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    let mut first = serde_json::Map::new();
    for kind in ["main", "local_main"] {
        let marker = out.join(format!("first-{kind}"));
        let look = || {
            if r == 0 {
                std::thread::sleep(Duration::from_millis(300));
                std::fs::write(&marker, "rank 0").unwrap();
            }
            marker.exists()
        };
        let seen = match kind {
            "main" => acc.main_process_first(look),
            _ => acc.local_main_process_first(look),
        };
        first.insert(format!("seen_first:{kind}"), seen.unwrap().into());
    }
    // no_sync keeps each process's own gradient (rank r's is r + 1);
    // trigger_sync_in_backward inside it averages this backward pass's.
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let no_bias = tch::nn::LinearConfig {
        bias: false,
        ws_init: tch::nn::Init::Const(0.0),
        ..Default::default()
    };
    let layer = tch::nn::linear(vs.root() / "layer", 2, 1, no_bias);
    let _vs = acc.prepare(vs).unwrap();
    let gradient = || {
        use tch::nn::Module;
        let loss = layer.forward(&Tensor::ones([1, 2], (Kind::Float, Device::Cpu)));
        acc.backward(&(loss.sum(Kind::Float) * (r as f64 + 1.0)))
            .unwrap();
        let grad = values(&layer.ws.grad());
        let _ = layer.ws.grad().zero_();
        grad
    };
    acc.print(format!("printed by rank {r}"));
    let no_sync = acc.no_sync(gradient);
    let forced = acc.no_sync(|| acc.trigger_sync_in_backward(gradient));
    let synced = gradient();
    // dispatch_batches: rank 0 reads 11 examples in batches of 2.
    let mut dispatched = serde_json::Map::new();
    for drop_last in [false, true] {
        let loader = hearth::data::DataLoader::iterable(Count(11), 2).drop_last(drop_last);
        let loader = acc.prepare(loader).unwrap();
        assert!(loader.dispatches());
        let ints = |t: &Tensor| Vec::<i64>::try_from(t).unwrap();
        let (mut batches, mut metrics, mut objects) = (vec![], vec![], vec![]);
        for batch in loader.iter() {
            batches.push(ints(&batch));
            metrics.push(ints(&acc.gather_for_metrics(&batch).unwrap()));
            let names: Vec<String> = ints(&batch).iter().map(|v| format!("ex{v}")).collect();
            objects.push(acc.gather_objects_for_metrics(names).unwrap());
        }
        dispatched.insert(
            format!("dispatch:{}", u8::from(drop_last)),
            serde_json::json!({"batches": batches, "metrics": metrics, "objects": objects}),
        );
    }
    let mut result = serde_json::json!({
        "rank": r, "world": n, "split": split, "split_tensor": split_tensor, "pad": pad,
        "triggers": triggers, "own_draw": own_draw, "synced_draw": synced_draw,
        "reduce_scatter": scattered, "runs": runs, "no_sync": no_sync,
        "trigger_sync_in_backward": forced, "synced": synced,
    });
    result.as_object_mut().unwrap().extend(dispatched);
    result.as_object_mut().unwrap().extend(first);
    write_result(r, &result);
}

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

/// The collectives' values on two ranks, worked out by hand from
/// Accelerate's documented behaviour (even batches, `gather_for_metrics`
/// dropping the repeated rows); Accelerate itself runs as the oracle of
/// the process helpers (`process_helpers_on_three_ranks_match_accelerate`).
#[test]
fn collectives_across_two_ranks_give_the_worked_out_values() {
    let dir = scratch("two");
    mpirun_ok(
        2,
        &hearth_testkit::child!("child_collectives"),
        "normal",
        &dir,
    );
    let ranks = results(&dir, 2);
    for (r, got) in ranks.iter().enumerate() {
        assert_eq!(got["rank"], r);
        assert_eq!(got["world"], 2);
        assert_eq!(got["local"], r, "both ranks run on this machine");
        assert_eq!(got["backend"], "mpi");
        assert_eq!(got["gather"], serde_json::json!([1.0, 2.0, 3.0, 4.0]));
        assert_eq!(got["sum"], serde_json::json!([4.0, 6.0]));
        assert_eq!(got["mean"], serde_json::json!([2.0, 3.0]));
        assert_eq!(got["max"], serde_json::json!([3.0, 4.0]));
        assert_eq!(got["min"], serde_json::json!([1.0, 2.0]));
        assert_eq!(got["min_kind"], "Int64");
        assert_eq!(got["mean_f64_kind"], "Double");
        let mean_f64 = got["mean_f64"].as_f64().unwrap();
        assert!(
            (mean_f64 - (0.1 + 0.2) / 2.0).abs() < 1e-15,
            "float64 mean {mean_f64} was divided in lower precision"
        );
        assert_eq!(got["broadcast"], serde_json::json!([1.0, 2.0]));
        assert_eq!(got["objects"], serde_json::json!([0, 1]));
        assert_eq!(got["scalars"], serde_json::json!([0.0, 10.0]));
        assert_eq!(got["unequal_shape"], serde_json::json!([3, 3]));
        assert_eq!(
            got["unequal"],
            serde_json::json!([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
        );
        assert_eq!(got["word"], "from rank 1");
        // Accelerate's even batches: rank 1 completes its batch from the start.
        let mine = [vec![0.0, 1.0, 2.0, 3.0, 4.0], vec![5.0, 6.0, 7.0, 8.0, 0.0]];
        assert_eq!(got["batches"], serde_json::json!([mine[r]]));
        let all: Vec<f64> = (0..9).map(f64::from).collect();
        let with_repeat = [all.clone(), vec![0.0]].concat();
        assert_eq!(got["gathered_ids"], serde_json::json!([with_repeat]));
        assert_eq!(got["metric_ids"], serde_json::json!([all]));
    }
}

/// This rank of 4 on two pretend machines (ranks 0–1 on `a`, 2–3 on `b`,
/// each with a folder of its own under the output folder), saving with
/// `save_on_each_node` and keeping `total_limit` checkpoints: its rank,
/// the output folder and its accelerator.
fn on_two_machines(total_limit: Option<usize>) -> (usize, std::path::PathBuf, Accelerator) {
    let rank: usize = std::env::var("OMPI_COMM_WORLD_RANK")
        .unwrap()
        .parse()
        .unwrap();
    let node = if rank < 2 { "a" } else { "b" };
    std::env::set_var("HEARTH_NODE_NAME", node);
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    let acc = common::child_builder()
        .project_config(hearth::accelerator::ProjectConfiguration {
            project_dir: out.join(format!("node_{node}")),
            automatic_checkpoint_naming: true,
            save_on_each_node: true,
            total_limit,
            ..Default::default()
        })
        .build()
        .unwrap();
    (rank, out, acc)
}

/// One rank of a run on two pretend machines (ranks 0–1 on `a`, 2–3 on
/// `b`, each with a folder of its own) saving with `save_on_each_node`,
/// then loading back: each rank reports what it drew after the save and
/// after the load.
#[test]
fn child_save_on_each_node() {
    if std::env::var(CHILD).as_deref() != Ok("each-node") {
        return; // only under mpirun
    }
    let (rank, out, mut acc) = on_two_machines(None);
    tch::manual_seed(7 + rank as i64);
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let _layer = tch::nn::linear(vs.root() / "l", 3, 2, Default::default());
    let _vs = acc.prepare(vs).unwrap();
    acc.save_state(None).unwrap();
    acc.wait_for_everyone().unwrap();
    let after_save = values(&Tensor::rand([2], (Kind::Float, Device::Cpu)));
    let _ = Tensor::rand([5], (Kind::Float, Device::Cpu));
    acc.load_state(None).unwrap();
    let after_load = values(&Tensor::rand([2], (Kind::Float, Device::Cpu)));
    let result = serde_json::json!({"after_save": after_save, "after_load": after_load});
    std::fs::write(out.join(format!("rank_{rank}.json")), result.to_string()).unwrap();
}

/// One rank of two pretend machines (as `child_save_on_each_node`) keeping
/// one checkpoint: the first save succeeds; for the second, machine b's
/// writer (rank 2) may write no file past 100 bytes (RLIMIT_FSIZE), so it
/// fails there while machine a's commits. Each rank reports its error.
#[test]
fn child_a_machine_that_cannot_save() {
    if std::env::var(CHILD).as_deref() != Ok("each-node-fail") {
        return; // only under mpirun
    }
    let (rank, out, mut acc) = on_two_machines(Some(1));
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let _layer = tch::nn::linear(vs.root() / "l", 3, 2, Default::default());
    let _vs = acc.prepare(vs).unwrap();
    acc.save_state(None).unwrap();
    let limit = |bytes: u64| {
        let limit = libc::rlimit {
            rlim_cur: bytes,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: setting this process's own limit (and ignoring the
        // signal a write past it would otherwise end the process with).
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
        }
    };
    if rank == 2 {
        limit(100);
    }
    let error = acc.save_state(None).map(|_| ()).unwrap_err().to_string();
    limit(libc::RLIM_INFINITY);
    let result = serde_json::json!({ "error": error });
    std::fs::write(out.join(format!("rank_{rank}.json")), result.to_string()).unwrap();
}

/// One rank of a sharded, shuffled loader stopped mid-epoch: mode
/// `loader:save` reads 2 batches, saves, then reads on to the end of the
/// next epoch; `loader:resume` (a fresh process) loads that checkpoint and
/// reads the same stretch. Each writes the batches it read after the save.
#[test]
fn child_loader_resume() {
    let Some(mode) = std::env::var(CHILD)
        .ok()
        .filter(|m| m.starts_with("loader:"))
    else {
        return; // only under mpirun
    };
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    // The save and the resume write into sibling folders; the checkpoint
    // lies beside them.
    let checkpoint = out.parent().unwrap().join("checkpoint");
    let mut acc = common::child_builder().build().unwrap();
    let ids: Vec<Tensor> = (0..13).map(|i| Tensor::from(i as i64)).collect();
    let loader = acc
        .prepare(hearth::data::DataLoader::new(ids, 2).shuffle(5))
        .unwrap();
    let ints = |t: &Tensor| Vec::<i64>::try_from(t).unwrap();
    let mut after = Vec::new();
    if mode == "loader:save" {
        let mut epoch = loader.iter();
        let _ = (epoch.next(), epoch.next());
        acc.save_state(Some(&checkpoint)).unwrap();
        after.extend(epoch.map(|b| ints(&b)));
    } else {
        acc.load_state(Some(&checkpoint)).unwrap();
        after.extend(loader.iter().map(|b| ints(&b)));
    }
    after.extend(loader.iter().map(|b| ints(&b)));
    let r = acc.process_index();
    let result = serde_json::json!({ "after": after, "state": loader.state().epoch });
    std::fs::write(out.join(format!("rank_{r}.json")), result.to_string()).unwrap();
}

/// The numbers `0..n` as a stream (an iterable dataset).
struct Count(i64);

impl hearth::data::IterableDataset for Count {
    type Item = Tensor;
    fn stream(&self, _: u64) -> Box<dyn Iterator<Item = Tensor> + '_> {
        Box::new((0..self.0).map(Tensor::from))
    }
}

/// Accelerate's helpers run under torchrun (gloo, CPU) on the same inputs.
fn accelerate_oracle(n: usize, out: &std::path::Path) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let run = Command::new(common::python())
        .args([
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            &n.to_string(),
        ])
        .args(["--master_port", &port.to_string()])
        .arg(common::repo_root().join("tests/oracles/accelerate_collectives.py"))
        .arg(out)
        .env("OMP_NUM_THREADS", "1")
        // torchrun's agent leaves its log folder in TMPDIR: keep it in ours.
        .env("TMPDIR", out)
        .run()
        .expect("the project's Python (.venv) runs; run `make setup`");
    assert!(
        run.status.success(),
        "the Accelerate oracle failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

#[test]
fn process_helpers_on_three_ranks_match_accelerate() {
    let theirs_dir = scratch("helpers-accelerate");
    accelerate_oracle(3, &theirs_dir);
    let ours_dir = scratch("helpers");
    mpirun_ok(
        3,
        &hearth_testkit::child!("child_process_helpers"),
        "helpers",
        &ours_dir,
    );
    let (theirs, ours) = (results(&theirs_dir, 3), results(&ours_dir, 3));
    for r in 0..3 {
        for key in [
            "split",
            "split_tensor",
            "pad",
            "triggers",
            "dispatch:0",
            "dispatch:1",
            "runs",
            "seen_first:main",
            "seen_first:local_main",
            "no_sync",
            "trigger_sync_in_backward",
            "synced",
        ] {
            assert_eq!(ours[r][key], theirs[r][key], "rank {r}: {key}");
        }
        // The same generator (libtorch's mt19937) gives the same floats.
        for key in ["own_draw", "synced_draw"] {
            let (a, b): (Vec<f64>, Vec<f64>) = (
                serde_json::from_value(ours[r][key].clone()).unwrap(),
                serde_json::from_value(theirs[r][key].clone()).unwrap(),
            );
            assert_eq!(a.len(), 3);
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-7, "rank {r}: {key} {a:?} vs {b:?}");
            }
        }
        assert_eq!(ours[r]["synced_draw"], ours[0]["synced_draw"]);
        assert_ne!(ours[r]["own_draw"], ours[(r + 1) % 3]["own_draw"]);
        // Not both wrong the same way: the values worked out by hand.
        assert_eq!(ours[r]["seen_first:local_main"], true);
        assert_eq!(
            ours[r]["no_sync"],
            serde_json::json!(vec![r as f64 + 1.0; 2])
        );
        assert_eq!(
            ours[r]["trigger_sync_in_backward"],
            serde_json::json!([2.0, 2.0])
        );
        assert_eq!(
            ours[r]["runs"]["last"],
            if r == 2 {
                2.into()
            } else {
                serde_json::Value::Null
            }
        );
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_share_of_the_sum_and_print_prints_once() {
    let dir = scratch("scatter");
    let run = mpirun(
        2,
        &hearth_testkit::child!("child_process_helpers"),
        "helpers",
        &dir,
    );
    assert!(run.status.success(), "{}", common::tails(&run));
    let ranks = results(&dir, 2);
    // [1, 2] + [3, 4] = [4, 6]: rank 0 gets [4], rank 1 [6].
    assert_eq!(ranks[0]["reduce_scatter"], serde_json::json!([4.0]));
    assert_eq!(ranks[1]["reduce_scatter"], serde_json::json!([6.0]));
    // `Accelerator::print` prints on the machine's first process only.
    let stdout = String::from_utf8_lossy(&run.stdout);
    let printed: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("printed by rank"))
        .collect();
    assert_eq!(printed.len(), 1, "{stdout}");
    assert!(printed[0].ends_with("printed by rank 0"), "{stdout}");
}

/// Issue 43: with `save_on_each_node`, a save that one machine's writer
/// cannot write fails on every rank, naming rank 2; the machine whose copy
/// was committed sets it aside, and neither rotates: both keep the
/// checkpoint before, so a resume finds the same newest one everywhere.
#[test]
fn a_machine_that_cannot_save_leaves_every_machine_the_checkpoint_before() {
    let dir = scratch("each-node-fail");
    mpirun_ok(
        4,
        &hearth_testkit::child!("child_a_machine_that_cannot_save"),
        "each-node-fail",
        &dir,
    );
    let names = |node: &str| -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir.join(format!("node_{node}/checkpoints")))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
        names.sort();
        names
    };
    assert_eq!(names("a"), ["checkpoint_0", "checkpoint_1.incomplete"]);
    assert_eq!(names("b"), ["checkpoint_0"]);
    for (r, got) in results(&dir, 4).iter().enumerate() {
        let error = got["error"].as_str().unwrap();
        let expected = if r == 2 {
            "ulimit -f"
        } else {
            "rank 2 could not write its part"
        };
        assert!(error.contains(expected), "rank {r}: {error}");
    }
}

#[test]
fn save_on_each_node_writes_a_whole_checkpoint_per_machine_with_its_ranks_generators() {
    let dir = scratch("each-node");
    mpirun_ok(
        4,
        &hearth_testkit::child!("child_save_on_each_node"),
        "each-node",
        &dir,
    );
    let files = |node: &str| -> Vec<String> {
        let folder = dir.join(format!("node_{node}/checkpoints/checkpoint_0"));
        let mut names: Vec<String> = std::fs::read_dir(&folder)
            .unwrap_or_else(|e| panic!("{}: {e}", folder.display()))
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("random_states") || n == "model.safetensors")
            .collect();
        names.sort();
        names
    };
    assert_eq!(
        files("a"),
        [
            "model.safetensors",
            "random_states_0.safetensors",
            "random_states_1.safetensors"
        ]
    );
    assert_eq!(
        files("b"),
        [
            "model.safetensors",
            "random_states_2.safetensors",
            "random_states_3.safetensors"
        ]
    );
    // Both machines hold rank 0's weights (prepare broadcast them).
    let model = |node: &str| {
        std::fs::read(dir.join(format!(
            "node_{node}/checkpoints/checkpoint_0/model.safetensors"
        )))
        .unwrap()
    };
    assert_eq!(model("a"), model("b"));
    // Every rank's generators came back from its own machine's folder.
    let ranks = results(&dir, 4);
    for (r, got) in ranks.iter().enumerate() {
        assert_eq!(got["after_load"], got["after_save"], "rank {r}");
    }
    assert_ne!(ranks[0]["after_save"], ranks[2]["after_save"]);
}

#[test]
fn a_sharded_loader_resumed_on_two_ranks_reads_what_the_unbroken_run_read() {
    let dir = scratch("loader");
    let (saved, resumed) = (dir.join("saved"), dir.join("resumed"));
    mpirun_ok(
        2,
        &hearth_testkit::child!("child_loader_resume"),
        "loader:save",
        &saved,
    );
    mpirun_ok(
        2,
        &hearth_testkit::child!("child_loader_resume"),
        "loader:resume",
        &resumed,
    );
    let (saved, resumed) = (results(&saved, 2), results(&resumed, 2));
    for r in 0..2 {
        // 13 examples, batch 2, 2 ranks: 4 batches each per epoch, 2 read
        // before the save: 2 more of epoch 0, then 4 of epoch 1.
        let after = saved[r]["after"].as_array().unwrap();
        assert_eq!(after.len(), 6, "rank {r}: {after:?}");
        assert_eq!(resumed[r]["after"], saved[r]["after"], "rank {r}");
        assert_eq!(resumed[r]["state"], 2, "two epochs finished");
    }
    assert_ne!(
        saved[0]["after"], saved[1]["after"],
        "the ranks read different shards"
    );
}

#[test]
fn three_ranks_gather_unequal_rows_in_rank_order() {
    let dir = scratch("three");
    mpirun_ok(
        3,
        &hearth_testkit::child!("child_collectives"),
        "normal",
        &dir,
    );
    let ranks = results(&dir, 3);
    for got in &ranks {
        assert_eq!(got["unequal_shape"], serde_json::json!([6, 3]));
        assert_eq!(got["sum"], serde_json::json!([9.0, 12.0]));
        assert_eq!(got["objects"], serde_json::json!([0, 1, 2]));
        let mismatch = got["mismatch"].as_str().unwrap();
        let other = if got["rank"] == 1 { "rank 0" } else { "rank 1" };
        assert!(
            mismatch.contains(other) && mismatch.contains("[4]") && mismatch.contains("[3]"),
            "{mismatch}"
        );
    }
}

#[test]
fn a_rank_that_exits_stops_the_job_naming_it() {
    let started = Instant::now();
    let out = mpirun(
        2,
        &hearth_testkit::child!("child_collectives"),
        "exit",
        &scratch("exit"),
    );
    assert!(!out.status.success());
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // mpirun names the process as [[job,1],rank] with its exit code.
    assert!(
        text.contains(",1],1]") && text.contains("Exit code:    3"),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "stopped promptly"
    );
}

#[test]
fn a_rank_that_hangs_makes_the_others_time_out_and_the_job_stop() {
    let started = Instant::now();
    let out = mpirun(
        2,
        &hearth_testkit::child!("child_collectives"),
        "hang",
        &scratch("hang"),
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 0: all_reduce did not complete within 3s on rank 0 of 2: rank 1 did not answer (it hangs, or its process is gone)"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "the hung rank does not hold the job for its 60 s"
    );
}

/// One rank of a job that never ends (mode `stuck`): each rank says it
/// started; rank 1 then says it is ready and sleeps for good, so mpirun
/// waits forever.
#[test]
fn child_stuck() {
    if std::env::var(CHILD).as_deref() != Ok("stuck") {
        return; // only under mpirun
    }
    let rank = std::env::var("OMPI_COMM_WORLD_RANK").unwrap();
    eprintln!("rank {rank} started");
    if rank == "1" {
        let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
        std::fs::write(out.join("ready"), "").unwrap();
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// No test can hang: a job that does not end within its limit is killed,
/// all its processes, and fails its test with a message naming the test,
/// the command, and the last lines of each rank's output.
#[test]
fn a_job_that_never_ends_fails_its_test_in_time_and_leaves_nothing_behind() {
    let dir = scratch("stuck");
    let job = common::start(&mut common::mpirun_command(
        2,
        &hearth_testkit::child!("child_stuck"),
        "stuck",
        &dir,
    ))
    .unwrap();
    let tag = job.tag().to_owned();
    // The clock starts once rank 1 has written its line, however slow
    // mpirun is to start the ranks.
    let started = Instant::now();
    while !dir.join("ready").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "rank 1 never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let started = Instant::now();
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        job.finish(Duration::from_secs(5))
    }));
    let message = *failed
        .expect_err("the job never ends")
        .downcast::<String>()
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "killed {:?} after its limit",
        started.elapsed()
    );
    let first = message.lines().next().unwrap();
    assert!(
        first.starts_with(
            "mpi::a_job_that_never_ends_fails_its_test_in_time_and_leaves_nothing_behind: `mpirun "
        ) && first.ends_with("did not finish within 5s; its processes were killed"),
        "{message}"
    );
    assert!(
        message.contains("--- rank 1, stderr ---\nrank 1 started\n"),
        "{message}"
    );
    let left = common::tagged(&tag);
    assert!(left.is_empty(), "left behind: {left:?}");
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

/// One rank of a dispatching loader whose other rank hangs (mode
/// `dispatch_hang`): the main process, which reads and sends the batches,
/// hangs; rank 1 reports the error `try_iter` gives.
#[test]
fn child_dispatch_hang() {
    if std::env::var(CHILD).as_deref() != Ok("dispatch_hang") {
        return; // only under mpirun
    }
    let mut acc = Accelerator::builder()
        .cpu(true)
        .timeout(Duration::from_secs(3))
        .dataloader_config(hearth::accelerator::DataLoaderConfiguration {
            dispatch_batches: true,
            ..Default::default()
        })
        .build()
        .unwrap();
    let r = acc.process_index();
    let data: Vec<Tensor> = (0..8).map(|i| Tensor::from(i as f32)).collect();
    let loader = acc.prepare(hearth::data::DataLoader::new(data, 2)).unwrap();
    if r == 0 {
        std::thread::sleep(Duration::from_secs(60));
    }
    for batch in loader.try_iter() {
        if let Err(e) = batch {
            eprintln!("rank {r}: dispatch_batches: {e}");
            std::process::exit(1);
        }
    }
}

/// Issue 18, item 4: a collective that fails inside `dispatch_batches`
/// is an error the caller gets (exit 1 with the message), not a panic.
#[test]
fn a_dispatching_loader_gives_the_error_when_a_rank_hangs() {
    let started = Instant::now();
    let out = mpirun(
        2,
        &hearth_testkit::child!("child_dispatch_hang"),
        "dispatch_hang",
        &scratch("dispatch_hang"),
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 1: dispatch_batches:")
            && stderr.contains("did not complete within 3s"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "the hung rank does not hold the job"
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

/// One rank's nested value padded, then gathered, reduced and broadcast whole.
#[test]
fn child_nested_collectives() {
    if std::env::var(CHILD).as_deref() != Ok("nested") {
        return; // only under mpirun
    }
    use std::collections::BTreeMap;
    let acc = common::child_builder().build().unwrap();
    let r = acc.process_index() as f64;
    // (logits, {"labels": [a, b]}) with rank-dependent values and, for the
    // labels, rank-dependent lengths.
    let value = (
        Tensor::from_slice(&[r, r + 0.5]),
        BTreeMap::from([(
            "labels".to_string(),
            vec![
                Tensor::full([1 + r as i64], r, (Kind::Float, Device::Cpu)),
                Tensor::from(r * 10.0),
            ],
        )]),
    );
    let leaves = |v: &(Tensor, BTreeMap<String, Vec<Tensor>>)| -> Vec<Vec<f64>> {
        let mut out = vec![values(&v.0)];
        out.extend(v.1["labels"].iter().map(values));
        out
    };
    let padded = acc.pad_across_processes(&value, 0, -1.0, false).unwrap();
    let gathered = acc.gather(&padded).unwrap();
    let summed = acc.reduce(&padded, ReduceOp::Sum).unwrap();
    let from_one = acc.broadcast(&padded, 1).unwrap();
    write_result(
        acc.process_index(),
        &serde_json::json!({
            "padded": leaves(&padded),
            "gathered": leaves(&gathered),
            "summed": leaves(&summed),
            "broadcast": leaves(&from_one),
        }),
    );
}

/// `gather`, `reduce`, `broadcast` and `pad_across_processes` take nested values
/// (Accelerate's `recursively_apply`): each leaf as the tensor collective
/// gives it, the structure kept.
#[test]
fn collectives_take_nested_values_leaf_by_leaf() {
    let dir = scratch("nested-collectives");
    mpirun_ok(
        2,
        &hearth_testkit::child!("child_nested_collectives"),
        "nested",
        &dir,
    );
    let ranks = results(&dir, 2);
    let leaf = |r: usize, what: &str| -> Vec<Vec<f64>> {
        serde_json::from_value(ranks[r][what].clone()).unwrap()
    };
    // Labels padded to 2 on rank 0 (rank 1 has 2 already).
    assert_eq!(
        leaf(0, "padded"),
        vec![vec![0.0, 0.5], vec![0.0, -1.0], vec![0.0]]
    );
    assert_eq!(
        leaf(1, "padded"),
        vec![vec![1.0, 1.5], vec![1.0, 1.0], vec![10.0]]
    );
    let gathered = vec![
        vec![0.0, 0.5, 1.0, 1.5],
        vec![0.0, -1.0, 1.0, 1.0],
        vec![0.0, 10.0],
    ];
    let summed = vec![vec![1.0, 2.0], vec![1.0, 0.0], vec![10.0]];
    for r in 0..2 {
        assert_eq!(leaf(r, "gathered"), gathered, "rank {r}");
        assert_eq!(leaf(r, "summed"), summed, "rank {r}");
        assert_eq!(leaf(r, "broadcast"), leaf(1, "padded"), "rank {r}");
    }
}
