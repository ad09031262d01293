//! `[[trackers]]`: experiment trackers, each a tracker plugin (Accelerate's
//! `log_with`). They log from the main process only, into
//! `<run folder>/trackers/<name>/`.

use serde::Deserialize;

/// One `[[trackers]]` entry.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TrackerSection {
    /// The plugin's name (`hearth plugins list` shows what is installed).
    pub name: String,
}
