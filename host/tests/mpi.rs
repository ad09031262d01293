//! Collectives across real processes: this test binary starts itself under
//! `mpirun` (Open MPI, installed by `make setup`); the child test
//! `child_collectives` runs in each rank and prints what it got, and the
//! parent checks it against the values of the distributed issue.

use hearth::accelerator::Accelerator;
use hearth::dist::{DistError, ReduceOp};
use std::process::{Command, Output};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

const CHILD: &str = "HEARTH_MPI_CHILD";

/// Where the children write their results.
const OUT: &str = "HEARTH_MPI_OUT";

/// Runs `child` of this binary in `n` ranks under mpirun; the children
/// write `rank_<r>.json` into `out`.
fn mpirun(n: usize, child: &str, mode: &str, out: &std::path::Path) -> Output {
    let exe = std::env::current_exe().unwrap();
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    Command::new("mpirun")
        .args(["--oversubscribe", "-n", &n.to_string()])
        .arg(exe)
        .args(["--exact", child, "--nocapture", "--test-threads", "1"])
        .env(CHILD, mode)
        .env(OUT, out)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun runs (Open MPI is installed by `make setup`)")
}

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(Kind::Double).view([-1])).unwrap()
}

/// One rank's results, written to `$HEARTH_MPI_OUT/rank_<r>.json`.
#[test]
fn child_collectives() {
    let Ok(mode) = std::env::var(CHILD) else {
        return; // only under mpirun
    };
    let acc = Accelerator::builder()
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
    let max = acc.reduce(&x, ReduceOp::Max).unwrap();
    let min = acc.reduce(&x.to_kind(Kind::Int64), ReduceOp::Min).unwrap();
    let gathered = acc.gather(&x).unwrap();
    let scalars = acc.gather(&Tensor::from(r as f64 * 10.0)).unwrap();
    // Rank r has r + 1 rows of 3.
    let rows = Tensor::full([r as i64 + 1, 3], r as f64, (Kind::Float, Device::Cpu));
    let unequal = acc.gather(&rows).unwrap();
    let broadcast = acc.broadcast(&x, 0).unwrap();
    let objects: Vec<usize> = acc.gather_object(&r).unwrap();
    let word: String = acc.broadcast_object(&format!("from rank {r}"), 1).unwrap();
    acc.wait_for_everyone().unwrap();
    let result = serde_json::json!({
        "rank": r,
        "world": acc.num_processes(),
        "local": acc.process_group().local_process_index(),
        "backend": acc.process_group().backend(),
        "sum": values(&sum), "mean": values(&mean), "max": values(&max), "min": values(&min),
        "min_kind": format!("{:?}", min.kind()),
        "gather": values(&gathered), "scalars": values(&scalars),
        "unequal_shape": unequal.size(), "unequal": values(&unequal),
        "broadcast": values(&broadcast), "objects": objects, "word": word,
    });
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    std::fs::write(out.join(format!("rank_{r}.json")), result.to_string()).unwrap();
}

fn scratch(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("hearth-mpi-{name}-{}", std::process::id()))
}

fn results(dir: &std::path::Path, n: usize) -> Vec<serde_json::Value> {
    (0..n)
        .map(|r| {
            let text = std::fs::read_to_string(dir.join(format!("rank_{r}.json")))
                .unwrap_or_else(|e| panic!("rank {r} wrote no result: {e}"));
            serde_json::from_str(&text).unwrap()
        })
        .collect()
}

#[test]
fn collectives_across_two_ranks_give_accelerates_values() {
    let dir = scratch("two");
    let out = mpirun(2, "child_collectives", "normal", &dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
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
        assert_eq!(got["broadcast"], serde_json::json!([1.0, 2.0]));
        assert_eq!(got["objects"], serde_json::json!([0, 1]));
        assert_eq!(got["scalars"], serde_json::json!([0.0, 10.0]));
        assert_eq!(got["unequal_shape"], serde_json::json!([3, 3]));
        assert_eq!(
            got["unequal"],
            serde_json::json!([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
        );
        assert_eq!(got["word"], "from rank 1");
    }
}

#[test]
fn three_ranks_gather_unequal_rows_in_rank_order() {
    let dir = scratch("three");
    let out = mpirun(3, "child_collectives", "normal", &dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ranks = results(&dir, 3);
    for got in &ranks {
        assert_eq!(got["unequal_shape"], serde_json::json!([6, 3]));
        assert_eq!(got["sum"], serde_json::json!([9.0, 12.0]));
        assert_eq!(got["objects"], serde_json::json!([0, 1, 2]));
    }
}

#[test]
fn a_rank_that_exits_stops_the_job_naming_it() {
    let started = Instant::now();
    let out = mpirun(2, "child_collectives", "exit", &scratch("exit"));
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
    let out = mpirun(2, "child_collectives", "hang", &scratch("hang"));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 0: all_reduce did not complete within 3s on rank 0 of 2"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "the hung rank does not hold the job for its 60 s"
    );
}
