//! Trackers through the Accelerator: by name, with `get_tracker`, and in
//! the tracker thread's batches.

use hearth_testkit as common;

use hearth::accelerator::Accelerator;
use serde_json::Value;

use crate::Place;

#[test]
fn get_tracker_logs_to_that_tracker_alone_and_names_the_ones_there_are() {
    use hearth::plugins::{load_tracker, Manifest, Value as Logged};
    let work = common::scratch("get-tracker");
    let tracker = |name: &str| {
        let dir = common::repo_root().join("target/plugins").join(name);
        let manifest =
            Manifest::read(&dir).expect("built-in plugins are installed: run `make plugins`");
        load_tracker(&manifest, &work.join(name)).unwrap()
    };
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let none = acc.get_tracker("jsonl").err().expect("no trackers yet");
    assert_eq!(
        none.to_string(),
        "jsonl is not one of the run's trackers (it has none); trackers are started by init_trackers"
    );
    acc.init_trackers("p", "r", vec![tracker("jsonl"), tracker("csv")], Vec::new());
    // Both trackers (and every other loaded in this process) share their
    // world's one linker.
    let kind = hearth::plugins::PluginKind::Tracker;
    assert_eq!(hearth::plugins::linkers_built(kind, false), 1);
    let jsonl = acc.get_tracker("jsonl").unwrap();
    assert_eq!(jsonl.name(), "jsonl");
    jsonl.log(vec![("only_jsonl".into(), Logged::Float(1.5))], 3);
    acc.log(vec![("both".into(), Logged::Float(2.5))], 4);
    let err = acc.get_tracker("wandb").err().expect("not there");
    assert_eq!(
        err.to_string(),
        "wandb is not one of the run's trackers (jsonl, csv); trackers are started by init_trackers"
    );
    acc.end_training().unwrap();
    let lines = std::fs::read_to_string(work.join("jsonl/metrics.jsonl")).unwrap();
    let lines: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["only_jsonl"], 1.5);
    assert_eq!(lines[1]["both"], 2.5);
    let csv = std::fs::read_to_string(work.join("csv/metrics.csv")).unwrap();
    assert!(!csv.contains("only_jsonl") && csv.contains("both"), "{csv}");
}

/// The tracker thread takes what was logged in batches, a second apart
/// (`accelerator/trackers.rs`): a value logged while it waits goes with
/// the next batch, and the end of training delivers what is left at once.
#[test]
fn trackers_take_logged_values_in_batches_and_the_end_delivers_the_rest() {
    use hearth::plugins::{load_tracker, Manifest, Value as Logged};
    use std::time::{Duration, Instant};
    let work = common::scratch("tracker-batches");
    let dir = common::repo_root().join("target/plugins/jsonl");
    let manifest =
        Manifest::read(&dir).expect("built-in plugins are installed: run `make plugins`");
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    acc.init_trackers(
        "p",
        "r",
        vec![load_tracker(&manifest, &work).unwrap()],
        Vec::new(),
    );
    let file = work.join("metrics.jsonl");
    let steps_in_file = || -> Vec<u64> {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        text.lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect()
    };
    acc.log(vec![("a".into(), Logged::Float(1.0))], 1);
    let waiting = Instant::now();
    while steps_in_file().is_empty() {
        assert!(
            waiting.elapsed() < Duration::from_secs(30),
            "step 1 never arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Step 1's batch was taken whole before it was written, so step 2 goes
    // with the next batch, a second later.
    let delivered = Instant::now();
    acc.log(vec![("a".into(), Logged::Float(2.0))], 2);
    std::thread::sleep(Duration::from_millis(200));
    let seen = steps_in_file();
    if delivered.elapsed() < Duration::from_millis(800) {
        assert_eq!(seen, [1], "step 2 waits for the next batch");
    }
    acc.end_training().unwrap();
    assert_eq!(steps_in_file(), [1, 2]);
}

/// Trackers by name (Accelerate's `log_with` and `init_trackers`): the
/// config is any serialisable value, flattened with dots; `log_scalars`
/// takes plain pairs; only the main process finds, loads and gives folders
/// to trackers; an unknown name is an error naming it.
#[test]
fn trackers_by_name_take_a_serialised_config_and_only_the_main_process_makes_their_folders() {
    let work = common::scratch("log-with");
    let config = serde_json::json!({"lr": 0.1, "model": {"layers": 2, "kind": "gpt"}, "tags": ["a"], "none": null});
    for rank in [0, 1] {
        let dir = work.join(format!("rank{rank}"));
        let mut acc = Accelerator::builder()
            .cpu(true)
            .process_group(Box::new(Place { rank }))
            .project_config(hearth::accelerator::ProjectConfiguration {
                project_dir: dir.clone(),
                ..Default::default()
            })
            .log_with(["jsonl"])
            .build()
            .unwrap();
        acc.init_trackers_named("proj", &config).unwrap();
        acc.log_scalars(&[("loss", 1.25), ("lr", 0.1)], 3);
        #[derive(serde::Serialize)]
        struct Eval {
            accuracy: f64,
            samples: u32,
        }
        #[derive(serde::Serialize)]
        struct Metrics {
            eval: Eval,
        }
        let eval = Eval {
            accuracy: 0.5,
            samples: 64,
        };
        acc.log_serialized(&Metrics { eval }, 4).unwrap();
        acc.end_training().unwrap();
        let folder = dir.join("trackers").join("jsonl");
        if rank == 1 {
            assert!(
                !dir.join("trackers").exists(),
                "rank 1 made {}",
                folder.display()
            );
            continue;
        }
        let written: Value =
            serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(written["project"], "proj");
        assert_eq!(
            written["config"],
            serde_json::json!({"lr": 0.1, "model.layers": 2, "model.kind": "gpt", "tags": "[\"a\"]"})
        );
        let lines: Vec<Value> = std::fs::read_to_string(folder.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(
            lines,
            [
                serde_json::json!({"step": 3, "loss": 1.25, "lr": 0.1}),
                serde_json::json!({"step": 4, "eval.accuracy": 0.5, "eval.samples": 64})
            ]
        );
    }
    let mut acc = Accelerator::builder()
        .cpu(true)
        .log_with(["no-such-tracker"])
        .build()
        .unwrap();
    let err = acc
        .init_trackers_named("proj", &config)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no plugin named `no-such-tracker`"), "{err}");
}
