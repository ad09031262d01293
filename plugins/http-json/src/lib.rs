//! The `http-json` tracker: POSTs JSON to the `url` option, a host its user
//! granted. At `start` one object with the run and its config and no
//! records; then every `batch` logged steps (and at `finish`, the rest):
//!
//! ```json
//! {"project": "p", "run": "r", "process": 0,
//!  "records": [{"step": 10, "values": {"loss": 0.5}}]}
//! ```
//!
//! With `token-env` naming a granted environment variable, its value is
//! sent as `Authorization: Bearer <value>`. Delivery goes through the
//! guest SDK's outbox: a server that is down, slow or answering 5xx gets
//! the records later (they wait in `/logs/outbox`, at most `spool-mb`),
//! `finish` keeps trying for `flush-seconds`, and the run's `summary.json`
//! counts the values sent, retried, spooled and dropped. A request hearth
//! refuses (a host not granted) is tried again like a server that is down,
//! and ends as dropped.

use hearth_guest::outbox::{Attempt, Outbox, Record, Settings};
use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use serde_json::{json, Map};
use std::time::Duration;

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

/// Where and how to POST.
struct Target {
    url: String,
    token: Option<String>,
    /// The run's fields sent with every POST.
    run: Map<String, serde_json::Value>,
}

impl Target {
    fn post(&self, doc: Map<String, serde_json::Value>) -> Attempt {
        let mut body = self.run.clone();
        body.extend(doc);
        let auth = self.token.as_ref().map(|t| format!("Bearer {t}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(auth) = &auth {
            headers.push(("authorization", auth));
        }
        let body = serde_json::Value::Object(body).to_string();
        match hearth_guest::http::post(&self.url, &headers, body.as_bytes()) {
            Ok(reply) => Attempt::from_status(reply.status, &reply.body),
            Err(e) => Attempt::Retry(e),
        }
    }

    /// Sends a batch of records: each config record as its own POST, the
    /// step records together; the first failure is the batch's.
    fn send(&self, records: &[Record]) -> Attempt {
        let mut steps = Vec::new();
        for record in records {
            let Ok(serde_json::Value::Object(doc)) = serde_json::from_str(&record.line) else {
                continue; // not written by this tracker: nothing to send
            };
            if doc.contains_key("config") {
                let mut start = doc;
                start.insert("records".into(), json!([]));
                match self.post(start) {
                    Attempt::Sent => {}
                    failed => return failed,
                }
            } else {
                steps.push(serde_json::Value::Object(doc));
            }
        }
        if steps.is_empty() {
            return Attempt::Sent;
        }
        let mut doc = Map::new();
        doc.insert("records".into(), serde_json::Value::Array(steps));
        self.post(doc)
    }
}

#[derive(Default)]
struct HttpJson {
    target: Option<Target>,
    outbox: Option<Outbox>,
}

fn int_option(start: &Start, key: &str, least: i64) -> Result<i64, String> {
    match start.option(key) {
        Some(Value::Int(n)) if *n >= least => Ok(*n),
        _ => Err(format!("`{key}` must be an integer of at least {least}")),
    }
}

impl Tracker for HttpJson {
    fn start(&mut self, start: Start) -> Result<(), String> {
        let url = match start.option("url") {
            Some(Value::Text(url)) if !url.is_empty() => url.clone(),
            _ => return Err("set `url` in this tracker's [[trackers]] options".into()),
        };
        let settings = Settings {
            batch: int_option(&start, "batch", 1)? as usize,
            spool_bytes: int_option(&start, "spool-mb", 1)? as u64 * (1 << 20),
            flush: Duration::from_secs(int_option(&start, "flush-seconds", 0)? as u64),
            ..Settings::default()
        };
        let mut token = None;
        if let Some(Value::Text(name)) = start.option("token-env") {
            if !name.is_empty() {
                token = Some(std::env::var(name).map_err(|_| {
                    format!(
                        "`token-env` names {name}, which this plugin was not granted or is unset"
                    )
                })?);
            }
        }
        let run = &start.run;
        let target = Target {
            url,
            token,
            run: [
                ("project".to_string(), json!(run.project)),
                ("run".to_string(), json!(run.run)),
                ("process".to_string(), json!(run.process_index)),
            ]
            .into_iter()
            .collect(),
        };
        // What an earlier instance (a fault, or the run this one resumes)
        // spooled is sent first.
        let mut outbox = Outbox::open("/logs/outbox", settings)?;
        // A fresh instance after a fault past `start` sent the config already.
        let again = start.restart.as_ref().is_some_and(|r| r.call != "start");
        if !again {
            let config = json!({"config": object(start.config)}).to_string();
            outbox.push_now(Record::new(0, config), |r: &[Record]| target.send(r));
        }
        self.target = Some(target);
        self.outbox = Some(outbox);
        Ok(())
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        let (Some(target), Some(outbox)) = (&self.target, &mut self.outbox) else {
            return Err("its start failed, so nothing is sent".into());
        };
        let n = values.len() as u64;
        let line = json!({"step": step, "values": object(values)}).to_string();
        outbox.push(Record::new(n, line), |r: &[Record]| target.send(r));
        Ok(())
    }

    fn finish(&mut self) -> Result<(), String> {
        if let (Some(target), Some(outbox)) = (&self.target, &mut self.outbox) {
            outbox.flush(|r: &[Record]| target.send(r));
        }
        Ok(())
    }
}

export_tracker!(HttpJson);
