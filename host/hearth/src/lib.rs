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
