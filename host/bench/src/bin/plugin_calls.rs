//! What one plugin call costs, per call, on this machine (a benchmark, not a
//! test: nothing is asserted). `make bench-plugins` runs it beside the
//! end-to-end measurement in examples/bench/plugin_overhead.py.
//!
//! - `scheduler.lrs`: the call the training loop makes every step;
//! - `TrackerHub::log`: what the training loop pays to log (a queue push);
//! - `tracker.log`: what the tracker thread then pays, per tracker.

use hearth::accelerator::TrackerHub;
use hearth::plugins::{
    load_scheduler, load_tracker, PluginSource, Registry, RunInfo, SearchPath, Value,
};
use std::time::Instant;

fn entries(step: u64) -> Vec<(String, Value)> {
    vec![
        ("loss".into(), Value::Float(1.0 / (step as f64 + 1.0))),
        ("lr".into(), Value::Float(2e-3)),
        ("tokens_per_sec".into(), Value::Float(10_000.0)),
    ]
}

fn per_call(n: u64, mut f: impl FnMut(u64)) -> f64 {
    for i in 0..n.min(100) {
        f(i); // warm-up
    }
    let start = Instant::now();
    for i in 0..n {
        f(i);
    }
    start.elapsed().as_secs_f64() * 1e6 / n as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The built-in plugins `make plugins` installs (this binary is not beside them).
    let builtin = std::env::var_os("HEARTH_BUILTIN_PLUGINS")
        .map(Into::into)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/plugins")
        });
    let registry = Registry::discover(&SearchPath::only([(PluginSource::BuiltIn, builtin)]))?;
    let run = RunInfo {
        project: "bench".into(),
        run: "calls".into(),
        process_index: 0,
        num_processes: 1,
    };
    let scratch = std::env::temp_dir().join(format!("hearth-plugin-calls-{}", std::process::id()));

    let mut schedule = load_scheduler(
        &registry.find("linear")?.manifest,
        r#"{"warmup-steps": 100}"#,
        &[2e-3],
        Some(1_000_000),
    )?;
    let us = per_call(20_000, |i| {
        schedule.lrs(i).expect("linear never fails");
    });
    println!("scheduler `linear`  lrs(step)          {us:7.2} µs/call");

    for name in ["jsonl", "csv", "tensorboard", "mlflow", "dvclive", "wandb"] {
        let mut tracker = load_tracker(&registry.find(name)?.manifest, &scratch.join(name))?;
        tracker.start(run.clone(), entries(0));
        let values = entries(1);
        let us = per_call(2_000, |i| tracker.log(i, &values));
        tracker.finish();
        assert_eq!(tracker.faults(), 0, "{name} faulted");
        println!(
            "tracker `{name:<11}` log (3 values)     {us:7.2} µs/call (on the tracker thread)"
        );
    }

    let names = ["jsonl", "tensorboard", "mlflow"];
    let trackers = names
        .iter()
        .map(|n| {
            load_tracker(
                &registry.find(n).unwrap().manifest,
                &scratch.join(format!("hub-{n}")),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let hub = TrackerHub::start(trackers, run, entries(0));
    let n = 2_000;
    let start = Instant::now();
    for i in 0..n {
        hub.log(i, entries(i));
    }
    let enqueue = start.elapsed().as_secs_f64() * 1e6 / n as f64;
    let start = Instant::now();
    hub.finish();
    let drain = start.elapsed().as_secs_f64() * 1e3;
    println!("TrackerHub::log ({})  {enqueue:7.2} µs/call (on the training loop; {drain:.0} ms to drain at finish)", names.join("+"));
    std::fs::remove_dir_all(&scratch)?;
    Ok(())
}
