//! The `jsonl` tracker: `/logs/config.json` holds the run and its config,
//! `/logs/metrics.jsonl` one object per `log` call: `{"step": 10, "loss": 0.5}`.

use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use serde_json::{json, Map};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};

fn to_json(value: Value) -> serde_json::Value {
    match value {
        Value::Float(v) => json!(v),
        Value::Int(v) => json!(v),
        Value::Boolean(v) => json!(v),
        Value::Text(v) => json!(v),
    }
}

fn object(entries: Entries) -> Map<String, serde_json::Value> {
    entries.into_iter().map(|(k, v)| (k, to_json(v))).collect()
}

#[derive(Default)]
struct Jsonl {
    metrics: Option<BufWriter<File>>,
}

impl Tracker for Jsonl {
    fn start(&mut self, start: Start) -> Result<(), String> {
        let (run, config) = (start.run, start.config);
        let doc = json!({ "project": run.project, "run": run.run, "config": object(config) });
        std::fs::write("/logs/config.json", doc.to_string())
            .map_err(|e| format!("config.json: {e}"))?;
        // Append: after a fault the host re-instantiates the tracker and replays
        // `start`; earlier lines must survive.
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open("/logs/metrics.jsonl")
            .map_err(|e| format!("metrics.jsonl: {e}"))?;
        self.metrics = Some(BufWriter::new(file));
        Ok(())
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        let out = self.metrics.as_mut().ok_or("log called before start")?;
        let mut line = Map::new();
        line.insert("step".into(), json!(step));
        line.extend(object(values));
        writeln!(out, "{}", serde_json::Value::Object(line)).map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())
    }

    fn finish(&mut self) -> Result<(), String> {
        if let Some(mut out) = self.metrics.take() {
            out.flush().map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

export_tracker!(Jsonl);
