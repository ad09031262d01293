//! `[[trackers]]`: experiment trackers, each a tracker plugin (Accelerate's
//! `log_with`). They log from the main process only, into
//! `<run folder>/trackers/<name>/`.

use super::{ConfigError, Invalid};
use serde::Deserialize;

/// One `[[trackers]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TrackerSection {
    /// The plugin's name (`hearth plugins list` shows what is installed).
    pub name: String,
}

pub(super) fn validate(trackers: &[TrackerSection], invalid: &Invalid) -> Result<(), ConfigError> {
    for (i, t) in trackers.iter().enumerate() {
        if t.name.is_empty() {
            return Err(invalid(
                &format!("trackers[{i}].name"),
                "must name a tracker plugin".into(),
            ));
        }
        if trackers[..i].iter().any(|o| o.name == t.name) {
            return Err(invalid(
                &format!("trackers[{i}].name"),
                format!("lists tracker `{}` twice", t.name),
            ));
        }
    }
    Ok(())
}
