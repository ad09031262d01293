//! The `dvclive` tracker, with Accelerate's `DVCLiveTracker` semantics and
//! the files `dvclive.Live` writes (`/logs` is Live's `dir`):
//!
//! - `params.yaml`: the run config, dotted keys nested (`model.kind` →
//!   `model: {kind: …}`);
//! - `plots/metrics/<name>.tsv`: `step\t<last segment of name>` rows, one per
//!   logged step (names with `/` become folders);
//! - `metrics.json`: the latest value of every metric, nested on `/`, and `step`.
//!
//! Only numbers are metrics; text values are skipped, as DVCLive does.

use hearth_guest::files::{write_atomically, Appenders};
use hearth_guest::{export_tracker, Entries, Tracker, Value};
use serde_json::{json, Map, Value as Json};
use std::fs;

/// Inserts `value` at the path `parts` in a nested object.
fn insert(root: &mut Map<String, Json>, parts: &[&str], value: Json) {
    match parts {
        [] => {}
        [last] => {
            root.insert((*last).to_string(), value);
        }
        [first, rest @ ..] => {
            let child = root
                .entry(first.to_string())
                .or_insert_with(|| Json::Object(Map::new()));
            if !child.is_object() {
                *child = Json::Object(Map::new());
            }
            insert(
                child.as_object_mut().expect("made an object above"),
                rest,
                value,
            );
        }
    }
}

/// A YAML rendering of nested JSON scalars and objects.
fn yaml(out: &mut String, map: &Map<String, Json>, indent: usize) {
    for (key, value) in map {
        let key = serde_json::to_string(key).expect("a string serializes");
        match value {
            Json::Object(child) => {
                out.push_str(&format!("{:indent$}{key}:\n", ""));
                yaml(out, child, indent + 2);
            }
            // JSON scalars are valid YAML flow scalars.
            other => out.push_str(&format!("{:indent$}{key}: {other}\n", "")),
        }
    }
}

fn number(value: &Value) -> Option<Json> {
    match value {
        Value::Float(v) if v.is_finite() => Some(json!(v)),
        Value::Float(v) => Some(Json::String(v.to_string())),
        Value::Int(v) => Some(json!(v)),
        Value::Boolean(v) => Some(json!(u8::from(*v))),
        Value::Text(_) => None,
    }
}

#[derive(Default)]
struct DvcLive {
    started: bool,
    latest: Map<String, Json>,
    /// Open `.tsv` files.
    plots: Appenders,
}

impl Tracker for DvcLive {
    fn start(&mut self, start: hearth_guest::Start) -> Result<(), String> {
        let config = start.config;
        let mut params = Map::new();
        for (name, value) in config {
            let v = match value {
                Value::Float(v) => json!(v),
                Value::Int(v) => json!(v),
                Value::Boolean(v) => json!(v),
                Value::Text(v) => json!(v),
            };
            insert(&mut params, &name.split('.').collect::<Vec<_>>(), v);
        }
        let mut text = String::new();
        yaml(&mut text, &params, 0);
        write_atomically("/logs/params.yaml", &text)?;
        fs::create_dir_all("/logs/plots/metrics")
            .map_err(|e| format!("/logs/plots/metrics: {e}"))?;
        // A replayed `start` (after a fault) keeps the latest values so far.
        if let Ok(text) = fs::read_to_string("/logs/metrics.json") {
            if let Ok(Json::Object(latest)) = serde_json::from_str(&text) {
                self.latest = latest;
            }
        }
        self.started = true;
        Ok(())
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        if !self.started {
            return Err("log called before start".into());
        }
        for (name, value) in &values {
            let Some(v) = number(value) else { continue };
            let parts: Vec<&str> = name
                .split('/')
                .filter(|p| !p.is_empty() && *p != "." && *p != "..")
                .collect();
            let Some(last) = parts.last() else { continue };
            let path = format!("/logs/plots/metrics/{}.tsv", parts.join("/"));
            self.plots.append(
                &path,
                Some(&format!("step\t{last}")),
                &format!("{step}\t{v}"),
            )?;
            insert(&mut self.latest, &parts, v);
        }
        self.latest.insert("step".into(), json!(step));
        let text = serde_json::to_string_pretty(&self.latest).map_err(|e| e.to_string())?;
        write_atomically("/logs/metrics.json", &text)
    }
}

export_tracker!(DvcLive);
