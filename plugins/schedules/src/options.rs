//! Reading a schedule's options (a JSON object) with messages that name the
//! option, and refusing options the schedule does not know.

use serde_json::{Map, Value};

/// The options left to read.
pub struct Options {
    map: Map<String, Value>,
}

impl Options {
    /// Parses `json`, an object.
    pub fn parse(json: &str) -> Result<Self, String> {
        let map = serde_json::from_str(json)
            .map_err(|e| format!("options are not a JSON object: {e}"))?;
        Ok(Self { map })
    }

    /// Takes a string option.
    pub fn string(&mut self, key: &str) -> Result<Option<String>, String> {
        match self.map.remove(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(format!("`{key}` must be a string, not {other}")),
        }
    }

    /// Takes a whole-number option ≥ 0.
    pub fn count(&mut self, key: &str) -> Result<Option<u64>, String> {
        match self.map.remove(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or(format!("`{key}` must be a whole number ≥ 0, not {v}")),
        }
    }

    /// Takes a finite number option.
    pub fn number(&mut self, key: &str) -> Result<Option<f64>, String> {
        match self.map.remove(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or(format!("`{key}` must be a number, not {v}")),
        }
    }

    /// Takes a boolean option.
    pub fn flag(&mut self, key: &str) -> Result<Option<bool>, String> {
        match self.map.remove(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or(format!("`{key}` must be true or false, not {v}")),
        }
    }

    /// Takes a number, or a list of numbers (one per parameter group).
    pub fn numbers(&mut self, key: &str, groups: usize) -> Result<Option<Vec<f64>>, String> {
        let bad =
            |v: &Value| format!("`{key}` must be a number or a list of {groups} numbers, not {v}");
        match self.map.remove(key) {
            None => Ok(None),
            Some(Value::Array(items)) => {
                let list: Option<Vec<f64>> = items.iter().map(Value::as_f64).collect();
                match list {
                    Some(list) if list.len() == groups => Ok(Some(list)),
                    _ => Err(bad(&Value::Array(items))),
                }
            }
            Some(v) => v
                .as_f64()
                .map(|x| Some(vec![x; groups]))
                .ok_or_else(|| bad(&v)),
        }
    }

    /// Fails if an option was not taken, naming it and the known ones.
    pub fn finish(self, schedule: &str, known: &[&str]) -> Result<(), String> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(key) if known.is_empty() => {
                Err(format!("unknown option `{key}` (`{schedule}` takes none)"))
            }
            Some(key) => Err(format!(
                "unknown option `{key}` for `{schedule}` (known: {})",
                known.join(", ")
            )),
        }
    }
}
