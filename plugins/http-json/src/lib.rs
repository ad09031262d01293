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
//! sent as `Authorization: Bearer <value>`. A reply outside 2xx, or a
//! request hearth refuses, is an error of the call (its values are lost).

use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use serde_json::{json, Map};

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
struct HttpJson {
    url: String,
    batch: usize,
    token: Option<String>,
    /// The run's fields sent with every POST.
    run: Map<String, serde_json::Value>,
    records: Vec<serde_json::Value>,
}

impl HttpJson {
    fn post(&mut self, extra: Map<String, serde_json::Value>) -> Result<(), String> {
        let mut doc = self.run.clone();
        doc.extend(extra);
        doc.insert("records".into(), json!(std::mem::take(&mut self.records)));
        let auth = self.token.as_ref().map(|t| format!("Bearer {t}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(auth) = &auth {
            headers.push(("authorization", auth));
        }
        let body = serde_json::Value::Object(doc).to_string();
        let reply = hearth_guest::http::post(&self.url, &headers, body.as_bytes())?;
        if !(200..300).contains(&reply.status) {
            let text =
                String::from_utf8_lossy(&reply.body[..reply.body.len().min(200)]).into_owned();
            return Err(format!("{} answered {}: {text}", self.url, reply.status));
        }
        Ok(())
    }
}

impl Tracker for HttpJson {
    fn start(&mut self, start: Start) -> Result<(), String> {
        let url = match start.option("url") {
            Some(Value::Text(url)) if !url.is_empty() => url.clone(),
            _ => return Err("set `url` in this tracker's [[trackers]] options".into()),
        };
        self.batch = match start.option("batch") {
            Some(Value::Int(n)) if *n >= 1 => *n as usize,
            _ => return Err("`batch` must be at least 1".into()),
        };
        if let Some(Value::Text(name)) = start.option("token-env") {
            if !name.is_empty() {
                let token = std::env::var(name).map_err(|_| {
                    format!(
                        "`token-env` names {name}, which this plugin was not granted or is unset"
                    )
                })?;
                self.token = Some(token);
            }
        }
        // Only a start that succeeded sends anything.
        self.url = url;
        let run = &start.run;
        self.run = [
            ("project".to_string(), json!(run.project)),
            ("run".to_string(), json!(run.run)),
            ("process".to_string(), json!(run.process_index)),
        ]
        .into_iter()
        .collect();
        let mut first = Map::new();
        first.insert("config".into(), json!(object(start.config)));
        self.post(first)
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        if self.url.is_empty() {
            return Err("its start failed, so nothing is sent".into());
        }
        self.records
            .push(json!({"step": step, "values": object(values)}));
        if self.records.len() >= self.batch {
            self.post(Map::new())?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), String> {
        if !self.records.is_empty() && !self.url.is_empty() {
            self.post(Map::new())?;
        }
        Ok(())
    }
}

export_tracker!(HttpJson);
