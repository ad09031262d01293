//! An offline run, as `wandb.init(mode="offline")` writes it:
//! `/logs/offline-run-<time>-<id>/run-<id>.wandb`, the record file that
//! `wandb sync` uploads and `wandb leet inspect` reads, and
//! `files/wandb-summary.json` beside it, which `wandb sync` uploads too.

use super::datastore::Log;
use super::records::*;
use super::{Row, RunInfo};
use prost::Message;

/// What the header says wrote the file, and the oldest reader it needs
/// (the value wandb's own client writes).
const PRODUCER: &str = concat!("hearth-wandb ", env!("CARGO_PKG_VERSION"));
const MIN_CONSUMER: &str = "0.70.0";

/// `YYYYMMDD_HHMMSS` in UTC, as wandb names run folders.
pub fn folder_time(unix: f64) -> String {
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

fn items(row: &Row) -> Vec<Item> {
    row.iter()
        .map(|(key, value)| Item {
            nested_key: vec![key.clone()],
            value_json: value.clone(),
        })
        .collect()
}

/// The `.wandb` file of this instance, and where its records are numbered.
pub struct Offline {
    id: String,
    folder: String,
    log: Log,
    next_num: i64,
}

impl Offline {
    /// A new folder and file, with the header and the run record.
    pub fn start(run: &RunInfo) -> Result<Self, String> {
        let base = format!("/logs/offline-run-{}-{}", folder_time(run.started), run.id);
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
        std::fs::create_dir_all(format!("{folder}/files"))
            .map_err(|e| format!("creating {folder}: {e}"))?;
        let mut offline = Offline {
            log: Log::create(&format!("{folder}/run-{}.wandb", run.id))?,
            folder,
            id: run.id.clone(),
            next_num: 1,
        };
        offline.write(Record {
            header: Some(HeaderRecord {
                version_info: Some(VersionInfo {
                    producer: PRODUCER.into(),
                    min_consumer: MIN_CONSUMER.into(),
                }),
            }),
            ..Default::default()
        })?;
        let config = run
            .config
            .iter()
            .map(|(key, value_json)| ConfigItem {
                key: key.clone(),
                value_json: value_json.clone(),
            })
            .collect();
        offline.write(Record {
            run: Some(RunRecord {
                run_id: run.id.clone(),
                entity: run.entity.clone(),
                project: run.project.clone(),
                config: Some(ConfigRecord { update: config }),
                display_name: run.name.clone(),
                host: String::new(),
                start_time: Some(Timestamp {
                    seconds: run.started as i64,
                    nanos: (run.started.fract() * 1e9) as i32,
                }),
                resumed: run.resumed,
            }),
            ..Default::default()
        })?;
        Ok(offline)
    }

    fn write(&mut self, mut record: Record) -> Result<(), String> {
        record.num = self.next_num;
        record.info = Some(RecordInfo {
            stream_id: self.id.clone(),
        });
        self.next_num += 1;
        self.log.append(&record.encode_to_vec())
    }

    /// One history row.
    pub fn row(&mut self, step: u64, row: &Row) -> Result<(), String> {
        self.write(Record {
            history: Some(HistoryRecord {
                item: items(row),
                step: Some(HistoryStep { num: step as i64 }),
            }),
            ..Default::default()
        })
    }

    /// The summary and the exit.
    pub fn finish(&mut self, summary: &Row, runtime: f64) -> Result<(), String> {
        self.write(Record {
            summary: Some(SummaryRecord {
                update: items(summary),
            }),
            ..Default::default()
        })?;
        self.write(Record {
            exit: Some(RunExitRecord {
                exit_code: 0,
                runtime: runtime as i32,
            }),
            ..Default::default()
        })?;
        let path = format!("{}/files/wandb-summary.json", self.folder);
        std::fs::write(&path, super::json_object(summary, str::to_string))
            .map_err(|e| format!("writing {path}: {e}"))
    }
}

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
}
