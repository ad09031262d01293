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

#[cfg(test)]
mod tests {
    use super::*;

    fn path(dir: &tempfile::TempDir, name: &str) -> String {
        dir.path().join(name).to_str().unwrap().to_string()
    }

    #[test]
    fn an_atomic_write_replaces_the_whole_file_and_makes_its_folder() {
        let dir = tempfile::tempdir().unwrap();
        let file = path(&dir, "a/b/summary.json");
        write_atomically(&file, "{\"loss\": 2}").unwrap();
        write_atomically(&file, "{}").unwrap();
        assert_eq!(fs::read_to_string(&file).unwrap(), "{}");
        assert!(!std::path::Path::new(&format!("{file}.tmp")).exists());
    }

    #[test]
    fn appenders_write_the_header_once_also_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let file = path(&dir, "m/metrics.csv");
        let mut logs = Appenders::default();
        logs.append(&file, Some("step,loss"), "1,2.5").unwrap();
        logs.append(&file, Some("step,loss"), "2,2.0").unwrap();
        logs.close_all();
        // A resumed run opens the file again: no second header.
        let mut resumed = Appenders::default();
        resumed.append(&file, Some("step,loss"), "3,1.5").unwrap();
        drop(resumed);
        assert_eq!(
            fs::read_to_string(&file).unwrap(),
            "step,loss\n1,2.5\n2,2.0\n3,1.5\n"
        );
    }

    #[test]
    fn a_file_that_cannot_be_opened_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = path(&dir, "blocker");
        fs::write(&blocker, "a file, not a folder").unwrap();
        let e = Appenders::default()
            .append(&format!("{blocker}/x.log"), None, "line")
            .unwrap_err();
        assert!(e.contains("blocker"), "{e}");
    }
}
