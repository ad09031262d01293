//! A run on an MLflow tracking server, through its REST API
//! (`/api/2.0/mlflow/...`): the experiment named after the project (made
//! if missing), a run in it, params, metrics and tags in
//! `runs/log-batch`, and `runs/update` to FINISHED at the end.
//!
//! Everything goes through the SDK's outbox, so a server that is down or
//! failing costs the run nothing: the experiment and the run are made on
//! the first request that gets through, and the records wait (spooled in
//! `/logs/outbox`) until then. The run's id is kept in `/logs/rest-run`,
//! so a fresh instance after a fault, or a resumed run, goes on logging to
//! the same MLflow run.

use super::{key, now_ms, param_text, Logged};
use hearth_guest::http::percent_encoded;
use hearth_guest::outbox::{Attempt, Outbox, Record, Settings};
use hearth_guest::{Entries, Start, Value};
use serde_json::{json, Value as Json};
use std::cell::RefCell;
use std::time::Duration;

/// Where the run's ids are kept: `<experiment id> <run id>`.
const RUN_FILE: &str = "/logs/rest-run";

/// `runs/log-batch`'s limits on one request.
const MAX_METRICS: usize = 1000;
const MAX_PARAMS: usize = 100;
const MAX_TAGS: usize = 100;
/// MLflow keeps at most this many characters of a param's or tag's value.
const MAX_VALUE: usize = 6000;

/// The tracking server and the run on it.
struct Api {
    base: String,
    token: Option<String>,
    experiment: String,
    run_name: String,
    start_ms: u128,
    /// The run's id, once made (or read back).
    run_id: RefCell<Option<String>>,
}

/// A request that did not get through, as the outbox takes it.
fn failed(what: &str, e: String) -> Attempt {
    Attempt::Retry(format!("{what}: {e}"))
}

impl Api {
    fn url(&self, path: &str) -> String {
        format!("{}/api/2.0/mlflow/{path}", self.base)
    }

    fn headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = vec![("content-type", "application/json".to_string())];
        if let Some(token) = &self.token {
            headers.push(("authorization", format!("Bearer {token}")));
        }
        headers
    }

    /// A request with a JSON body (`POST`) or none (`GET`): the answer's
    /// JSON, or how the attempt went.
    fn call(&self, method: &str, path: &str, body: Option<&Json>) -> Result<Json, Attempt> {
        let headers = self.headers();
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let body = body.map(Json::to_string).unwrap_or_default();
        let reply = hearth_guest::http::request(method, &self.url(path), &headers, body.as_bytes())
            .map_err(|e| failed(path, e))?;
        match Attempt::from_status(reply.status, &reply.body) {
            Attempt::Sent => serde_json::from_slice(&reply.body)
                .map_err(|e| Attempt::Refused(format!("{path}: an answer that is not JSON: {e}"))),
            Attempt::Retry(why) => Err(Attempt::Retry(format!("{path} {why}"))),
            Attempt::Refused(why) => Err(Attempt::Refused(format!("{path} {why}"))),
        }
    }

    /// The run's id: kept, read back, or made now (with its experiment).
    fn run_id(&self) -> Result<String, Attempt> {
        if let Some(id) = self.run_id.borrow().clone() {
            return Ok(id);
        }
        if let Some((_, id)) = std::fs::read_to_string(RUN_FILE).ok().and_then(|t| {
            t.trim()
                .split_once(' ')
                .map(|(e, r)| (e.to_string(), r.to_string()))
        }) {
            *self.run_id.borrow_mut() = Some(id.clone());
            return Ok(id);
        }
        let experiment = self.experiment_id()?;
        let tags: Vec<Json> = [
            ("mlflow.runName", self.run_name.as_str()),
            ("mlflow.user", "hearth"),
            ("mlflow.source.name", "hearth"),
            ("mlflow.source.type", "LOCAL"),
        ]
        .iter()
        .map(|(k, v)| json!({"key": k, "value": v}))
        .collect();
        let made = self.call(
            "POST",
            "runs/create",
            Some(&json!({
                "experiment_id": experiment,
                "run_name": self.run_name,
                "start_time": self.start_ms as u64,
                "tags": tags,
            })),
        )?;
        let id = made["run"]["info"]["run_id"]
            .as_str()
            .ok_or_else(|| Attempt::Refused(format!("runs/create answered no run id: {made}")))?
            .to_string();
        hearth_guest::files::write_atomically(RUN_FILE, &format!("{experiment} {id}"))
            .map_err(|e| Attempt::Refused(format!("{RUN_FILE}: {e}")))?;
        *self.run_id.borrow_mut() = Some(id.clone());
        Ok(id)
    }

    /// The id of the experiment named after the project, made if missing.
    fn experiment_id(&self) -> Result<String, Attempt> {
        let path = format!(
            "experiments/get-by-name?experiment_name={}",
            percent_encoded(&self.experiment)
        );
        match self.call("GET", &path, None) {
            Ok(found) => {
                if let Some(id) = found["experiment"]["experiment_id"].as_str() {
                    return Ok(id.to_string());
                }
            }
            // 404 RESOURCE_DOES_NOT_EXIST: made below.
            Err(Attempt::Refused(why)) if why.contains("404") => {}
            Err(other) => return Err(other),
        }
        let made = self.call(
            "POST",
            "experiments/create",
            Some(&json!({"name": self.experiment})),
        )?;
        made["experiment_id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| Attempt::Refused(format!("experiments/create answered no id: {made}")))
    }

    /// Sends a batch of records: params, metrics and tags in as few
    /// `runs/log-batch` requests as its limits allow, a status as
    /// `runs/update` in its place.
    fn send(&self, records: &[Record]) -> Attempt {
        match self.send_all(records) {
            Ok(()) => Attempt::Sent,
            Err(attempt) => attempt,
        }
    }

    fn send_all(&self, records: &[Record]) -> Result<(), Attempt> {
        let run_id = self.run_id()?;
        let mut batch = Batch::default();
        for record in records {
            let Ok(doc) = serde_json::from_str::<Json>(&record.line) else {
                continue; // not written by this tracker
            };
            if let Some(status) = doc["status"].as_str() {
                self.log_batch(&run_id, std::mem::take(&mut batch))?;
                self.call(
                    "POST",
                    "runs/update",
                    Some(&json!({"run_id": run_id, "status": status, "end_time": doc["end"]})),
                )?;
                continue;
            }
            for (list, limit) in [
                ("params", MAX_PARAMS),
                ("metrics", MAX_METRICS),
                ("tags", MAX_TAGS),
            ] {
                for entry in doc[list].as_array().into_iter().flatten() {
                    if batch.full(list, limit) {
                        self.log_batch(&run_id, std::mem::take(&mut batch))?;
                    }
                    batch.push(list, entry.clone());
                }
            }
        }
        self.log_batch(&run_id, batch)
    }

    fn log_batch(&self, run_id: &str, batch: Batch) -> Result<(), Attempt> {
        if batch.is_empty() {
            return Ok(());
        }
        let body = json!({
            "run_id": run_id,
            "params": batch.params,
            "metrics": batch.metrics,
            "tags": batch.tags,
        });
        self.call("POST", "runs/log-batch", Some(&body)).map(drop)
    }
}

/// One `runs/log-batch` request's entities.
#[derive(Default)]
struct Batch {
    params: Vec<Json>,
    metrics: Vec<Json>,
    tags: Vec<Json>,
}

impl Batch {
    fn list(&mut self, name: &str) -> &mut Vec<Json> {
        match name {
            "params" => &mut self.params,
            "metrics" => &mut self.metrics,
            _ => &mut self.tags,
        }
    }

    fn full(&mut self, name: &str, limit: usize) -> bool {
        let total = self.params.len() + self.metrics.len() + self.tags.len();
        self.list(name).len() >= limit || total >= MAX_METRICS
    }

    fn push(&mut self, name: &str, entry: Json) {
        self.list(name).push(entry)
    }

    fn is_empty(&self) -> bool {
        self.params.is_empty() && self.metrics.is_empty() && self.tags.is_empty()
    }
}

/// A metric's value as MLflow's JSON takes it: non-finite ones as strings.
fn number(v: f64) -> Json {
    if v.is_finite() {
        json!(v)
    } else if v.is_nan() {
        json!("NaN")
    } else if v > 0.0 {
        json!("Infinity")
    } else {
        json!("-Infinity")
    }
}

fn clipped(text: &str) -> String {
    text.chars().take(MAX_VALUE).collect()
}

/// A run on a tracking server, fed through an outbox.
pub struct Server {
    api: Api,
    outbox: Outbox,
}

impl Server {
    /// Opens the outbox (sending what an earlier instance spooled) and
    /// queues the run's config as params.
    pub fn start(base: String, start: Start) -> Result<Self, String> {
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!(
                "tracking-uri {base:?}: an http(s):// URL (leave it out for the file store)"
            ));
        }
        let option_int = |name: &str, default: i64| match start.option(name) {
            Some(Value::Int(n)) => *n,
            _ => default,
        };
        let settings = Settings {
            batch: option_int("batch", 100).max(1) as usize,
            interval: Some(Duration::from_secs(
                option_int("send-every-seconds", 1).max(0) as u64,
            )),
            spool_bytes: option_int("spool-mb", 64).max(1) as u64 * (1 << 20),
            flush: Duration::from_secs(option_int("flush-seconds", 5).max(0) as u64),
            ..Settings::default()
        };
        let token = std::env::var("MLFLOW_TRACKING_TOKEN")
            .ok()
            .filter(|t| !t.is_empty());
        let api = Api {
            base,
            token,
            experiment: start.run.project.clone(),
            run_name: start.run.run.clone(),
            start_ms: now_ms(),
            run_id: RefCell::new(None),
        };
        let mut outbox = Outbox::open("/logs/outbox", settings)?;
        // A fresh instance after a fault past `start` queued the params already.
        let again = start.restart.as_ref().is_some_and(|r| r.call != "start");
        if !again {
            let params: Vec<Json> = start
                .config
                .iter()
                .map(
                    |(name, value)| json!({"key": key(name), "value": clipped(&param_text(value))}),
                )
                .collect();
            let line = json!({ "params": params }).to_string();
            outbox.push_now(Record::new(0, line), |r: &[Record]| api.send(r));
        }
        Ok(Self { api, outbox })
    }

    /// Queues `values`: numbers as metrics at `step`, text as tags.
    pub fn log(&mut self, step: u64, values: Entries) {
        let ms = now_ms() as u64;
        let (mut metrics, mut tags) = (Vec::new(), Vec::new());
        let n = values.len() as u64;
        for (name, value) in values {
            let v = match Logged::from(value) {
                Logged::Metric(v) => v,
                Logged::Tag(text) => {
                    tags.push(json!({"key": key(&name), "value": clipped(&text)}));
                    continue;
                }
            };
            metrics.push(
                json!({"key": key(&name), "value": number(v), "timestamp": ms, "step": step}),
            );
        }
        let line = json!({"metrics": metrics, "tags": tags}).to_string();
        let api = &self.api;
        self.outbox
            .push(Record::new(n, line), |r: &[Record]| api.send(r));
    }

    /// Queues the run's end (FINISHED) and sends what waits, for a bounded time.
    pub fn finish(&mut self) {
        let line = json!({"status": "FINISHED", "end": now_ms() as u64}).to_string();
        let api = &self.api;
        self.outbox
            .push_now(Record::new(0, line), |r: &[Record]| api.send(r));
        self.outbox.flush(|r: &[Record]| api.send(r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_metrics_are_strings_mlflow_parses() {
        assert_eq!(number(0.5), json!(0.5));
        assert_eq!(number(f64::NAN), json!("NaN"));
        assert_eq!(number(f64::INFINITY), json!("Infinity"));
        assert_eq!(number(f64::NEG_INFINITY), json!("-Infinity"));
    }

    #[test]
    fn a_batch_is_full_at_log_batch_limits() {
        let mut batch = Batch::default();
        for _ in 0..MAX_PARAMS {
            assert!(!batch.full("params", MAX_PARAMS));
            batch.push("params", json!({}));
        }
        assert!(batch.full("params", MAX_PARAMS));
        assert!(!batch.full("metrics", MAX_METRICS));
    }
}
