//! A run folder as the report reads it: its history, config and summary.

use super::ReportError;
use hearth::train::{flatten_toml, read_history, HISTORY_NAME};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What a report shows of one run.
#[derive(Debug, Clone)]
pub struct RunData {
    /// The name on its curves: its `run.name`, or its folder when two
    /// runs share a name.
    pub label: String,
    /// The run folder.
    pub dir: PathBuf,
    /// Its `config.toml`, flattened (`optimizer.lr` → `0.002`).
    pub config: BTreeMap<String, String>,
    /// Its `summary.json`, once the run finished.
    pub summary: Option<serde_json::Value>,
    /// Each metric's `(step, value)` points, in step order.
    pub series: BTreeMap<String, Vec<(u64, f64)>>,
    /// The steps at which checkpoints were written.
    pub checkpoints: Vec<u64>,
}

impl RunData {
    /// True once the run wrote its summary (it finished).
    pub fn finished(&self) -> bool {
        self.summary.is_some()
    }
}

/// Reads the run folder `dir`. Without `metrics.jsonl` it is refused,
/// unless `waiting` (a run that has not logged yet, under `--watch`).
pub fn load_run(dir: &Path, waiting: bool) -> Result<RunData, ReportError> {
    if !dir.is_dir() {
        let why = if dir.exists() {
            "it is a file, not a run folder"
        } else {
            "there is no such folder"
        };
        return Err(ReportError::NotARun {
            dir: dir.into(),
            why: why.into(),
        });
    }
    let history = dir.join(HISTORY_NAME);
    let records = match read_history(&history) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && waiting => Vec::new(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ReportError::NotARun {
                dir: dir.into(),
                why: format!("it holds no {HISTORY_NAME}; give the folder `hearth run` wrote (<output-dir>/<name>)"),
            })
        }
        Err(source) => return Err(ReportError::Io { path: history, source }),
    };
    let mut series: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    let mut checkpoints = Vec::new();
    for r in records {
        match r.event.as_deref() {
            Some("checkpoint") => checkpoints.push(r.step),
            Some(_) => {}
            None => {
                for (k, v) in r.values {
                    series.entry(k).or_default().push((r.step, v));
                }
            }
        }
    }
    for points in series.values_mut() {
        points.sort_by_key(|(s, _)| *s);
    }
    let text = std::fs::read_to_string(dir.join("config.toml")).unwrap_or_default();
    let config: BTreeMap<String, String> = flatten_toml(&text)
        .into_iter()
        .map(|(k, v)| match v {
            toml::Value::String(s) => (k, s),
            other => (k, other.to_string()),
        })
        .collect();
    let summary = std::fs::read_to_string(dir.join("summary.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let label = config.get("run.name").cloned().unwrap_or_else(|| {
        dir.file_name().map_or_else(
            || dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    });
    Ok(RunData {
        label,
        dir: dir.into(),
        config,
        summary,
        series,
        checkpoints,
    })
}

/// Gives runs that share a label their folder as label instead.
pub fn distinct_labels(runs: &mut [RunData]) {
    let labels: Vec<String> = runs.iter().map(|r| r.label.clone()).collect();
    for run in runs.iter_mut() {
        if labels.iter().filter(|l| **l == run.label).count() > 1 {
            run.label = run.dir.display().to_string();
        }
    }
}

/// The config keys whose values differ between the runs, with each run's
/// value (`None` where a run does not set it).
pub fn config_differences(runs: &[RunData]) -> Vec<(String, Vec<Option<String>>)> {
    let mut keys: Vec<&String> = runs.iter().flat_map(|r| r.config.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| *k != "run.name")
        .map(|k| {
            (
                k.clone(),
                runs.iter()
                    .map(|r| r.config.get(k).cloned())
                    .collect::<Vec<_>>(),
            )
        })
        .filter(|(_, values)| values.iter().any(|v| *v != values[0]))
        .collect()
}
