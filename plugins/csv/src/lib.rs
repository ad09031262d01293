//! The `csv` tracker: `/logs/metrics.csv` in long form, one row per logged
//! value (`step,name,value`), so metrics that appear at different steps
//! (training loss, eval accuracy) share one file. Text values are quoted as
//! RFC 4180 asks.

use hearth_guest::{export_tracker, Entries, Tracker, Value};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};

fn quote(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

#[derive(Default)]
struct Csv {
    out: Option<BufWriter<File>>,
}

impl Tracker for Csv {
    fn start(&mut self, _start: hearth_guest::Start) -> Result<(), String> {
        // Append: after a fault the host re-instantiates the tracker and replays
        // `start`; earlier rows must survive and the header appear once.
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open("/logs/metrics.csv")
            .map_err(|e| format!("metrics.csv: {e}"))?;
        let fresh = file.metadata().map(|m| m.len() == 0).unwrap_or(true);
        let mut out = BufWriter::new(file);
        if fresh {
            writeln!(out, "step,name,value").map_err(|e| e.to_string())?;
        }
        self.out = Some(out);
        Ok(())
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        let out = self.out.as_mut().ok_or("log called before start")?;
        for (name, value) in values {
            let value = match value {
                Value::Float(v) => v.to_string(),
                Value::Int(v) => v.to_string(),
                Value::Boolean(v) => v.to_string(),
                Value::Text(v) => quote(&v),
            };
            writeln!(out, "{step},{},{value}", quote(&name)).map_err(|e| e.to_string())?;
        }
        out.flush().map_err(|e| e.to_string())
    }

    fn finish(&mut self) -> Result<(), String> {
        if let Some(mut out) = self.out.take() {
            out.flush().map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

export_tracker!(Csv);
