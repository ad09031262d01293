//! The operators the graph pass puts where a Llama-family block's chains
//! were (`csrc/jit_patterns.cpp`, `csrc/llama_blocks.cpp`), callable on
//! their own: on float32 CPU tensors, where hearth's kernels run
//! ([`CpuKernels::runs_hearths_kernels`](crate::CpuKernels::runs_hearths_kernels)),
//! one pass forward and one backward; anything else runs the chain each
//! replaced, op for op. A second derivative through the kernels
//! (`create_graph`) is an error.

use super::{check, ffi, path};
use tch::Tensor;
use torch_sys::C_tensor;

/// The handle of a tensor borrowed for one call.
fn handle(t: &Tensor) -> *mut C_tensor {
    t.as_ptr() as *mut C_tensor
}

/// The tensor `call` hands back, or a panic naming `what` with libtorch's error.
fn returned(what: &str, call: impl FnOnce(*mut *mut C_tensor) -> *mut std::ffi::c_char) -> Tensor {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    match check(call(&mut out)) {
        // SAFETY: on success `out` is a new at::Tensor owned by us from here on.
        Ok(()) => unsafe { Tensor::from_ptr(out) },
        Err(e) => panic!("{what}: {e}"),
    }
}

/// RMSNorm as transformers' Llama, Qwen2 and Mistral write it:
/// `weight * (x * rsqrt(mean(x², -1, keepdim) + eps))`, computed in float32
/// (`x` cast to it first), `weight` a float32 vector of `x`'s last size.
///
/// # Panics
/// When libtorch raises an error, and when `HEARTH_CPU_KERNELS` names a
/// path this process cannot run.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    rms_norm_on(x, weight, eps, path().code())
}

/// [`rms_norm`] by the kernels `code` names (`csrc/kernel_paths.h`).
pub(crate) fn rms_norm_on(x: &Tensor, weight: &Tensor, eps: f64, code: i32) -> Tensor {
    // SAFETY: live handles borrowed for the call.
    returned("rms_norm", |out| unsafe {
        ffi::hearth_rms_norm(handle(x), handle(weight), eps, code, out)
    })
}

/// The SiLU-gated unit of a Llama MLP: `silu(gate) * up`, of one shape.
///
/// # Panics
/// As [`rms_norm`].
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    swiglu_on(gate, up, path().code())
}

/// [`swiglu`] by the kernels `code` names.
pub(crate) fn swiglu_on(gate: &Tensor, up: &Tensor, code: i32) -> Tensor {
    // SAFETY: live handles borrowed for the call.
    returned("swiglu", |out| unsafe {
        ffi::hearth_swiglu(handle(gate), handle(up), code, out)
    })
}

/// A rotary position embedding applied as transformers applies it:
/// `x * cos + rotate_half(x) * sin`, `rotate_half(x)` being `x`'s second
/// half negated, then its first half, along the last dimension; `cos` and
/// `sin` broadcast to `x` (its gradient is not taken through them).
///
/// # Panics
/// As [`rms_norm`].
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    rotary_on(x, cos, sin, path().code())
}

/// [`rotary`] by the kernels `code` names.
pub(crate) fn rotary_on(x: &Tensor, cos: &Tensor, sin: &Tensor, code: i32) -> Tensor {
    // SAFETY: live handles borrowed for the call.
    returned("rotary", |out| unsafe {
        ffi::hearth_rotary(handle(x), handle(cos), handle(sin), code, out)
    })
}
