//! The collectives across real ranks against worked-out values (flat and
//! nested), unequal gathers, and what a rank that exits, hangs or never
//! ends does to the job.

use common::{mpirun, mpirun_ok, results, scratch, write_result, CHILD, OUT};
use hearth_testkit as common;

use super::values;

use hearth::accelerator::Accelerator;
use hearth::comm::{DistError, ReduceOp};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

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
            // A collective after the timeout fails at once, naming the
            // earlier one's finding, rather than waiting out its own.
            let then = Instant::now();
            let again = acc.gather(&x).unwrap_err();
            let waited = then.elapsed();
            eprintln!(
                "rank {r}: then {again} (waited {} s)",
                if waited < Duration::from_secs(3) {
                    "under 3"
                } else {
                    "3 or more"
                }
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
    // The float32 reduce-scatter (a ring of point-to-point messages)
    // against MPI's all-reduce of the same random values: rank r's chunk.
    let n = acc.num_processes() as i64;
    let group = acc.process_group();
    let big = Tensor::randn([n * 1003], (Kind::Float, Device::Cpu)) * (r as f64 + 1.0);
    let ring = group.reduce_scatter(&big, ReduceOp::Sum).unwrap();
    let ring_mean = group.reduce_scatter(&big, ReduceOp::Mean).unwrap();
    let mut whole = big.copy();
    group.all_reduce(&mut whole, ReduceOp::Sum).unwrap();
    let own = whole.narrow(0, r as i64 * 1003, 1003);
    let gap = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    let ring_gap = gap(&ring, &own);
    let ring_mean_gap = gap(&(&ring_mean * n as f64), &own);
    acc.wait_for_everyone().unwrap();
    let result = serde_json::json!({
        "ring_gap": ring_gap, "ring_mean_gap": ring_mean_gap, "ring_shape": ring.size(),
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
        // Two ranks: a + b is b + a, whatever order the ring sums in.
        assert_eq!(got["ring_gap"], 0.0, "{got}");
        assert!(got["ring_mean_gap"].as_f64().unwrap() < 1e-5, "{got}");
        assert_eq!(got["ring_shape"], serde_json::json!([1003]));
        // Accelerate's even batches: rank 1 completes its batch from the start.
        let mine = [vec![0.0, 1.0, 2.0, 3.0, 4.0], vec![5.0, 6.0, 7.0, 8.0, 0.0]];
        assert_eq!(got["batches"], serde_json::json!([mine[r]]));
        let all: Vec<f64> = (0..9).map(f64::from).collect();
        let with_repeat = [all.clone(), vec![0.0]].concat();
        assert_eq!(got["gathered_ids"], serde_json::json!([with_repeat]));
        assert_eq!(got["metric_ids"], serde_json::json!([all]));
    }
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
        // Three ranks: the ring sums in another order than MPI's reduction.
        assert!(got["ring_gap"].as_f64().unwrap() < 1e-5, "{got}");
        assert!(got["ring_mean_gap"].as_f64().unwrap() < 1e-5, "{got}");
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
        stderr.contains("rank 0: then all_gather_bytes on rank 0 was not waited for: an earlier collective of this process timed out: rank 1 did not answer (it hangs, or its process is gone); the process group cannot be used any more (waited under 3 s)"),
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
            "mpi::collectives::a_job_that_never_ends_fails_its_test_in_time_and_leaves_nothing_behind: `mpirun "
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
