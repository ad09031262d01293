//! Kernels hearth fuses where eager libtorch runs several (`host/csrc/gelu.cpp`,
//! `host/csrc/attention.cpp`).

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
/// most 512 positions, on a CPU with AVX2 and FMA, hearth's own kernels
/// compute it and its gradient ([`self_attention_is_fused`]); between the
/// passes they keep `qkv` and a log-sum-exp per row and head (libtorch's
/// flash kernel keeps the output too), and a second derivative through
/// them (`create_graph`) is an error. Anything else runs libtorch's `scaled_dot_product_attention`.
///
/// # Panics
/// When `qkv` is not 3-dimensional with a multiple of `3 * heads`
/// features, or libtorch raises an error.
pub fn self_attention(qkv: &Tensor, heads: i64, causal: bool) -> Tensor {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: `qkv` is a live handle borrowed for the call; on success
    // `out` is a new at::Tensor owned by us from here on.
    let status = unsafe {
        ffi::hearth_self_attention(qkv.as_ptr() as *mut C_tensor, heads, causal, &mut out)
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
    unsafe { ffi::hearth_self_attention_fused(qkv.as_ptr() as *mut C_tensor, heads) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Uniform values in [-scale, scale) from a seeded ChaCha stream: apart
    /// from libtorch's global generator, which tests running beside these
    /// reseed and draw from.
    fn uniform(shape: &[i64], scale: f32, seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = shape.iter().product::<i64>() as usize;
        let values: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
        Tensor::from_slice(&values).view(shape)
    }

    /// Values and gradients against libtorch's own gelu and gelu_backward
    /// (oneDNN's on x86 CPUs), over normal values, a tail that is not a
    /// multiple of 8, and the extremes (large magnitudes, zeros,
    /// infinities): values within 1e-7 + 3e-7 * |libtorch's| (2 to 3 units
    /// in the last place; ~14 % of values and ~50 % of gradients differ by
    /// one), gradients within 1e-7 * |incoming gradient| + 3e-7 *
    /// |libtorch's| (the derivative's error, scaled by what multiplies it;
    /// over 20 M values the worst came to 0.97 of that).
    #[test]
    fn gelu_and_its_gradient_agree_with_libtorchs() {
        let x = uniform(&[3, 1001], 8.0, 7);
        x.narrow(1, 0, 6).copy_(&Tensor::from_slice(&[
            0.0f32,
            -0.0,
            30.0,
            -30.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]));
        let grad_out = uniform(&[3, 1001], 2.0, 8);

        let ours_in = x.detach().set_requires_grad(true);
        let ours = gelu(&ours_in);
        (&ours * &grad_out).sum(Kind::Float).backward();
        let theirs_in = x.detach().set_requires_grad(true);
        let theirs = theirs_in.gelu("none");
        (&theirs * &grad_out).sum(Kind::Float).backward();

        let ones = Tensor::ones_like(&x);
        let off = outside_tolerance(&ours, &theirs, &ones);
        assert_eq!(off, 0, "{off} values are off libtorch's gelu");
        let off = outside_tolerance(&ours_in.grad(), &theirs_in.grad(), &grad_out);
        assert_eq!(off, 0, "{off} gradients are off libtorch's gelu_backward");
    }

    /// How many elements of `ours` are further than 1e-7 * |scale| + 3e-7 *
    /// |theirs| from `theirs` (NaN matches NaN: libtorch's GELU is NaN at
    /// -inf).
    fn outside_tolerance(ours: &Tensor, theirs: &Tensor, scale: &Tensor) -> i64 {
        let both_nan = ours.isnan().logical_and(&theirs.isnan());
        let close = (ours - theirs)
            .abs()
            .le_tensor(&(theirs.abs() * 3e-7 + scale.abs() * 1e-7))
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

    /// libtorch's attention of `qkv` (split into heads, back to
    /// `[batch, time, d]`), in whatever dtype `qkv` has.
    fn libtorch_attention(qkv: &Tensor, heads: i64, causal: bool) -> Tensor {
        let (b, t, three_d) = qkv.size3().unwrap();
        let d = three_d / 3;
        let split = |x: &Tensor| x.view([b, t, heads, d / heads]).transpose(1, 2);
        let parts = qkv.split(d, -1);
        Tensor::scaled_dot_product_attention(
            &split(&parts[0]),
            &split(&parts[1]),
            &split(&parts[2]),
            None::<Tensor>,
            0.0,
            causal,
            None,
            false,
        )
        .transpose(1, 2)
        .reshape([b, t, d])
    }

    /// Output and gradient of `attend(qkv)` under a fixed random upstream
    /// gradient, in float64.
    fn value_and_gradient(
        qkv: &Tensor,
        grad_out: &Tensor,
        attend: impl Fn(&Tensor) -> Tensor,
    ) -> (Tensor, Tensor) {
        let x = qkv.detach().set_requires_grad(true);
        let y = attend(&x);
        (&y * grad_out.to_kind(y.kind()))
            .sum(Kind::Float)
            .backward();
        (
            y.detach().to_kind(Kind::Double),
            x.grad().to_kind(Kind::Double),
        )
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// Values and gradients against PyTorch's own attention computed in
    /// float64 on the same inputs: hearth's kernels in float32 are at least
    /// as close to it as libtorch's float32 attention, to a small factor:
    /// within 4 times its largest error plus 1e-6 (over 30 draws of each
    /// shape the worst came to 1.5 times for outputs and 3.4 for gradients,
    /// on 13 positions of head size 8), over causal and full attention, sequences that are
    /// not multiples of the kernels' 6-row tiles or 8-wide vectors, a
    /// single position, and the bench GPT's shape.
    #[test]
    fn self_attention_agrees_with_pytorchs_in_float64() {
        // batch, time, heads, head size, causal
        for (b, t, h, hd, causal) in [
            (2, 128, 4, 32, true),
            (3, 13, 2, 8, true),
            (2, 37, 3, 16, false),
            (2, 1, 2, 8, true),
            (1, 70, 1, 64, true),
            (1, 200, 2, 24, false),
        ] {
            let qkv = uniform(&[b, t, 3 * h * hd], 3.5, t as u64);
            assert!(self_attention_is_fused(&qkv, h) == gelu_is_fused());
            let grad_out = uniform(&[b, t, h * hd], 1.7, 1000 + t as u64);
            let (exact, exact_grad) =
                value_and_gradient(&qkv.to_kind(Kind::Double), &grad_out, |x| {
                    libtorch_attention(x, h, causal)
                });
            let (ours, ours_grad) =
                value_and_gradient(&qkv, &grad_out, |x| self_attention(x, h, causal));
            let (theirs, theirs_grad) =
                value_and_gradient(&qkv, &grad_out, |x| libtorch_attention(x, h, causal));
            let shape = format!("B={b} T={t} H={h} D={hd} causal={causal}");
            let (e_ours, e_theirs) = (max_abs_diff(&ours, &exact), max_abs_diff(&theirs, &exact));
            assert!(
                e_ours <= 2.0 * e_theirs + 1e-6,
                "{shape}: output off by {e_ours}, libtorch's by {e_theirs}"
            );
            let (g_ours, g_theirs) = (
                max_abs_diff(&ours_grad, &exact_grad),
                max_abs_diff(&theirs_grad, &exact_grad),
            );
            assert!(
                g_ours <= 2.0 * g_theirs + 1e-6,
                "{shape}: gradient off by {g_ours}, libtorch's by {g_theirs}"
            );
        }
    }

    /// Where the kernels do not apply (float64, a head size that is not a
    /// multiple of 8, more than 512 positions) the result is libtorch's,
    /// bit for bit.
    #[test]
    fn self_attention_elsewhere_is_libtorchs_own() {
        tch::manual_seed(12);
        for (kind, t, h, hd) in [
            (Kind::Double, 16, 2, 8),
            (Kind::Float, 9, 2, 12),
            (Kind::Float, 513, 1, 8),
        ] {
            let qkv = Tensor::randn([2, t, 3 * h * hd], (kind, Device::Cpu));
            assert!(!self_attention_is_fused(&qkv, h));
            let ours = self_attention(&qkv, h, true);
            assert!(
                ours.equal(&libtorch_attention(&qkv, h, true)),
                "kind {kind:?} T={t} D={hd}"
            );
        }
    }

    /// A second derivative through the fused attention is refused, not zero.
    #[test]
    fn a_second_derivative_through_the_fused_attention_is_an_error() {
        let qkv = Tensor::randn([1, 8, 48], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        if !self_attention_is_fused(&qkv, 2) {
            return;
        }
        let y = self_attention(&qkv, 2, true).sum(Kind::Float);
        let result = Tensor::f_run_backward(&[&y], &[&qkv], true, true);
        let error = result.expect_err("create_graph through the fused attention must fail");
        assert!(error.to_string().contains("differentiable once"), "{error}");
    }

    /// A projection whose width is not 3 * heads * head size names the
    /// numbers.
    #[test]
    fn self_attention_of_a_bad_shape_says_what_is_wrong() {
        let qkv = Tensor::zeros([1, 4, 30], (Kind::Float, Device::Cpu));
        let panic = std::panic::catch_unwind(|| self_attention(&qkv, 4, true)).unwrap_err();
        let message = panic.downcast_ref::<String>().unwrap();
        assert!(
            message.contains("d_model 10 is not a multiple of the 4 heads"),
            "{message}"
        );
    }
}
