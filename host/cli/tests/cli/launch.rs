//! `hearth launch`, `hearth env` and `hearth config` as a user runs them:
//! the same ranks whoever starts the processes, `[rank k]` prefixes, and a
//! failed rank that stops the job, named, with nothing left behind.

use common::Limited;
use hearth_testkit as common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

const HEARTH: &str = env!("CARGO_BIN_EXE_hearth");

fn hearth(args: &[&str]) -> Command {
    let mut cmd = Command::new(HEARTH);
    cmd.args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // No default launch config of the user's (hearth config --launch).
        .env("HEARTH_CONFIG_DIR", "/nonexistent/hearth-tests");
    for var in ["OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", "RANK", "SLURM_NTASKS"] {
        cmd.env_remove(var);
    }
    cmd
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// (rank, world, local rank, local world, launcher) of each JSON line of
/// `hearth env --json`, by rank; a `[rank k] ` prefix must match the rank.
fn places(stdout: &[u8]) -> Vec<(u64, u64, u64, u64, String)> {
    let mut found: Vec<_> = String::from_utf8_lossy(stdout)
        .lines()
        .map(|line| {
            let (prefix, json) = line.split_at(line.find('{').expect("a JSON line"));
            let v: serde_json::Value = serde_json::from_str(json).unwrap();
            let l = &v["launch"];
            let place = (
                l["rank"].as_u64().unwrap(),
                l["world_size"].as_u64().unwrap(),
                l["local_rank"].as_u64().unwrap(),
                l["local_world_size"].as_u64().unwrap(),
                l["launcher"].as_str().unwrap().to_string(),
            );
            if !prefix.is_empty() {
                assert_eq!(prefix, format!("[rank {}] ", place.0));
            }
            place
        })
        .collect();
    found.sort();
    found
}

fn ranks_only(p: &[(u64, u64, u64, u64, String)]) -> Vec<(u64, u64, u64, u64)> {
    p.iter().map(|x| (x.0, x.1, x.2, x.3)).collect()
}

#[test]
fn every_launcher_gives_the_same_ranks() {
    let want = vec![(0, 3, 0, 3), (1, 3, 1, 3), (2, 3, 2, 3)];
    // hearth launch, CPU: through mpirun.
    let out = hearth(&["launch", "-n", "3", "--cpu", "--", HEARTH, "env", "--json"])
        .run()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let launched = places(&out.stdout);
    assert_eq!(ranks_only(&launched), want);
    assert!(launched.iter().all(|p| p.4 == "mpirun"));
    // hearth launch, spawn mode: torchrun's variables.
    let out = hearth(&[
        "launch",
        "-n",
        "3",
        "--launcher",
        "spawn",
        "--",
        HEARTH,
        "env",
        "--json",
    ])
    .run()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let spawned = places(&out.stdout);
    assert_eq!(ranks_only(&spawned), want);
    assert!(spawned.iter().all(|p| p.4 == "torchrun"));
    // mpirun directly.
    let out = Command::new("mpirun")
        .args(["--oversubscribe", "-n", "3", HEARTH, "env", "--json"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .run()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(ranks_only(&places(&out.stdout)), want);
    // torchrun's and srun's variables set by hand.
    for (vars, launcher) in [
        (
            ["WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            "torchrun",
        ),
        (
            [
                "SLURM_NTASKS",
                "SLURM_PROCID",
                "SLURM_LOCALID",
                "SLURM_NTASKS_PER_NODE",
            ],
            "slurm",
        ),
    ] {
        let mut by_hand = Vec::new();
        for r in 0..3 {
            let out = hearth(&["env", "--json"])
                .env(vars[0], "3")
                .env(vars[1], r.to_string())
                .env(vars[2], r.to_string())
                .env(vars[3], "3")
                .run()
                .unwrap();
            assert!(out.status.success(), "{}", text(&out));
            by_hand.extend(places(&out.stdout));
        }
        assert_eq!(ranks_only(&by_hand), want, "{launcher}");
        assert!(by_hand.iter().all(|p| p.4 == launcher));
    }
}

/// A rank that fails stops the job: the launcher exits with its status
/// naming it, promptly, and no process of the job is left.
fn failing_job(mode: &str, rank_var: &str) {
    // A sleep no other process runs: what pgrep looks for afterwards.
    let which = if mode == "spawn" { 1 } else { 2 };
    let marker = format!("sleep 60.{which}{}", std::process::id() % 100_000);
    let script =
        format!("echo ready; if [ ${rank_var} = 1 ]; then sleep 0.5; exit 3; fi; {marker}");
    let started = Instant::now();
    let out = hearth(&[
        "launch",
        "-n",
        "2",
        "--launcher",
        mode,
        "--",
        "sh",
        "-c",
        &script,
    ])
    .run()
    .unwrap();
    let all = text(&out);
    assert_eq!(out.status.code(), Some(3), "{all}");
    assert!(
        all.contains("error: rank 1 exited with status 3; the other processes were stopped"),
        "{all}"
    );
    assert!(
        all.contains("[rank 0] ready") && all.contains("[rank 1] ready"),
        "{all}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "stopped promptly"
    );
    std::thread::sleep(Duration::from_millis(300));
    let left = Command::new("pgrep").args(["-f", &marker]).run().unwrap();
    assert!(
        left.stdout.is_empty(),
        "left behind: {}",
        String::from_utf8_lossy(&left.stdout)
    );
}

#[test]
fn a_failed_rank_stops_an_mpirun_job_naming_the_rank() {
    failing_job("mpirun", "OMPI_COMM_WORLD_RANK");
}

#[test]
fn a_failed_rank_stops_a_spawned_job_naming_the_rank() {
    failing_job("spawn", "RANK");
}

#[test]
fn launch_trains_a_config_on_two_cpu_processes() {
    let dir = common::scratch("launch-run");
    let config = dir.join("hearth.toml");
    // `hearth config` writes the default job; shortened here.
    let out = hearth(&["config", config.to_str().unwrap()]).run().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let again = hearth(&["config", config.to_str().unwrap()]).run().unwrap();
    assert_eq!(again.status.code(), Some(2), "an existing file is kept");
    assert!(text(&again).contains("--force"));
    // After `--`, flags for `hearth run` (the default job is shortened).
    let out = hearth(&[
        "launch",
        "-n",
        "2",
        "--cpu",
        config.to_str().unwrap(),
        "--",
        "--steps",
        "20",
        "--quiet",
        "--output-dir",
        dir.to_str().unwrap(),
    ])
    .run()
    .unwrap();
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert_eq!(all.matches("final training loss").count(), 1, "{all}");
    assert!(all.contains("[rank 0] final training loss"), "{all}");
    assert!(dir.join("sort-digits/model.safetensors").is_file());
}

#[test]
fn a_bad_config_is_refused_once_before_any_process_starts() {
    let dir = common::scratch("launch-bad");
    let bad = dir.join("bad.toml");
    let job =
        "[run]\nname = \"x\"\nsteps = 0\n[model]\nkind = \"gpt\"\n[data]\nkind = \"sort-digits\"\n";
    std::fs::write(&bad, job).unwrap();
    // A missing file names the file; an invalid value names its key.
    for (config, named) in [
        (dir.join("missing.toml"), "missing.toml"),
        (bad, "run.steps"),
    ] {
        let out = hearth(&["launch", "-n", "2", "--cpu", config.to_str().unwrap()])
            .run()
            .unwrap();
        let all = text(&out);
        assert_eq!(out.status.code(), Some(2), "{all}");
        assert_eq!(all.matches(named).count(), 1, "{all}");
        assert!(!all.contains("[rank"), "no process was started: {all}");
    }
    // Restarting one machine's processes of a job over several cannot work.
    let out = hearth(&[
        "launch",
        "-n",
        "1",
        "--launcher",
        "spawn",
        "--nnodes",
        "2",
        "--max-restarts",
        "1",
        "--",
        "true",
    ])
    .run()
    .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--max-restarts with --nnodes 2"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_line_a_process_writes_in_pieces_arrives_whole_under_mpirun() {
    // Two writes 0.3 s apart: mpirun tags each piece separately.
    let script = "printf 'first half, '; sleep 0.3; printf 'second half\\n'; printf 'err ' >&2; sleep 0.3; echo 'line' >&2";
    let out = hearth(&["launch", "-n", "2", "--cpu", "--", "sh", "-c", script])
        .run()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    for rank in 0..2 {
        let whole = format!("[rank {rank}] first half, second half\n");
        assert!(stdout.contains(&whole), "{stdout}");
        assert!(
            stderr.contains(&format!("[rank {rank}] err line\n")),
            "{stderr}"
        );
    }
    assert!(!stdout.contains("<stdout>") && !stderr.contains("<stderr>"));
}

/// `hearth env` in words: a process no launcher started says so (it
/// printed Rust's `None` once).
#[test]
fn env_says_in_words_who_started_the_process() {
    let out = hearth(&["env"]).run().unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("rank 0 of 1 (local 0 of 1), started by no launcher"),
        "{said}"
    );
    assert!(!said.contains("None"), "{said}");
}

/// `hearth env` names the path of hearth's CPU kernels, in words and in
/// JSON, with the CPU's model and libtorch's level: avx512 where the CPU
/// has AVX-512F, AVX2 and FMA (as Rust's own feature detection finds them)
/// and libtorch runs at AVX-512, avx2 where it has AVX2 and FMA or libtorch
/// is pinned to AVX2, libtorch's own operators when `HEARTH_CPU_KERNELS=off`
/// or `ATEN_CPU_CAPABILITY` pins libtorch below AVX2; a value it cannot
/// honour is shown in `env` and refused by `hearth run` (exit 2, naming the
/// variable).
#[test]
fn env_names_the_cpu_kernels_path_and_run_refuses_a_bad_one() {
    #[cfg(target_arch = "x86_64")]
    let (has, has512) = {
        let has = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        (has, has && std::arch::is_x86_feature_detected!("avx512f"))
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (has, has512) = (false, false);
    let env_json = |vars: &[(&str, &str)]| -> serde_json::Value {
        let mut cmd = hearth(&["env", "--json"]);
        cmd.env_remove("HEARTH_CPU_KERNELS")
            .env_remove("ATEN_CPU_CAPABILITY");
        cmd.envs(vars.iter().copied());
        let out = cmd.run().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let v = env_json(&[]);
    let libtorch_at_avx512 = v["cpu"]["libtorch_level"] == "AVX512";
    let best = match (has, has512 && libtorch_at_avx512) {
        (true, true) => "avx512",
        (true, false) => "avx2",
        _ => "off",
    };
    assert_eq!(v["cpu"]["kernels"], best, "{v}");
    assert_eq!(v["cpu"]["avx2_fma"], has, "{v}");
    assert_eq!(v["cpu"]["avx512f"], has512, "{v}");
    assert!(!v["cpu"]["model"].as_str().unwrap().is_empty(), "{v}");
    assert!(
        !v["cpu"]["libtorch_level"].as_str().unwrap().is_empty(),
        "{v}"
    );
    let v = env_json(&[("HEARTH_CPU_KERNELS", "off")]);
    assert_eq!(v["cpu"]["kernels"], "off", "{v}");
    assert_eq!(v["cpu"]["kernels_why"], "HEARTH_CPU_KERNELS=off", "{v}");
    let v = env_json(&[("ATEN_CPU_CAPABILITY", "default")]);
    assert_eq!(v["cpu"]["libtorch_level"], "DEFAULT", "{v}");
    assert_eq!(v["cpu"]["kernels"], "off", "{v}");
    if has {
        let v = env_json(&[("ATEN_CPU_CAPABILITY", "avx2")]);
        assert_eq!(v["cpu"]["libtorch_level"], "AVX2", "{v}");
        assert_eq!(v["cpu"]["kernels"], "avx2", "{v}");
        if has512 {
            let why = v["cpu"]["kernels_why"].as_str().unwrap();
            assert!(why.contains("(ATEN_CPU_CAPABILITY=avx2)"), "{v}");
        }
    }
    let v = env_json(&[("HEARTH_CPU_KERNELS", "avx512")]);
    assert_eq!(
        v["cpu"]["kernels"],
        if has512 { "avx512" } else { "invalid" },
        "{v}"
    );

    let mut cmd = hearth(&["env"]);
    cmd.env_remove("HEARTH_CPU_KERNELS")
        .env_remove("ATEN_CPU_CAPABILITY");
    let said = text(&cmd.run().unwrap());
    let words = format!("hearth's CPU kernels: {best}");
    assert!(said.contains(&words), "{said}");

    let run = hearth(&["run", "/nonexistent/config.toml"])
        .env("HEARTH_CPU_KERNELS", "fastest")
        .run()
        .unwrap();
    assert_eq!(run.status.code(), Some(2), "{}", text(&run));
    assert!(
        text(&run).contains("HEARTH_CPU_KERNELS=\"fastest\" is not a kernel path"),
        "{}",
        text(&run)
    );
}

/// Issue 18, item 6: `hearth launch` gives every rank of a job the same
/// random job token for the rendezvous store, a new one per job, or the
/// one set in `HEARTH_JOB_TOKEN` (the same on every machine of a job).
#[test]
fn a_spawned_job_shares_a_random_token_of_its_own() {
    let tokens = |given: Option<&str>| -> Vec<String> {
        let mut cmd = hearth(&[
            "launch",
            "-n",
            "2",
            "--launcher",
            "spawn",
            "--",
            "sh",
            "-c",
            "echo token=$HEARTH_JOB_TOKEN",
        ]);
        match given {
            Some(t) => cmd.env("HEARTH_JOB_TOKEN", t),
            None => cmd.env_remove("HEARTH_JOB_TOKEN"),
        };
        let out = cmd.run().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split("token=").nth(1).map(str::to_owned))
            .collect()
    };
    let first = tokens(None);
    assert_eq!(first.len(), 2);
    assert_eq!(first[0], first[1], "every rank gets the job's token");
    assert!(
        first[0].len() == 32 && first[0].chars().all(|c| c.is_ascii_hexdigit()),
        "{first:?}"
    );
    assert_ne!(tokens(None)[0], first[0], "each job gets its own");
    assert_eq!(
        tokens(Some("shared-secret")),
        ["shared-secret", "shared-secret"]
    );
}

/// A two-rank job long enough to be killed in the middle: the tiny job,
/// 300 steps, a checkpoint every 10.
fn elastic_job() -> String {
    super::six_digit_job("elastic", 300)
        .set("run", "log-every", 100)
        .set("run", "save-every", 10)
        .set("run", "keep-checkpoints", 3)
        .toml()
}

/// Issue 18, elastic restart: `hearth launch --max-restarts 2` starts
/// both ranks again when one is killed (SIGKILL, after the run's first
/// checkpoints), the restarted `hearth run` continues from the newest
/// complete checkpoint, and the final weights are those of a run nobody
/// killed.
#[test]
fn a_killed_rank_restarts_the_job_from_its_newest_checkpoint_to_the_unbroken_weights() {
    let dir = common::scratch("elastic");
    let config = dir.join("elastic.toml");
    std::fs::write(&config, elastic_job()).unwrap();
    let (whole, broken) = (dir.join("whole"), dir.join("broken"));
    let run = |out: &std::path::Path, restarts: &str| {
        common::start(&mut hearth(&[
            "launch",
            "-n",
            "2",
            "--cpu",
            "--max-restarts",
            restarts,
            config.to_str().unwrap(),
            "--",
            "--quiet",
            "--output-dir",
            out.to_str().unwrap(),
        ]))
        .unwrap()
    };
    let unbroken = run(&whole, "0").finish(common::limit());
    assert!(unbroken.status.success(), "{}", text(&unbroken));

    let job = run(&broken, "2");
    let second = broken.join("elastic/checkpoints/checkpoint_1/hearth_checkpoint.json");
    let started = Instant::now();
    while !second.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A rank (not mpirun): its command line starts with the binary (by
    // whatever path it was started: links resolved or not).
    let rank = format!(r"^\S*hearth run {}", config.display());
    let pids = Command::new("pgrep").args(["-f", &rank]).run().unwrap();
    let pid = String::from_utf8_lossy(&pids.stdout)
        .lines()
        .next()
        .expect("a rank is running")
        .to_string();
    assert!(Command::new("kill")
        .args(["-9", &pid])
        .run()
        .unwrap()
        .status
        .success());
    let out = job.finish(common::limit());
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains("starting every process again (restart 1 of 2)"),
        "{all}"
    );
    assert!(all.contains("resumed from"), "{all}");
    assert_eq!(
        std::fs::read(whole.join("elastic/model.safetensors")).unwrap(),
        std::fs::read(broken.join("elastic/model.safetensors")).unwrap(),
        "restarted after a kill = never killed"
    );
}

/// libtorch_cuda is not linked (start-up and memory, issue 22): without a
/// driver hearth never maps it; with one (here a stand-in `libcuda.so.1`
/// whose cuInit fails, as a driver without a GPU does) it is opened at
/// start, `hearth env` says so, and a CPU run still trains.
#[test]
fn libtorch_cuda_is_opened_only_where_a_driver_is() {
    let out = hearth(&["env", "--json"]).run().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runtime = v["cuda_runtime"].as_str().unwrap().to_string();

    let driver = tempfile::tempdir().unwrap();
    let source = driver.path().join("cuda.c");
    std::fs::write(&source, "int cuInit(unsigned flags) { return 100; }\n").unwrap();
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(driver.path().join("libcuda.so.1"))
        .arg(&source)
        .run()
        .unwrap();
    assert!(built.status.success(), "{}", text(&built));
    let with_driver = |args: &[&str]| {
        let mut cmd = hearth(args);
        cmd.env("LD_LIBRARY_PATH", driver.path());
        cmd.run().unwrap()
    };
    let out = with_driver(&["env", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let loaded = v["cuda_runtime"].as_str().unwrap();
    assert!(
        loaded.starts_with("loaded (") && loaded.ends_with("libtorch_cuda.so)"),
        "{loaded}"
    );
    assert_eq!(
        v["cuda_devices"], 0,
        "a driver without a GPU has no devices"
    );
    // Nothing to name, no versions to read, no graphs to capture.
    assert_eq!(v["gpus"], serde_json::json!([]));
    assert!(v["cuda_version"].is_null() && v["cudnn_version"].is_null());
    let graphs = v["cuda_graphs"].as_str().unwrap();
    assert!(
        graphs.starts_with("CUDA graphs are unavailable: no CUDA device"),
        "{graphs}"
    );
    assert_eq!(
        v["gpu_cross_entropy"], "no CUDA device",
        "no GPU, so hearth's GPU loss kernels are not tried"
    );

    // The machine's own driver decides what plain `hearth env` said.
    let machine_has_driver = std::path::Path::new("/dev/nvidiactl").exists();
    if !machine_has_driver {
        assert_eq!(
            runtime, "not loaded: no NVIDIA driver (libcuda.so.1)",
            "without a driver libtorch_cuda stays unopened"
        );
    }

    let out_dir = tempfile::tempdir().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/bench-gpt.toml");
    let out = with_driver(&[
        "run",
        config,
        "--quiet",
        "--steps",
        "2",
        "--output-dir",
        out_dir.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(out_dir.path().join("bench-gpt/model.safetensors").is_file());
}

/// `hearth::comm::environment` against Accelerate's own checks, run live in the
/// venv: torch's version, `is_torch_version` over every operation and
/// versions around, before and after the running one (pre-releases, dev and
/// post releases, a local part, fewer and more parts), `is_cuda_available`
/// and `is_bf16_available`; `hearth env --json` reports the same.
#[test]
fn environment_checks_give_accelerates_answers() {
    use hearth::comm::environment as env;
    let ops = [">", ">=", "==", "!=", "<=", "<", "=>", "~="];
    let versions = [
        "2",
        "2.11",
        "2.11.0",
        "2.11.0.0",
        "2.11.0rc1",
        "2.11.0.dev20251001",
        "2.11.0.post1",
        "2.11.0+cu130",
        "2.10.1",
        "2.12",
        "1.13.1",
        "3.0a1",
        "10",
        "2.11.1",
        "two",
    ];
    let pairs: Vec<String> = ops
        .iter()
        .flat_map(|op| versions.iter().map(move |v| format!("{op} {v}")))
        .collect();
    let args: Vec<&str> = pairs.iter().map(String::as_str).collect();
    let oracle: serde_json::Value =
        serde_json::from_str(&common::oracle("accelerate_environment.py", &args)).unwrap();
    assert_eq!(
        env::torch_version().to_string(),
        oracle["torch_version"].as_str().unwrap()
    );
    assert_eq!(env::is_cuda_available(), oracle["cuda"].as_bool().unwrap());
    assert_eq!(env::is_bf16_available(), oracle["bf16"].as_bool().unwrap());
    for (pair, expected) in pairs
        .iter()
        .zip(oracle["is_torch_version"].as_array().unwrap())
    {
        let (op, version) = pair.split_once(' ').unwrap();
        let ours = env::is_torch_version(op, version).ok();
        assert_eq!(
            ours,
            expected.as_bool(),
            "is_torch_version({op:?}, {version:?})"
        );
    }

    let out = hearth(&["env", "--json"]).run().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["torch"], oracle["torch_version"]);
    assert_eq!(v["available"]["cuda"], oracle["cuda"]);
    assert_eq!(v["available"]["bf16"], oracle["bf16"]);
    assert_eq!(v["available"]["mpi"], true, "hearth links Open MPI");
    assert_eq!(v["available"]["nccl"], env::is_nccl_available());
}

#[test]
fn config_launch_writes_what_accelerates_write_basic_config_does_and_keeps_it() {
    let dir = common::scratch("basic-config");
    let theirs = dir.join("accelerate.json");
    let said = common::oracle(
        "accelerate_basic_config.py",
        &["bf16", theirs.to_str().unwrap()],
    );
    assert_eq!(said.trim(), theirs.to_str().unwrap());
    let ours = dir.join("hearth.json");
    let out = hearth(&[
        "config",
        "--launch",
        "--mixed-precision",
        "bf16",
        ours.to_str().unwrap(),
    ])
    .run()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let read = |p: &std::path::Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    assert_eq!(read(&ours), read(&theirs));
    // Like Accelerate's (which returns False), an existing one is kept.
    std::fs::write(&ours, "{}").unwrap();
    let out = hearth(&["config", "--launch", ours.to_str().unwrap()])
        .run()
        .unwrap();
    assert!(
        out.status.success() && text(&out).contains("was kept"),
        "{}",
        text(&out)
    );
    assert_eq!(std::fs::read_to_string(&ours).unwrap(), "{}");
    let said = common::oracle(
        "accelerate_basic_config.py",
        &["no", theirs.to_str().unwrap()],
    );
    assert_eq!(said.lines().last(), Some("False"), "{said}");
}

#[test]
fn launch_takes_what_its_flags_leave_out_from_the_launch_config() {
    let dir = common::scratch("launch-config");
    let config = dir.join("launch.json");
    let mut basic = hearth::launch::basic_config(hearth::precision::MixedPrecision::Bf16);
    basic.num_processes = 2;
    basic.use_cpu = true;
    std::fs::write(&config, serde_json::to_string(&basic).unwrap()).unwrap();
    let show = "echo mp=$HEARTH_MIXED_PRECISION rank=$OMPI_COMM_WORLD_RANK";
    let run = |extra: &[&str]| {
        let mut args = vec!["launch", "--config-file", config.to_str().unwrap()];
        args.extend(extra);
        args.extend(["--", "/bin/sh", "-c", show]);
        let out = hearth(&args).run().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .collect();
        lines.sort();
        lines
    };
    assert_eq!(
        run(&[]),
        ["[rank 0] mp=bf16 rank=0", "[rank 1] mp=bf16 rank=1"]
    );
    // A flag wins over the file.
    assert_eq!(run(&["-n", "1"]), ["[rank 0] mp=bf16 rank=0"]);
    // A key hearth does not know is refused, naming it and the file.
    std::fs::write(
        &config,
        r#"{"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "mixed_precision": "no", "num_processes": 1, "fsdp_config": {}}"#,
    )
    .unwrap();
    let out = hearth(&[
        "launch",
        "--config-file",
        config.to_str().unwrap(),
        "--",
        "true",
    ])
    .run()
    .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("fsdp_config") && text(&out).contains("launch.json"),
        "{}",
        text(&out)
    );
}
