//! hearth — a training host for Rust and libtorch.
//!
//! The same training job runs on one CPU, many processes or many GPUs; what a
//! user customises is a sandboxed WebAssembly plugin. This crate is the
//! library a program uses: the [`accelerator`] façade, the data-parallel
//! strategies ([`parallel`]), checkpoints, data, models, optimizers and the
//! config-driven loop behind `hearth run` ([`train`]). It stands on three
//! crates below it, re-exported here under the names a user reads:
//! [`ops`] (libtorch operations, tensor bytes, durable writes), [`comm`]
//! (process groups and the launch environment) and [`plugins`] (the
//! sandboxed plugin host). The `hearth` binary is the `hearth-cli` crate,
//! above this one. The architecture page of the book draws the layers.
#![warn(missing_docs)]

pub mod accelerator;
pub mod big_model;
pub mod checkpoint;
pub mod data;
pub mod launch;
pub mod models;
pub mod optim;
pub mod parallel;
pub mod precision;
pub mod profiling;
pub mod train;

pub use hearth_comm as comm;
pub use hearth_ops as ops;
pub use hearth_plugins as plugins;
/// The `tch` hearth is built against (`=0.24.0`, the pair of libtorch
/// 2.11): write `hearth::tch::Tensor` and pin no `tch` of your own, so the
/// two can never differ.
pub use tch;

/// Unit tests that seed or draw from libtorch's global generator hold this
/// lock, and so do the fixtures that draw (`models::tiny_gpt` initialises
/// its weights): the harness runs tests on several threads, and a draw on
/// another thread between a test's seed and its own draws changes what it
/// gets (the unit-wise dropout replay test compares two seeded runs). A
/// thread that holds it may take it again, so a locked test can call a
/// locked fixture.
#[cfg(test)]
pub(crate) fn global_rng() -> GlobalRng {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let held = HELD.with(|h| h.get());
    let guard = (!held).then(|| LOCK.lock().unwrap_or_else(|p| p.into_inner()));
    HELD.with(|h| h.set(true));
    GlobalRng(guard)
}

#[cfg(test)]
thread_local! {
    static HELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The guard of [`global_rng`]: the outermost one on a thread releases it.
#[cfg(test)]
pub(crate) struct GlobalRng(Option<std::sync::MutexGuard<'static, ()>>);

#[cfg(test)]
impl Drop for GlobalRng {
    fn drop(&mut self) {
        if self.0.is_some() {
            HELD.with(|h| h.set(false));
        }
    }
}
