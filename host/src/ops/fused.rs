//! Kernels hearth fuses where eager libtorch runs several (`host/csrc/gelu.cpp`).

use super::{ffi, foreach::check};
use tch::Tensor;
use torch_sys::C_tensor;

/// The exact GELU (`torch.nn.functional.gelu(x)`, erf form).
///
/// On a float32 CPU tensor that needs a gradient, on a CPU with AVX2 and
/// FMA, the forward pass also computes GELU's derivative, in the same pass
/// and with libtorch's arithmetic, and the backward pass multiplies the
/// incoming gradient by it: libtorch's `gelu_backward` evaluates erf and
/// exp again. Values and gradients are libtorch's to within 3 units in the
/// last place; it costs no memory (the derivative is kept instead of the
/// input). The one difference: a second derivative through it
/// (`create_graph`) is an error. Everything else is libtorch's `gelu`.
///
/// # Panics
/// As tch's own ops do, when libtorch raises an error.
pub fn gelu(x: &Tensor) -> Tensor {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: `x` is a live handle borrowed for the call; on success `out`
    // is a new at::Tensor owned by us from here on.
    match check(unsafe { ffi::hearth_gelu(x.as_ptr() as *mut C_tensor, &mut out) }) {
        Ok(()) => unsafe { Tensor::from_ptr(out) },
        Err(e) => panic!("gelu: {e}"),
    }
}

/// Whether [`gelu`] takes its fused path on this CPU (AVX2 and FMA).
pub fn gelu_is_fused() -> bool {
    // SAFETY: reads a cached CPU feature check.
    unsafe { ffi::hearth_gelu_fused_available() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Values and gradients against libtorch's own gelu and gelu_backward
    /// (oneDNN's on x86 CPUs), over normal values, a tail that is not a
    /// multiple of 8, and the extremes (large magnitudes, zeros,
    /// infinities): within 1e-7 + 3e-7 * |libtorch's| (2 to 3 units in the
    /// last place; ~14 % of values and ~50 % of gradients differ by one).
    #[test]
    fn gelu_and_its_gradient_agree_with_libtorchs() {
        tch::manual_seed(7);
        let x = Tensor::randn([3, 1001], (Kind::Float, Device::Cpu)) * 4.0;
        x.narrow(1, 0, 6).copy_(&Tensor::from_slice(&[
            0.0f32,
            -0.0,
            30.0,
            -30.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]));
        let grad_out = Tensor::randn([3, 1001], (Kind::Float, Device::Cpu));

        let ours_in = x.detach().set_requires_grad(true);
        let ours = gelu(&ours_in);
        (&ours * &grad_out).sum(Kind::Float).backward();
        let theirs_in = x.detach().set_requires_grad(true);
        let theirs = theirs_in.gelu("none");
        (&theirs * &grad_out).sum(Kind::Float).backward();

        let off = outside_tolerance(&ours, &theirs);
        assert_eq!(off, 0, "{off} values are off libtorch's gelu");
        let off = outside_tolerance(&ours_in.grad(), &theirs_in.grad());
        assert_eq!(off, 0, "{off} gradients are off libtorch's gelu_backward");
    }

    /// How many elements of `ours` are further than 1e-7 + 3e-7 * |theirs|
    /// from `theirs` (NaN matches NaN: libtorch's GELU is NaN at -inf).
    fn outside_tolerance(ours: &Tensor, theirs: &Tensor) -> i64 {
        let both_nan = ours.isnan().logical_and(&theirs.isnan());
        let close = (ours - theirs)
            .abs()
            .le_tensor(&(theirs.abs() * 3e-7 + 1e-7))
            .logical_or(&ours.eq_tensor(theirs));
        close
            .logical_or(&both_nan)
            .logical_not()
            .sum(Kind::Int64)
            .int64_value(&[])
    }

    /// The fused path is taken wherever Rust's own CPU feature detection
    /// finds AVX2 and FMA.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn gelu_is_fused_on_every_cpu_with_avx2_and_fma() {
        let has = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        assert_eq!(gelu_is_fused(), has);
    }

    /// A second derivative through the fused GELU is refused, not zero.
    #[test]
    fn a_second_derivative_through_the_fused_gelu_is_an_error() {
        if !gelu_is_fused() {
            return;
        }
        let x = Tensor::randn([16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = gelu(&x).sum(Kind::Float);
        let result = Tensor::f_run_backward(&[&y], &[&x], true, true);
        let error = result.expect_err("create_graph through the fused GELU must fail");
        assert!(error.to_string().contains("differentiable once"), "{error}");
    }
}
