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

/// Returns the host memory freed so far to the system (glibc's
/// `malloc_trim`). Freed tensors smaller than glibc's mmap threshold (which
/// grows to 32 MiB as large blocks are freed) otherwise stay in the
/// process's heap: FULL_SHARD calls it once it has released the whole
/// model it was built from.
pub fn return_freed_host_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks glibc's own heap structures.
    unsafe {
        libc::malloc_trim(0);
    }
}
