//! The `mlflow` tracker, with Accelerate's `MLflowTracker` semantics: the run
//! config becomes params, numbers become metrics (bools as 0/1), text values
//! become run tags, and `finish` marks the run FINISHED. By default it
//! writes MLflow's file store under `/logs` ([`file_store`]); with
//! `tracking-uri = "http(s)://HOST:PORT"` (a host its user grants) it logs
//! to that tracking server through MLflow's REST API ([`rest`]).

mod file_store;
mod rest;

use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use std::time::{SystemTime, UNIX_EPOCH};

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// MLflow accepts alphanumerics, `_ - . / space` in names; others become `_`.
fn key(name: &str) -> String {
    let k: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_-./ ".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    k.trim_matches('/').replace("..", "__")
}

/// A config value as an MLflow param's text (Python's spelling of bools,
/// as Accelerate's tracker logs them).
fn param_text(value: &Value) -> String {
    match value {
        Value::Float(v) => format!("{v:?}"),
        Value::Int(v) => v.to_string(),
        Value::Boolean(v) => if *v { "True" } else { "False" }.to_string(),
        Value::Text(v) => v.clone(),
    }
}

/// A logged value as MLflow takes it: a number is a metric (bools as 0/1),
/// text a tag.
enum Logged {
    Metric(f64),
    Tag(String),
}

impl From<Value> for Logged {
    fn from(value: Value) -> Self {
        match value {
            Value::Float(v) => Logged::Metric(v),
            Value::Int(v) => Logged::Metric(v as f64),
            Value::Boolean(v) => Logged::Metric(f64::from(u8::from(v))),
            Value::Text(text) => Logged::Tag(text),
        }
    }
}

/// Where the run goes.
enum Store {
    File(file_store::FileStore),
    Server(Box<rest::Server>),
}

#[derive(Default)]
struct Mlflow(Option<Store>);

impl Tracker for Mlflow {
    fn start(&mut self, start: Start) -> Result<(), String> {
        let uri = match start.option("tracking-uri") {
            Some(Value::Text(uri)) => uri.trim_end_matches('/').to_string(),
            _ => String::new(),
        };
        if uri.is_empty() {
            let mut store = file_store::FileStore::default();
            store.start(start.run, start.config)?;
            self.0 = Some(Store::File(store));
        } else {
            self.0 = Some(Store::Server(Box::new(rest::Server::start(uri, start)?)));
        }
        Ok(())
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        match self.0.as_mut().ok_or("log called before start")? {
            Store::File(store) => store.log(step, values),
            Store::Server(server) => {
                server.log(step, values);
                Ok(())
            }
        }
    }

    fn finish(&mut self) -> Result<(), String> {
        match self.0.take() {
            Some(Store::File(mut store)) => store.finish(),
            Some(Store::Server(mut server)) => {
                server.finish();
                Ok(())
            }
            None => Ok(()),
        }
    }
}

export_tracker!(Mlflow);
