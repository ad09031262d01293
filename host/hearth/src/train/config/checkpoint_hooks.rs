//! `[[checkpoint-hooks]]`: checkpoint hook plugins, run in order around
//! every checkpoint the run saves or loads. `name` picks the plugin; every
//! other key is its option, handed to it as JSON.
//!
//! ```toml
//! [[checkpoint-hooks]]
//! name = "manifest-sha256"
//! [[checkpoint-hooks]]
//! name = "reduced-precision"
//! dtype = "bf16"
//! tensors = ["*.weight"]
//! ```

use serde::Deserialize;

/// One `[[checkpoint-hooks]]` entry.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
pub struct CheckpointHookSection {
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

impl CheckpointHookSection {
    /// The options as a JSON object, as the checkpoint world takes them.
    pub fn options_json(&self) -> String {
        serde_json::to_string(&self.options).expect("TOML values serialize to JSON")
    }
}
