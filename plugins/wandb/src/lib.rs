//! The `wandb` tracker, with Accelerate's `WandBTracker` semantics: the run
//! config becomes the W&B config, the values logged at one step one
//! history row (merged, as `run.log(values, step=step)` merges them), and
//! `finish` the run's summary (the last value of each key) and its exit. It writes an offline run, as `wandb.init(mode="offline")` does:
//! `/logs/offline-run-<time>-<id>/run-<id>.wandb`, the record file that
//! `wandb sync RUN/trackers/wandb` uploads and `wandb leet inspect` reads.
//!
//! The run id is kept in `/logs/run-id`: a fresh instance after a fault, or
//! a resumed run, writes a new file for the same W&B run (marked
//! `resumed`), as wandb's client does when a run is resumed.

mod datastore;
mod records;

use datastore::Log;
use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use prost::Message;
use records::*;
use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

const RUN_ID_FILE: &str = "/logs/run-id";
/// What the header says wrote the file, and the oldest reader it needs
/// (the value wandb's own client writes).
const PRODUCER: &str = concat!("hearth-wandb ", env!("CARGO_PKG_VERSION"));
const MIN_CONSUMER: &str = "0.70.0";

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

fn item(key: &str, value_json: String) -> Item {
    Item {
        nested_key: vec![key.to_string()],
        value_json,
    }
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

/// `YYYYMMDD_HHMMSS` in UTC, as wandb names run folders.
fn folder_time(unix: f64) -> String {
    let secs = unix as i64;
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}_{:02}{:02}{:02}",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

fn text_option(start: &Start, key: &str) -> String {
    match start.option(key) {
        Some(Value::Text(text)) => text.trim().to_string(),
        _ => String::new(),
    }
}

/// An offline run being written.
struct Run {
    id: String,
    log: Log,
    next_num: i64,
    started: f64,
    /// The row being gathered: wandb merges the values logged at one step
    /// into one history row, written when the step moves on.
    row: Option<(u64, BTreeMap<String, String>)>,
    /// The last value of each key: the summary.
    last: BTreeMap<String, String>,
}

impl Run {
    fn write(&mut self, mut record: Record) -> Result<(), String> {
        record.num = self.next_num;
        record.info = Some(RecordInfo {
            stream_id: self.id.clone(),
        });
        self.next_num += 1;
        self.log.append(&record.encode_to_vec())
    }

    /// The run id: the option, the kept one, or a new one (kept).
    fn id(start: &Start) -> Result<(String, bool), String> {
        let kept = std::fs::read_to_string(RUN_ID_FILE)
            .ok()
            .map(|t| t.trim().to_string());
        let chosen = text_option(start, "id");
        let id = match (chosen.is_empty(), kept) {
            (false, _) => chosen,
            (true, Some(kept)) if !kept.is_empty() => return Ok((kept, true)),
            (true, _) => new_run_id(),
        };
        check_run_id(&id)?;
        let resumed = std::fs::read_to_string(RUN_ID_FILE).is_ok_and(|t| t.trim() == id);
        std::fs::write(RUN_ID_FILE, &id).map_err(|e| format!("writing {RUN_ID_FILE}: {e}"))?;
        Ok((id, resumed))
    }

    /// A new folder and file for this instance's records.
    fn create_file(id: &str, started: f64) -> Result<Log, String> {
        let base = format!("/logs/offline-run-{}-{id}", folder_time(started));
        let folder = (1..)
            .map(|n| {
                if n == 1 {
                    base.clone()
                } else {
                    format!("{base}-{n}")
                }
            })
            .find(|f| std::fs::metadata(f).is_err())
            .expect("an unused folder name");
        std::fs::create_dir_all(&folder).map_err(|e| format!("creating {folder}: {e}"))?;
        Log::create(&format!("{folder}/run-{id}.wandb"))
    }

    fn start(start: &Start) -> Result<Self, String> {
        let (id, resumed) = Self::id(start)?;
        let started = now();
        let mut run = Run {
            log: Self::create_file(&id, started)?,
            id: id.clone(),
            next_num: 1,
            started,
            row: None,
            last: BTreeMap::new(),
        };
        let project = match text_option(start, "project") {
            p if p.is_empty() => start.run.project.clone(),
            p => p,
        };
        let name = match text_option(start, "name") {
            n if n.is_empty() => start.run.run.clone(),
            n => n,
        };
        run.write(Record {
            header: Some(HeaderRecord {
                version_info: Some(VersionInfo {
                    producer: PRODUCER.into(),
                    min_consumer: MIN_CONSUMER.into(),
                }),
            }),
            ..Default::default()
        })?;
        let config = start
            .config
            .iter()
            .map(|(key, value)| ConfigItem {
                key: key.clone(),
                value_json: value_json(value),
            })
            .collect();
        run.write(Record {
            run: Some(RunRecord {
                run_id: id,
                entity: text_option(start, "entity"),
                project,
                config: Some(ConfigRecord { update: config }),
                display_name: name,
                host: String::new(),
                start_time: Some(Timestamp {
                    seconds: started as i64,
                    nanos: (started.fract() * 1e9) as i32,
                }),
                resumed,
            }),
            ..Default::default()
        })?;
        Ok(run)
    }

    /// Gathers `values` into the row of `step`, writing the row before it.
    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        if self.row.as_ref().is_some_and(|(at, _)| *at != step) {
            self.write_row()?;
        }
        let (_, row) = self.row.get_or_insert_with(|| (step, BTreeMap::new()));
        row.extend(
            values
                .iter()
                .map(|(key, value)| (key.clone(), value_json(value))),
        );
        Ok(())
    }

    /// The gathered row as one history record, with wandb's `_step`,
    /// `_runtime` and `_timestamp`.
    fn write_row(&mut self) -> Result<(), String> {
        let Some((step, mut row)) = self.row.take() else {
            return Ok(());
        };
        let time = now();
        row.insert("_step".into(), step.to_string());
        row.insert(
            "_runtime".into(),
            value_json(&Value::Float(time - self.started)),
        );
        row.insert("_timestamp".into(), value_json(&Value::Float(time)));
        let items = row
            .iter()
            .map(|(key, value)| item(key, value.clone()))
            .collect();
        self.last.extend(row);
        self.write(Record {
            history: Some(HistoryRecord {
                item: items,
                step: Some(HistoryStep { num: step as i64 }),
            }),
            ..Default::default()
        })
    }

    fn finish(&mut self) -> Result<(), String> {
        self.write_row()?;
        let runtime = now() - self.started;
        let mut update: Vec<Item> = std::mem::take(&mut self.last)
            .into_iter()
            .filter(|(key, _)| key != "_runtime")
            .map(|(key, value)| item(&key, value))
            .collect();
        update.push(item("_runtime", value_json(&Value::Float(runtime))));
        self.write(Record {
            summary: Some(SummaryRecord { update }),
            ..Default::default()
        })?;
        self.write(Record {
            exit: Some(RunExitRecord {
                exit_code: 0,
                runtime: runtime as i32,
            }),
            ..Default::default()
        })
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
    fn folder_times_are_utc_like_wandbs() {
        // datetime.fromtimestamp(t, timezone.utc).strftime("%Y%m%d_%H%M%S")
        assert_eq!(folder_time(0.0), "19700101_000000");
        assert_eq!(folder_time(1_795_857_853.99), "20261128_092413");
        assert_eq!(folder_time(951_782_400.0), "20000229_000000");
    }

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
