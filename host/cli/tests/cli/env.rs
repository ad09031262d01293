//! `hearth env` as a user reads it: who started the process, the CPU
//! kernels' path, whether libtorch_cuda was opened, and Accelerate's
//! environment checks.

use super::{hearth, text};
use hearth_testkit::{self as common, Limited};
use std::process::Command;

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
