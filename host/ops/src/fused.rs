//! Kernels hearth fuses where eager libtorch runs several (`host/ops/csrc/gelu.cpp`,
//! `host/ops/csrc/attention.cpp`).

use super::cpu_kernels::{cpu_kernels, CpuKernels};
use super::{ffi, foreach::check};
use tch::Tensor;
use torch_sys::C_tensor;

/// This process's kernel path ([`cpu_kernels`]). A `HEARTH_CPU_KERNELS`
/// it cannot honour panics here, naming the variable; `hearth` itself
/// refuses it at start (exit 2) before any model runs.
fn path() -> CpuKernels {
    cpu_kernels().unwrap_or_else(|e| panic!("{e}"))
}

/// The exact GELU (`torch.nn.functional.gelu(x)`, erf form).
///
/// On a float32 CPU tensor that needs a gradient, where hearth's kernels
/// run ([`CpuKernels::runs_hearths_kernels`]; GELU is AVX2 on both of
/// their paths), the forward pass also computes
/// GELU's derivative in the same pass, and the backward pass multiplies the
/// incoming gradient by it: libtorch's `gelu_backward` evaluates erf and
/// exp again. erf is Abramowitz and Stegun's 7.1.26 (within 1.5e-7 of the
/// true erf), as libtorch's own vectorised GELU below AVX-512 evaluates
/// it; the tests bound every rounding of it (`fused/bounds.rs`). It costs
/// no memory (the derivative is kept instead of the input). The one
/// difference: a second derivative through it (`create_graph`) is an
/// error. Everything else is libtorch's `gelu`.
///
/// # Panics
/// As tch's own ops do, when libtorch raises an error; and when
/// `HEARTH_CPU_KERNELS` names a path this process cannot run.
pub fn gelu(x: &Tensor) -> Tensor {
    gelu_on(x, path().code())
}

/// [`gelu`] by the kernels `code` names (`csrc/kernel_paths.h`).
fn gelu_on(x: &Tensor, code: i32) -> Tensor {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: `x` is a live handle borrowed for the call; on success `out`
    // is a new at::Tensor owned by us from here on.
    match check(unsafe { ffi::hearth_gelu(x.as_ptr() as *mut C_tensor, code, &mut out) }) {
        Ok(()) => unsafe { Tensor::from_ptr(out) },
        Err(e) => panic!("gelu: {e}"),
    }
}

/// Multi-head scaled-dot-product self-attention of a packed projection:
/// `qkv` is `[batch, time, 3 * d_model]` (q, then k, then v, each head's
/// `d_model / heads` features side by side, as a `Linear(d, 3d)` gives),
/// the result `[batch, time, d_model]` — what
/// `scaled_dot_product_attention` of the three split into heads gives,
/// transposed back and merged, with scale `1/sqrt(d_model / heads)`, no
/// dropout and, when `causal`, each position attending to itself and
/// those before it.
///
/// On a float32 CPU tensor with a head size that is a multiple of 8 and at
/// most 512 positions, where hearth's kernels run
/// ([`CpuKernels::runs_hearths_kernels`]), hearth's own kernels compute it
/// and its gradient ([`self_attention_is_fused`]); between the
/// passes they keep `qkv` and a log-sum-exp per row and head (libtorch's
/// flash kernel keeps the output too), and a second derivative through
/// them (`create_graph`) is an error. Anything else runs libtorch's `scaled_dot_product_attention`.
///
/// # Panics
/// When `qkv` is not 3-dimensional with a multiple of `3 * heads`
/// features, or libtorch raises an error; and when `HEARTH_CPU_KERNELS`
/// names a path this process cannot run.
pub fn self_attention(qkv: &Tensor, heads: i64, causal: bool) -> Tensor {
    self_attention_on(qkv, heads, causal, path().code())
}

/// [`self_attention`] by the kernels `code` names (`csrc/kernel_paths.h`).
fn self_attention_on(qkv: &Tensor, heads: i64, causal: bool, code: i32) -> Tensor {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: `qkv` is a live handle borrowed for the call; on success
    // `out` is a new at::Tensor owned by us from here on.
    let status = unsafe {
        ffi::hearth_self_attention(qkv.as_ptr() as *mut C_tensor, heads, causal, code, &mut out)
    };
    match check(status) {
        Ok(()) => unsafe { Tensor::from_ptr(out) },
        Err(e) => panic!("self_attention: {e}"),
    }
}

/// Whether [`self_attention`] of `qkv` with `heads` heads runs hearth's
/// own kernels.
pub fn self_attention_is_fused(qkv: &Tensor, heads: i64) -> bool {
    // SAFETY: `qkv` is a live handle borrowed for the call.
    unsafe { ffi::hearth_self_attention_fused(qkv.as_ptr() as *mut C_tensor, heads, path().code()) }
}

mod llama;
pub use llama::{rms_norm, rotary, swiglu};

#[cfg(test)]
mod bounds;
#[cfg(test)]
mod llama_tests;
#[cfg(test)]
mod tests;
