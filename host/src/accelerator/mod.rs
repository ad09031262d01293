//! The user-facing façade, Accelerate's `Accelerator` for Rust: it owns the
//! device and the process group and runs the steps of training that depend
//! on them (backward, gradient clipping, printing once).

mod builder;
mod facade;
mod grad;
mod trackers;

pub use builder::AcceleratorBuilder;
pub use facade::Accelerator;
pub use grad::clip_grad_norm_;
pub use trackers::TrackerHub;
