//! hearth's WIT line (`wit/`, `hearth:plugin`): the bindings generated from
//! it, one `bindgen!` per world, and in `host/` the host side of each
//! interface a world imports, one file per interface (as wasmtime's
//! `p2/host/`). A second WIT line (old plugins kept loading beside new
//! ones) would be a folder beside this one, its own bindings and host
//! impls, both over the same `PluginState`.

mod host;

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
