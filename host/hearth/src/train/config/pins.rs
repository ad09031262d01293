//! Pinned plugins. `hearth.lock` beside a run config holds the sha256 of
//! each plugin component the configs in that folder use (as Cargo.lock
//! does for crates); `hearth plugins lock CONFIG` writes it. A
//! `[[trackers]]`, `[scheduler]` or `[[checkpoint-hooks]]` table may also
//! pin its plugin itself with `sha256 = "…"`. A run refuses a component
//! whose hash differs from its pin before compiling it.
//!
//! ```toml
//! # hearth.lock
//! [plugins]
//! tensorboard = "3f0c…"
//! ```

use super::ConfigError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The lock file's name, beside the run config.
pub const LOCK_FILE: &str = "hearth.lock";

const HEADER: &str = "# Written by `hearth plugins lock CONFIG`: the sha256 of each plugin\n\
# component the run configs beside it use. `hearth run` refuses a component\n\
# whose hash differs. After updating a plugin on purpose, review it and run\n\
# `hearth plugins lock CONFIG` again.\n";

/// `hearth.lock`: plugin name → sha256.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginLock {
    /// Each pinned plugin's sha256.
    #[serde(default)]
    pub plugins: BTreeMap<String, String>,
}

impl PluginLock {
    /// Where the lock of the run config `config` is.
    pub fn path_for(config: &Path) -> PathBuf {
        config.parent().unwrap_or(Path::new(".")).join(LOCK_FILE)
    }

    /// The lock beside `config`: empty when there is none; an error names
    /// the lock file and what is wrong in it.
    pub fn read_for(config: &Path) -> Result<Self, ConfigError> {
        let path = Self::path_for(config);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => return Err(ConfigError::Read { path, source }),
        };
        let bad = |message: String| ConfigError::Parse {
            path: path.clone(),
            message,
        };
        let mut lock: Self = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        for (name, pin) in lock.plugins.iter_mut() {
            *pin =
                hearth_plugins::parse_pin(pin).map_err(|e| bad(format!("plugins.{name}: {e}")))?;
        }
        Ok(lock)
    }

    /// Writes the lock beside `config` (through a temporary file: a lock
    /// is whole or absent).
    pub fn write_for(&self, config: &Path) -> std::io::Result<PathBuf> {
        let path = Self::path_for(config);
        let text = format!(
            "{HEADER}{}",
            toml::to_string(self).expect("a map of strings serialises")
        );
        let tmp = path.with_extension("lock.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_reads_back_what_was_written_and_a_bad_pin_names_the_file_and_plugin() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("job.toml");
        assert_eq!(
            PluginLock::read_for(&config).unwrap(),
            PluginLock::default()
        );
        let mut lock = PluginLock::default();
        lock.plugins.insert("jsonl".into(), "a".repeat(64));
        let path = lock.write_for(&config).unwrap();
        assert_eq!(path, dir.path().join("hearth.lock"));
        assert_eq!(PluginLock::read_for(&config).unwrap(), lock);
        std::fs::write(&path, "[plugins]\njsonl = \"abc\"\n").unwrap();
        let e = PluginLock::read_for(&config).unwrap_err().to_string();
        assert!(
            e.contains("hearth.lock") && e.contains("plugins.jsonl"),
            "{e}"
        );
    }
}
