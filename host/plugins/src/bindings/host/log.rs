//! `hearth:plugin/log`: a plugin's log lines, clipped, as hearth's own
//! under the plugin's name (every world imports it).

use super::super::tracker::hearth::plugin::log;
use crate::sandbox::PluginState;

/// Longest log line a plugin may send; the rest is cut.
const MAX_LOG_LINE: usize = 4096;

impl log::Host for PluginState {
    fn log(&mut self, level: log::Level, message: String) {
        let message = crate::stdio::clip(&message, MAX_LOG_LINE);
        let name = self.name();
        match level {
            log::Level::Debug => tracing::debug!("[plugin {name}] {message}"),
            log::Level::Info => tracing::info!("[plugin {name}] {message}"),
            log::Level::Warn => tracing::warn!("[plugin {name}] {message}"),
            log::Level::Error => tracing::error!("[plugin {name}] {message}"),
        }
    }
}
