//! The history every `hearth run` keeps in its run folder, whatever
//! trackers it has: `metrics.jsonl`, one JSON object per line — the values
//! logged at a step (`{"step": 100, "time": 1764081234.5, "loss": 0.52,
//! "lr": 0.002, "tokens_per_sec": 18234.0}`) or an event
//! (`{"step": 300, "time": …, "event": "checkpoint", "path": "…"}`).
//! A resumed run keeps the lines up to the step it resumed from and
//! appends after them, so no step appears twice. `hearth report` draws it.

use serde_json::{Map, Value};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

/// The history file of a run folder.
pub const HISTORY_NAME: &str = "metrics.jsonl";

/// One line of a history.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The optimizer step.
    pub step: u64,
    /// Seconds since the Unix epoch when it was written.
    pub time: f64,
    /// An event (`"checkpoint"`), or `None` for logged values.
    pub event: Option<String>,
    /// The numbers logged (text values are left out).
    pub values: Vec<(String, f64)>,
}

impl Record {
    fn from_json(object: &Map<String, Value>) -> Option<Self> {
        let step = object.get("step")?.as_u64()?;
        let time = object.get("time").and_then(Value::as_f64).unwrap_or(0.0);
        let event = object
            .get("event")
            .and_then(Value::as_str)
            .map(String::from);
        let values = object
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "step" | "time" | "event" | "path"))
            .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
            .collect();
        Some(Self {
            step,
            time,
            event,
            values,
        })
    }
}

/// Reads the records of `path`; lines that are not records (a line cut
/// short by a crash) are skipped.
pub fn read_history(path: &Path) -> std::io::Result<Vec<Record>> {
    let file = File::open(path)?;
    let mut records = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line?;
        if let Ok(Value::Object(object)) = serde_json::from_str::<Value>(&line) {
            records.extend(Record::from_json(&object));
        }
    }
    Ok(records)
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Appends to a run's history (the main process's).
#[derive(Debug)]
pub struct History {
    path: PathBuf,
    file: File,
}

impl History {
    /// Starts the history of `run_dir`: a new file, or with `resumed_at`
    /// the existing one cut after that step (written whole before it
    /// replaces the old one).
    pub fn open(run_dir: &Path, resumed_at: Option<u64>) -> std::io::Result<Self> {
        std::fs::create_dir_all(run_dir)?;
        let path = run_dir.join(HISTORY_NAME);
        let kept: Vec<String> = match (resumed_at, File::open(&path)) {
            (Some(step), Ok(file)) => BufReader::new(file)
                .lines()
                .map_while(Result::ok)
                .filter(|line| {
                    serde_json::from_str::<Value>(line)
                        .ok()
                        .and_then(|v| v.get("step").and_then(Value::as_u64))
                        .is_some_and(|s| s <= step)
                })
                .collect(),
            _ => Vec::new(),
        };
        hearth_ops::durable::write_atomically(&path, |f| {
            for line in &kept {
                writeln!(f, "{line}")?;
            }
            Ok(())
        })?;
        let file = File::options().append(true).open(&path)?;
        Ok(Self { path, file })
    }

    /// Records the values logged at `step` (numbers only).
    pub fn log(&mut self, step: u64, values: &[(String, f64)]) -> std::io::Result<()> {
        let mut object = Map::new();
        object.insert("step".into(), step.into());
        object.insert("time".into(), now().into());
        for (k, v) in values {
            // JSON has no NaN or infinity: such a value is left out.
            if let Some(n) = serde_json::Number::from_f64(*v) {
                object.insert(k.clone(), Value::Number(n));
            }
        }
        self.write(object)
    }

    /// Records an event at `step` (`"checkpoint"` with the folder written).
    pub fn event(&mut self, step: u64, event: &str, path: &Path) -> std::io::Result<()> {
        let mut object = Map::new();
        object.insert("step".into(), step.into());
        object.insert("time".into(), now().into());
        object.insert("event".into(), event.into());
        object.insert("path".into(), path.display().to_string().into());
        self.write(object)
    }

    fn write(&mut self, object: Map<String, Value>) -> std::io::Result<()> {
        // One write per line, so a reader never sees half a line
        // (`hearth report --watch` reads while the run writes).
        let line = format!("{}\n", Value::Object(object));
        self.file.write_all(line.as_bytes())
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_history_keeps_the_steps_up_to_its_checkpoint_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = History::open(dir.path(), None).unwrap();
        for step in [10, 20, 30, 40] {
            h.log(step, &[("loss".into(), 1.0 / step as f64)]).unwrap();
        }
        h.event(20, "checkpoint", Path::new("checkpoint_0"))
            .unwrap();
        drop(h);
        let mut h = History::open(dir.path(), Some(20)).unwrap();
        h.log(30, &[("loss".into(), 0.5), ("nan".into(), f64::NAN)])
            .unwrap();
        let records = read_history(h.path()).unwrap();
        let steps: Vec<u64> = records.iter().map(|r| r.step).collect();
        assert_eq!(steps, [10, 20, 20, 30]);
        assert_eq!(records[2].event.as_deref(), Some("checkpoint"));
        assert_eq!(records[3].values, [("loss".to_string(), 0.5)]);
        // A line cut short by a crash is skipped by readers, and dropped
        // by the next resume.
        std::fs::OpenOptions::new()
            .append(true)
            .open(h.path())
            .unwrap()
            .write_all(b"{\"step\": 40, \"lo")
            .unwrap();
        assert_eq!(read_history(h.path()).unwrap().len(), 4);
        drop(h);
        let h = History::open(dir.path(), Some(30)).unwrap();
        let text = std::fs::read_to_string(h.path()).unwrap();
        assert_eq!(text.lines().count(), 4, "{text}");
        assert!(text.ends_with('\n'));
        // A fresh run starts a fresh history.
        History::open(dir.path(), None).unwrap();
        assert!(read_history(&dir.path().join(HISTORY_NAME))
            .unwrap()
            .is_empty());
    }
}
