//! `[[trackers]]`: experiment trackers, each a tracker plugin (Accelerate's
//! `log_with`). They log from the main process only, into
//! `<run folder>/trackers/<name>/`. `name` picks the plugin; every other
//! key is its option (a number, boolean or string), checked against the
//! options its `plugin.toml` declares.
//!
//! ```toml
//! [[trackers]]
//! name = "tensorboard"
//! [[trackers]]
//! name = "summary-stats"
//! every = 5
//! ```

use serde::Deserialize;

/// One `[[trackers]]` entry.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
pub struct TrackerSection {
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
