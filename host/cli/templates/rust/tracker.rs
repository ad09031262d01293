//! {{name}}: a hearth tracker. It appends the numbers of every `every`-th
//! logged step to `/logs/values.jsonl`, one JSON object per line.
//!
//! Build and install it with `hearth plugins build` and `hearth plugins
//! install .`; test it on this machine with `cargo test`.
use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use std::io::Write;

#[derive(Default)]
struct Plugin {
    out: Option<std::fs::File>,
    every: u64,
    calls: u64,
}

impl Tracker for Plugin {
    fn start(&mut self, start: Start) -> Result<(), String> {
        // Declared in plugin.toml ([options.every], default 1).
        self.every = match start.option("every") {
            Some(Value::Int(n)) if *n > 0 => *n as u64,
            _ => 1,
        };
        // Append: after a fault a fresh instance starts (start.restart is
        // then set) and goes on where the failed one stopped; a new run
        // starts with /logs empty.
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open("/logs/values.jsonl")
            .map_err(|e| format!("values.jsonl: {e}"))?;
        self.out = Some(file);
        Ok(())
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        self.calls += 1;
        if (self.calls - 1) % self.every != 0 {
            return Ok(());
        }
        let out = self.out.as_mut().ok_or("log before start")?;
        writeln!(out, "{}", line(step, &values)).map_err(|e| e.to_string())
    }
}

/// One JSON object: the step and every number logged with it.
fn line(step: u64, values: &Entries) -> String {
    let mut fields = vec![format!("\"step\":{step}")];
    for (name, value) in values {
        let number = match value {
            Value::Float(v) if v.is_finite() => v.to_string(),
            Value::Int(v) => v.to_string(),
            _ => continue,
        };
        fields.push(format!("\"{}\":{number}", name.replace(['"', '\\'], "_")));
    }
    format!("{{{}}}", fields.join(","))
}

export_tracker!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_holds_the_step_and_the_numbers() {
        let values = vec![
            ("loss".to_string(), Value::Float(0.5)),
            ("tokens".to_string(), Value::Int(64)),
            ("note".to_string(), Value::Text("skipped".into())),
        ];
        assert_eq!(line(3, &values), r#"{"step":3,"loss":0.5,"tokens":64}"#);
    }
}
