//! Typed Rust bindings to libtorch pieces that tch does not expose (the C++
//! shim in `host/csrc/shim.cpp`): fused optimizer steps, foreach norms, the
//! gradient scaler's kernels, autocast on any device and generator states.

mod amp;
mod ffi;
mod foreach;
mod jit;
mod rng;

pub use amp::{amp_unscale_, amp_update_scale_, AutocastGuard};
pub use foreach::{
    clear_grads, foreach_mul_, foreach_norm, fused_adam, fused_sgd, on_grad_accumulated, set_grad,
    AdamHyper, SgdHyper,
};
pub use jit::{jit_structure, JitStructure};
pub use rng::{empty_device_cache, randperm, rng_state, set_rng_state};
