//! hearth — a training host for Rust and libtorch.
//!
//! The same training job runs on one CPU, many processes or many GPUs; what a
//! user customises is a sandboxed WebAssembly plugin. See `DESIGN.md` and the
//! README for the layout: each module below owns one concern, and
//! dependencies point one way (`cli` → `train` → `accelerator` → the rest).
#![warn(missing_docs)]

pub mod accelerator;
pub mod big_model;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod dist;
pub mod durable;
pub mod environment;
/// Fuzz-target bodies (the `fuzz/` crate and `tests/fuzz_corpus.rs` call them).
#[doc(hidden)]
pub mod fuzz_entry;
pub mod launch;
pub mod models;
pub mod ops;
pub mod optim;
pub mod parallel;
pub mod plugins;
pub mod precision;
pub mod profiling;
pub mod report;
pub mod train;

/// `e` and its causes, joined with `: ` (one line for a log or a panic).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut at = e.source();
    while let Some(cause) = at {
        parts.push(cause.to_string());
        at = cause.source();
    }
    parts.join(": ")
}
