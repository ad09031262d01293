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
