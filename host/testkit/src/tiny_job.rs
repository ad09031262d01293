//! The canonical tiny job of the tests (`tests/fixtures/tiny-job.toml`),
//! which Python's `conftest.tiny_job()` reads too.

use crate::repo_root;

/// The tiny job with some keys changed:
/// `TinyJob::new().set("run", "steps", 24).set("data", "digits", 6).toml()`.
#[derive(Debug, Clone)]
pub struct TinyJob(toml::Table);

impl Default for TinyJob {
    fn default() -> Self {
        Self::new()
    }
}

impl TinyJob {
    /// The job as the fixture file has it.
    pub fn new() -> Self {
        let path = repo_root().join("tests/fixtures/tiny-job.toml");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        Self(toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
    }

    /// Sets `[table] key = value`, adding the table if it is missing.
    pub fn set(mut self, table: &str, key: &str, value: impl Into<toml::Value>) -> Self {
        self.table(table).insert(key.into(), value.into());
        self
    }

    /// Removes `key` from `[table]`.
    pub fn remove(mut self, table: &str, key: &str) -> Self {
        self.table(table).remove(key);
        self
    }

    /// The job as TOML text.
    pub fn toml(&self) -> String {
        toml::to_string(&self.0).expect("a table serialises")
    }

    fn table(&mut self, name: &str) -> &mut toml::Table {
        self.0
            .entry(name)
            .or_insert_with(|| toml::Value::Table(Default::default()))
            .as_table_mut()
            .unwrap_or_else(|| panic!("`{name}` is not a table in the tiny job"))
    }
}
