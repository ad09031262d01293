//! `hearth launch` as a user runs it: the same ranks whoever starts the
//! processes, `[rank k]` prefixes, and a failed rank that stops the job,
//! named, with nothing left behind.

use common::Limited;
use hearth_testkit as common;

use super::{hearth, text, HEARTH};
use std::process::Command;
use std::time::{Duration, Instant};

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
    let out = hearth_testkit::mpirun_base(3)
        .args([HEARTH, "env", "--json"])
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

/// A process launched alone may use every core this one may, with as
/// many threads: mpirun does not pin it to one core (it pins each of up to
/// 2 processes to a core, where 2 threads of one process would halve its
/// speed); several processes share the cores, one thread each here.
#[test]
fn a_launched_process_keeps_the_cores_its_threads_need() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    for (n, threads) in [(1, cores), (cores, 1)] {
        let out = hearth(&[
            "launch",
            "-n",
            &n.to_string(),
            "--cpu",
            "--",
            HEARTH,
            "env",
            "--json",
        ])
        .env_remove("OMP_NUM_THREADS")
        .run()
        .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let json: serde_json::Value =
                serde_json::from_str(&line[line.find('{').unwrap()..]).unwrap();
            let cpu = &json["cpu"];
            assert_eq!(
                cpu["threads"].as_u64(),
                Some(threads),
                "{n} processes: {line}"
            );
            assert!(
                cpu["cores_usable"].as_u64().unwrap() >= threads,
                "{n} processes: {line}"
            );
        }
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
