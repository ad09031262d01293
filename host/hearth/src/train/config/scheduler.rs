//! `[scheduler]`: a learning-rate schedule, which is a scheduler plugin.
//! `name` picks the plugin; every other key is its option, handed to it as
//! JSON (the plugin refuses options it does not know, naming them).
//!
//! ```toml
//! [scheduler]
//! name = "linear"
//! warmup-steps = 100
//! ```

use super::{ConfigError, Invalid};
use serde::Deserialize;

/// The `[scheduler]` table.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
pub struct SchedulerSection {
    /// The plugin's name (`hearth plugins list` shows what is installed).
    pub name: String,
    /// The sha256 of the plugin's component, pinned: a component that
    /// hashes otherwise is refused (`hearth plugins list` prints each one's).
    #[serde(default)]
    pub sha256: Option<String>,
    /// The plugin's options: the rest of the table.
    #[serde(flatten)]
    #[schemars(with = "serde_json::Map<String, serde_json::Value>")]
    pub options: toml::Table,
}

impl SchedulerSection {
    /// The options as a JSON object, as the scheduler world takes them.
    pub fn options_json(&self) -> String {
        serde_json::to_string(&self.options).expect("TOML values serialize to JSON")
    }

    pub(super) fn validate(&self, invalid: &Invalid) -> Result<(), ConfigError> {
        if self.name.is_empty() {
            return Err(invalid(
                "scheduler.name",
                "must name a scheduler plugin".into(),
            ));
        }
        Ok(())
    }
}
