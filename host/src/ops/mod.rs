//! Typed Rust bindings to libtorch kernels that tch does not expose (the C++
//! shim in `host/csrc/shim.cpp`): fused optimizer steps and foreach norms.

mod ffi;
mod foreach;

pub use foreach::{foreach_mul_, foreach_norm, fused_adamw, fused_sgd, AdamWHyper, SgdHyper};
