//! Host bindings generated from `wit/`, one `bindgen!` per world, and the
//! host side of the imports every world shares (`log`).

use super::sandbox::PluginState;

/// The `tracker-plugin` world.
#[allow(missing_docs)]
pub mod tracker {
    wasmtime::component::bindgen!({
        path: "wit",
        world: "hearth:plugin/tracker-plugin",
        exports: { default: async },
    });
}

/// The `scheduler-plugin` world; shares `log` with the tracker's.
#[allow(missing_docs)]
pub mod scheduler {
    wasmtime::component::bindgen!({
        path: "wit",
        world: "hearth:plugin/scheduler-plugin",
        exports: { default: async },
        with: {
            "hearth:plugin/log": super::tracker::hearth::plugin::log,
        },
    });
}

/// The `checkpoint-plugin` world: the hook, and the tensor reader and
/// writer resources the host hands it.
#[allow(missing_docs)]
pub mod checkpoint {
    wasmtime::component::bindgen!({
        path: "wit",
        world: "hearth:plugin/checkpoint-plugin",
        exports: { default: async },
        with: {
            "hearth:plugin/log": super::tracker::hearth::plugin::log,
            "hearth:plugin/types": super::tracker::hearth::plugin::types,
            "hearth:plugin/tensors.tensor-reader": crate::tensors::TensorReader,
            "hearth:plugin/tensors.tensor-writer": crate::tensors::TensorWriter,
        },
    });
}

/// The `wrap-policy-plugin` world; shares `log` with the tracker's.
#[allow(missing_docs)]
pub mod wrap_policy {
    wasmtime::component::bindgen!({
        path: "wit",
        world: "hearth:plugin/wrap-policy-plugin",
        exports: { default: async },
        with: {
            "hearth:plugin/log": super::tracker::hearth::plugin::log,
        },
    });
}

pub use tracker::hearth::plugin::types::{RunInfo, Value};
use tracker::hearth::plugin::{delivery, log, types};

/// Longest log line a plugin may send; the rest is cut.
const MAX_LOG_LINE: usize = 4096;

impl types::Host for PluginState {}

impl log::Host for PluginState {
    fn log(&mut self, level: log::Level, message: String) {
        let message = super::stdio::clip(&message, MAX_LOG_LINE);
        let name = self.name();
        match level {
            log::Level::Debug => tracing::debug!("[plugin {name}] {message}"),
            log::Level::Info => tracing::info!("[plugin {name}] {message}"),
            log::Level::Warn => tracing::warn!("[plugin {name}] {message}"),
            log::Level::Error => tracing::error!("[plugin {name}] {message}"),
        }
    }
}

impl delivery::Host for PluginState {
    /// Keeps the tracker's latest counts for its health (summary.json).
    fn report(&mut self, counts: delivery::Counts) {
        self.delivery = Some(crate::tracker::DeliveryCounts {
            sent: counts.sent,
            retried: counts.retried,
            spooled: counts.spooled,
            dropped: counts.dropped,
        });
    }
}
