//! File helpers for trackers writing into `/logs`: whole files replaced
//! atomically, and append-only logs kept open. Each write is a host call, so
//! both write a line in one call.

use std::collections::hash_map::{Entry, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::Write;

fn create_parent(path: &str) -> Result<(), String> {
    match path.rsplit_once('/') {
        Some((dir, _)) if !dir.is_empty() => {
            fs::create_dir_all(dir).map_err(|e| format!("{dir}: {e}"))
        }
        _ => Ok(()),
    }
}

/// Replaces `path` with `text` (write-then-rename, so a reader never sees
/// half a file), creating its folder if needed.
pub fn write_atomically(path: &str, text: &str) -> Result<(), String> {
    create_parent(path)?;
    let tmp = format!("{path}.tmp");
    fs::write(&tmp, text)
        .and_then(|_| fs::rename(&tmp, path))
        .map_err(|e| format!("{path}: {e}"))
}

/// Append-only files, opened once (opening costs more than the write).
#[derive(Default)]
pub struct Appenders {
    open: HashMap<String, File>,
}

impl Appenders {
    /// Appends `line` (a newline is added) to `path`, creating it and its
    /// folder if needed and writing `header` first into a new, empty file.
    pub fn append(&mut self, path: &str, header: Option<&str>, line: &str) -> Result<(), String> {
        let file = match self.open.entry(path.to_string()) {
            Entry::Occupied(open) => open.into_mut(),
            Entry::Vacant(slot) => {
                create_parent(path)?;
                let mut file = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| format!("{path}: {e}"))?;
                if let Some(header) = header {
                    if file.metadata().map(|m| m.len() == 0).unwrap_or(true) {
                        file.write_all(format!("{header}\n").as_bytes())
                            .map_err(|e| format!("{path}: {e}"))?;
                    }
                }
                slot.insert(file)
            }
        };
        file.write_all(format!("{line}\n").as_bytes())
            .map_err(|e| format!("{path}: {e}"))
    }

    /// Closes every file.
    pub fn close_all(&mut self) {
        self.open.clear();
    }
}
