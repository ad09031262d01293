//! The `wandb` tracker, with Accelerate's `WandBTracker` semantics: the run
//! config becomes the W&B config, the values logged at one step one
//! history row (merged, as `run.log(values, step=step)` merges them), and
//! `finish` the run's summary (the last value of each key) and its exit.
//!
//! `mode = "offline"` (the default) writes what `wandb.init(mode="offline")`
//! writes ([`offline`]), for `wandb sync`; `mode = "online"` makes the
//! calls wandb's client makes to a W&B server ([`online`]).
//!
//! The run id is kept in `/logs/run-id`: a fresh instance after a fault, or
//! a resumed run, goes on with the same W&B run.

mod datastore;
mod offline;
mod online;
mod records;

use hearth_guest::outbox::Settings;
use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const RUN_ID_FILE: &str = "/logs/run-id";

/// A history row or a summary: each key's value as JSON text.
pub type Row = BTreeMap<String, String>;

/// The run, as both modes describe it to W&B.
pub struct RunInfo {
    pub id: String,
    /// The id was this run's before (a resumed run, a fresh instance).
    pub resumed: bool,
    pub project: String,
    /// Empty: the default entity of whoever syncs (or of the API key).
    pub entity: String,
    pub name: String,
    /// The run config, each value as JSON text.
    pub config: Vec<(String, String)>,
    /// Unix seconds.
    pub started: f64,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A value as wandb's JSON: Python's `json.dumps`, which spells the
/// non-finite floats `NaN`, `Infinity` and `-Infinity`.
fn value_json(value: &Value) -> String {
    match value {
        Value::Float(v) if v.is_nan() => "NaN".into(),
        Value::Float(v) if v.is_infinite() => {
            if *v > 0.0 { "Infinity" } else { "-Infinity" }.into()
        }
        Value::Float(v) => serde_json::json!(v).to_string(),
        Value::Int(v) => v.to_string(),
        Value::Boolean(v) => v.to_string(),
        Value::Text(v) => serde_json::json!(v).to_string(),
    }
}

/// `row` as one JSON object, each value through `value` (its JSON text
/// as it is, or wrapped).
fn json_object(row: &Row, value: impl Fn(&str) -> String) -> String {
    let fields: Vec<String> = row
        .iter()
        .map(|(key, v)| format!("{}:{}", serde_json::json!(key), value(v)))
        .collect();
    format!("{{{}}}", fields.join(","))
}

/// A new run id as wandb makes them: 8 characters of `[a-z0-9]`, from the
/// random seed the WASI sandbox gives `RandomState`.
fn new_run_id() -> String {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    let mut bits = hasher.finish();
    (0..8)
        .map(|_| {
            let c = b"abcdefghijklmnopqrstuvwxyz0123456789"[(bits % 36) as usize];
            bits /= 36;
            c as char
        })
        .collect()
}

/// A run id from the user: wandb takes `[A-Za-z0-9_-]`.
fn check_run_id(id: &str) -> Result<(), String> {
    if id.is_empty()
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!(
            "option id = {id:?}: a W&B run id is letters, digits, '-' and '_'"
        ));
    }
    Ok(())
}

/// The run id: the option, the kept one, or a new one (kept); and whether
/// it was this run's before.
fn run_id(chosen: String) -> Result<(String, bool), String> {
    let kept = std::fs::read_to_string(RUN_ID_FILE)
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty());
    let id = match (chosen.is_empty(), &kept) {
        (false, _) => chosen,
        (true, Some(kept)) => return Ok((kept.clone(), true)),
        (true, None) => new_run_id(),
    };
    check_run_id(&id)?;
    std::fs::write(RUN_ID_FILE, &id).map_err(|e| format!("writing {RUN_ID_FILE}: {e}"))?;
    Ok((id.clone(), kept.as_deref() == Some(id.as_str())))
}

fn text_option(start: &Start, key: &str) -> String {
    match start.option(key) {
        Some(Value::Text(text)) => text.trim().to_string(),
        _ => String::new(),
    }
}

fn int_option(start: &Start, key: &str, default: i64) -> i64 {
    match start.option(key) {
        Some(Value::Int(n)) => *n,
        _ => default,
    }
}

impl RunInfo {
    fn new(start: &Start) -> Result<Self, String> {
        let (id, resumed) = run_id(text_option(start, "id"))?;
        let or = |option: String, default: &str| match option {
            o if o.is_empty() => default.to_string(),
            o => o,
        };
        Ok(RunInfo {
            id,
            resumed,
            project: or(text_option(start, "project"), &start.run.project),
            entity: text_option(start, "entity"),
            name: or(text_option(start, "name"), &start.run.run),
            config: start
                .config
                .iter()
                .map(|(key, value)| (key.clone(), value_json(value)))
                .collect(),
            started: now(),
        })
    }
}

/// Where the run goes.
enum Sink {
    Offline(offline::Offline),
    Online(Box<online::Online>),
}

impl Sink {
    fn start(start: &Start, run: RunInfo) -> Result<Self, String> {
        match text_option(start, "mode").as_str() {
            "" | "offline" => Ok(Sink::Offline(offline::Offline::start(&run)?)),
            "online" => {
                let key = std::env::var("WANDB_API_KEY").ok().filter(|k| !k.is_empty()).ok_or(
                    "mode = \"online\" needs WANDB_API_KEY: grant it in [plugin-permissions.wandb] env",
                )?;
                let settings = Settings {
                    batch: usize::MAX,
                    interval: Some(Duration::from_secs(
                        int_option(start, "send-every-seconds", 15).max(0) as u64,
                    )),
                    spool_bytes: int_option(start, "spool-mb", 64).max(1) as u64 * (1 << 20),
                    flush: Duration::from_secs(int_option(start, "flush-seconds", 5).max(0) as u64),
                    ..Settings::default()
                };
                let base = text_option(start, "base-url");
                Ok(Sink::Online(Box::new(online::Online::start(
                    base, key, run, settings,
                )?)))
            }
            other => Err(format!(
                "option mode = {other:?}: \"offline\" or \"online\""
            )),
        }
    }
}

/// A run being logged: the row being gathered and the summary.
struct Run {
    sink: Sink,
    started: f64,
    /// The row being gathered (its step, and its logged values): wandb
    /// merges the values logged at one step into one history row, sent
    /// when the step moves on.
    row: Option<(u64, Row, u64)>,
    /// The last value of each key: the summary.
    last: Row,
}

impl Run {
    fn start(start: &Start) -> Result<Self, String> {
        let run = RunInfo::new(start)?;
        let started = run.started;
        Ok(Run {
            sink: Sink::start(start, run)?,
            started,
            row: None,
            last: Row::new(),
        })
    }

    /// Gathers `values` into the row of `step`, sending the row before it.
    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        if self.row.as_ref().is_some_and(|(at, _, _)| *at != step) {
            self.send_row()?;
        }
        let (_, row, n) = self.row.get_or_insert_with(|| (step, Row::new(), 0));
        *n += values.len() as u64;
        row.extend(
            values
                .iter()
                .map(|(key, value)| (key.clone(), value_json(value))),
        );
        Ok(())
    }

    /// The gathered row, with wandb's `_step`, `_runtime` and `_timestamp`.
    fn send_row(&mut self) -> Result<(), String> {
        let Some((step, mut row, values)) = self.row.take() else {
            return Ok(());
        };
        let time = now();
        row.insert("_step".into(), step.to_string());
        row.insert(
            "_runtime".into(),
            value_json(&Value::Float(time - self.started)),
        );
        row.insert("_timestamp".into(), value_json(&Value::Float(time)));
        self.last.extend(row.clone());
        match &mut self.sink {
            Sink::Offline(offline) => offline.row(step, &row),
            Sink::Online(online) => {
                online.row(values, &row);
                Ok(())
            }
        }
    }

    fn finish(&mut self) -> Result<(), String> {
        self.send_row()?;
        let runtime = now() - self.started;
        let mut summary = std::mem::take(&mut self.last);
        summary.insert("_runtime".into(), value_json(&Value::Float(runtime)));
        match &mut self.sink {
            Sink::Offline(offline) => offline.finish(&summary, runtime),
            Sink::Online(online) => {
                online.finish(&summary);
                Ok(())
            }
        }
    }
}

#[derive(Default)]
struct Wandb(Option<Run>);

impl Tracker for Wandb {
    fn start(&mut self, start: Start) -> Result<(), String> {
        self.0 = Some(Run::start(&start)?);
        Ok(())
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        self.0
            .as_mut()
            .ok_or("log called before start")?
            .log(step, values)
    }

    fn finish(&mut self) -> Result<(), String> {
        match self.0.take() {
            Some(mut run) => run.finish(),
            None => Ok(()),
        }
    }
}

export_tracker!(Wandb);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_spelled_as_pythons_json_dumps_spells_them() {
        assert_eq!(value_json(&Value::Float(0.5)), "0.5");
        assert_eq!(value_json(&Value::Float(1.0)), "1.0");
        assert_eq!(value_json(&Value::Float(f64::NAN)), "NaN");
        assert_eq!(value_json(&Value::Float(f64::NEG_INFINITY)), "-Infinity");
        assert_eq!(value_json(&Value::Int(-3)), "-3");
        assert_eq!(value_json(&Value::Boolean(true)), "true");
        assert_eq!(value_json(&Value::Text("a\"b".into())), "\"a\\\"b\"");
    }

    #[test]
    fn rows_are_json_objects_with_escaped_keys() {
        let row: Row = [
            ("a\"b".to_string(), "1".to_string()),
            ("c".into(), "\"x\"".into()),
        ]
        .into();
        assert_eq!(json_object(&row, str::to_string), r#"{"a\"b":1,"c":"x"}"#);
        assert_eq!(
            json_object(&row, |v| format!("{{\"value\":{v}}}")),
            r#"{"a\"b":{"value":1},"c":{"value":"x"}}"#
        );
    }

    #[test]
    fn run_ids_are_eight_of_wandbs_characters_and_differ() {
        let (a, b) = (new_run_id(), new_run_id());
        assert_eq!(a.len(), 8);
        assert!(a
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()));
        assert_ne!(a, b);
        assert!(check_run_id("my-run_1").is_ok());
        assert!(check_run_id("a/b").is_err());
    }
}
