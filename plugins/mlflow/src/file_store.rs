//! MLflow's file store, written under `/logs`, which is the store's root:
//!
//! ```text
//! 0/meta.yaml                        the Default experiment
//! <exp>/meta.yaml                    experiment named after the project
//! <exp>/<run>/meta.yaml              status RUNNING (1), FINISHED (3) at the end
//! <exp>/<run>/params/<key>           value
//! <exp>/<run>/metrics/<key>          "<ms> <value> <step>" per line
//! <exp>/<run>/tags/<key>             value
//! ```
//!
//! The sandbox hides the host path of `/logs`, so artifact locations are
//! written relative to the store root; hearth logs no artifacts.

use super::{key, now_ms, param_text, Logged};
use hearth_guest::files::{write_atomically, Appenders};
use hearth_guest::{Entries, RunInfo};
use std::fs;
use std::time::{SystemTime, UNIX_EPOCH};

const RUNNING: u8 = 1;
/// `<run id> <start ms>` of the run this store is writing.
const RUN_FILE: &str = "/logs/.hearth-run";
const FINISHED: u8 = 3;

/// 64-bit FNV-1a, for stable identifiers.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A YAML single-quoted scalar.
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

fn experiment_meta(id: &str, name: &str, ms: u128) -> String {
    format!(
        "artifact_location: {loc}\ncreation_time: {ms}\nexperiment_id: {id}\nlast_update_time: {ms}\n\
         lifecycle_stage: active\nname: {name}\n",
        loc = quoted(&format!("./{id}")),
        id = quoted(id),
        name = quoted(name),
    )
}

/// The file store of one run.
#[derive(Default)]
pub struct FileStore {
    /// `/logs/<exp>/<run>`, once started.
    dir: Option<String>,
    meta: Option<RunMeta>,
    /// Open metric files.
    metrics: Appenders,
}

struct RunMeta {
    experiment: String,
    run_id: String,
    run_name: String,
    start: u128,
}

impl RunMeta {
    fn yaml(&self, status: u8, end: Option<u128>) -> String {
        let end = end.map_or("null".to_string(), |e| e.to_string());
        format!(
            "artifact_uri: {uri}\nend_time: {end}\nentry_point_name: ''\nexperiment_id: {exp}\n\
             lifecycle_stage: active\nrun_id: {id}\nrun_name: {name}\nrun_uuid: {id}\nsource_name: ''\n\
             source_type: 4\nsource_version: ''\nstart_time: {start}\nstatus: {status}\ntags: []\n\
             user_id: hearth\n",
            uri = quoted(&format!("./{}/{}/artifacts", self.experiment, self.run_id)),
            exp = quoted(&self.experiment),
            id = self.run_id,
            name = quoted(&self.run_name),
            start = self.start,
        )
    }
}

impl FileStore {
    /// Writes the experiment and the run (or goes on with the run a failed
    /// instance began), its tags and `config` as params.
    pub fn start(&mut self, run: RunInfo, config: Entries) -> Result<(), String> {
        let ms = now_ms();
        if fs::metadata("/logs/0/meta.yaml").is_err() {
            write_atomically("/logs/0/meta.yaml", &experiment_meta("0", "Default", ms))?;
        }
        // MLflow's file store uses decimal experiment ids; derive a stable
        // one from the project name (63 bits, never 0).
        let experiment = ((fnv(run.project.as_bytes()) >> 1).max(1)).to_string();
        let exp_meta = format!("/logs/{experiment}/meta.yaml");
        if fs::metadata(&exp_meta).is_err() {
            write_atomically(&exp_meta, &experiment_meta(&experiment, &run.project, ms))?;
        }
        // After a fault the host starts a fresh instance and replays `start`:
        // carry on with the same run (its id is kept in the store's root).
        let (run_id, start) = match fs::read_to_string(RUN_FILE).ok().and_then(|t| {
            let (id, start) = t.trim().split_once(' ')?;
            Some((id.to_string(), start.parse().ok()?))
        }) {
            Some(resumed) => resumed,
            None => {
                let nanos = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                let id = format!(
                    "{:016x}{:016x}",
                    fnv(run.run.as_bytes()),
                    fnv(&nanos.to_le_bytes())
                );
                write_atomically(RUN_FILE, &format!("{id} {ms}"))?;
                (id, ms)
            }
        };
        let dir = format!("/logs/{experiment}/{run_id}");
        let meta = RunMeta {
            experiment,
            run_id,
            run_name: run.run.clone(),
            start,
        };
        write_atomically(&format!("{dir}/meta.yaml"), &meta.yaml(RUNNING, None))?;
        fs::create_dir_all(format!("{dir}/artifacts"))
            .map_err(|e| format!("{dir}/artifacts: {e}"))?;
        for (name, text) in [
            ("mlflow.runName", run.run.as_str()),
            ("mlflow.user", "hearth"),
            ("mlflow.source.name", "hearth"),
            ("mlflow.source.type", "LOCAL"),
        ] {
            write_atomically(&format!("{dir}/tags/{name}"), text)?;
        }
        for (name, value) in &config {
            write_atomically(&format!("{dir}/params/{}", key(name)), &param_text(value))?;
        }
        self.dir = Some(dir);
        self.meta = Some(meta);
        Ok(())
    }

    /// Appends numbers to their metric files; text values become tags.
    pub fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        let dir = self.dir.clone().ok_or("log called before start")?;
        let ms = now_ms();
        for (name, value) in values {
            let number = match Logged::from(value) {
                Logged::Metric(v) => v,
                Logged::Tag(text) => {
                    write_atomically(&format!("{dir}/tags/{}", key(&name)), &text)?;
                    continue;
                }
            };
            let path = format!("{dir}/metrics/{}", key(&name));
            self.metrics
                .append(&path, None, &format!("{ms} {number:?} {step}"))?;
        }
        Ok(())
    }

    /// Marks the run FINISHED.
    pub fn finish(&mut self) -> Result<(), String> {
        self.metrics.close_all();
        if let (Some(dir), Some(meta)) = (self.dir.take(), self.meta.take()) {
            write_atomically(
                &format!("{dir}/meta.yaml"),
                &meta.yaml(FINISHED, Some(now_ms())),
            )?;
        }
        Ok(())
    }
}
