//! `hearth run` under mpirun: a run of two ranks resumes to the weights
//! of an unbroken one, and takes its backend and gradient averaging from
//! its config.

use hearth_testkit::{self as common, scratch, Limited};
use std::process::Output;

/// `hearth run` in `n` ranks under mpirun; a rank's lines come as
/// `[rank r] …` ([`common::ranked`]).
fn hearth_run(n: usize, config: &std::path::Path, args: &[&str]) -> Output {
    let run = common::mpirun_base(n)
        .arg("--tag-output")
        .arg(env!("CARGO_BIN_EXE_hearth"))
        .arg("run")
        .arg(config)
        .args(args)
        .run()
        .expect("mpirun runs");
    common::ranked(run)
}

/// A short `hearth run` job for two ranks: the tiny job, 24 steps, saving
/// halfway.
fn two_rank_job() -> common::TinyJob {
    super::six_digit_job("two", 24)
        .set("run", "log-every", 12)
        .set("run", "save-every", 12)
        .set("eval", "samples", 50)
}

#[test]
fn hearth_run_on_two_ranks_resumes_to_the_weights_of_an_unbroken_run() {
    let dir = scratch("run");
    let config = dir.join("job.toml");
    std::fs::write(&config, two_rank_job().toml()).unwrap();
    let (whole, broken) = (dir.join("whole"), dir.join("broken"));
    let out = hearth_run(
        2,
        &config,
        &["--quiet", "--output-dir", whole.to_str().unwrap()],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.matches("final training loss").count(),
        1,
        "the main process reports: {stdout}"
    );
    // The ranks scored 25 held-out strings each; the report has all 50.
    let summary = std::fs::read_to_string(whole.join("two/summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    assert_eq!(summary["eval"]["samples"], 50, "{summary}");
    let broken_dir = ["--quiet", "--output-dir", broken.to_str().unwrap()];
    let out = hearth_run(2, &config, &[&broken_dir[..], &["--steps", "12"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Rank 0 wrote the shared state, each rank its generators and data stream.
    let first = broken.join("two/checkpoints/checkpoint_0");
    let manifest = std::fs::read_to_string(first.join("hearth_checkpoint.json")).unwrap();
    for name in [
        "model.safetensors",
        "optimizer.safetensors",
        "random_states_0.safetensors",
        "random_states_1.safetensors",
        "custom_checkpoint_0_0.bin",
        "custom_checkpoint_0_1.bin",
    ] {
        assert!(first.join(name).is_file(), "{name}");
        assert!(
            manifest.contains(&format!("\"{name}\"")),
            "{name} in {manifest}"
        );
    }
    assert_ne!(
        std::fs::read(first.join("custom_checkpoint_0_0.bin")).unwrap(),
        std::fs::read(first.join("custom_checkpoint_0_1.bin")).unwrap(),
        "the ranks draw different batches"
    );
    let out = hearth_run(2, &config, &[&broken_dir[..], &["--resume"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("at step 13"));
    assert_eq!(
        std::fs::read(whole.join("two/model.safetensors")).unwrap(),
        std::fs::read(broken.join("two/model.safetensors")).unwrap(),
        "resumed on 2 ranks = never stopped"
    );
}

fn gradient_sync(run_dir: &std::path::Path) -> serde_json::Value {
    let summary = std::fs::read_to_string(run_dir.join("summary.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&summary).unwrap()["gradient_sync"].clone()
}

#[test]
fn hearth_run_takes_its_backend_and_gradient_averaging_from_its_config() {
    let dir = scratch("run-distributed");
    let (plain, tuned) = (dir.join("plain.toml"), dir.join("tuned.toml"));
    let job = two_rank_job().remove("run", "save-every").toml();
    std::fs::write(&plain, &job).unwrap();
    let distributed = "[distributed]\nbackend = \"mpi\"\ntimeout = 120\nbucket-cap-mb = 0.01\ncomm-hook = \"bf16\"\n";
    std::fs::write(&tuned, format!("{job}\n{distributed}")).unwrap();
    for config in [&plain, &tuned] {
        let out = hearth_run(
            2,
            config,
            &[
                "--quiet",
                "--output-dir",
                dir.to_str().unwrap(),
                "--steps",
                "6",
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::rename(dir.join("two"), config.with_extension("")).unwrap();
    }
    // NCCL asked for on the CPU: refused on each rank, naming the key.
    let nccl = dir.join("nccl.toml");
    std::fs::write(&nccl, format!("{job}\n[distributed]\nbackend = \"nccl\"\n")).unwrap();
    let out = hearth_run(
        2,
        &nccl,
        &["--quiet", "--output-dir", dir.to_str().unwrap()],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("NCCL backend needs a GPU") && stderr.contains("[distributed] backend"),
        "{stderr}"
    );
    let (plain, tuned) = (
        gradient_sync(&dir.join("plain")),
        gradient_sync(&dir.join("tuned")),
    );
    // One bucket of 25 MiB holds the whole tiny model; 10 KiB buckets split it.
    assert_eq!(plain["syncs"], 6, "{plain}");
    assert_eq!(plain["all_reduces"], 6, "{plain}");
    assert_eq!(tuned["syncs"], 6, "{tuned}");
    assert!(tuned["all_reduces"].as_u64().unwrap() > 6, "{tuned}");
    // bf16 on the wire: half of float32's bytes, the same values counted.
    assert_eq!(
        2 * tuned["bytes"].as_u64().unwrap(),
        plain["bytes"].as_u64().unwrap(),
        "{plain} {tuned}"
    );
}
