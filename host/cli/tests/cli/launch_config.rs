//! The launch config: `hearth config --launch` writes what Accelerate's
//! `write_basic_config` does, and `hearth launch` takes from it what its
//! flags leave out.

use super::{hearth, text};
use hearth_testkit::{self as common, Limited};

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
