//! hearth's kernels against float64 references and bounds derived from
//! their own operations (`bounds.rs`), not against libtorch's float32
//! results, whose rounding depends on the instructions libtorch picks for
//! the CPU at hand. Each bound test also runs the kernels with a deliberate
//! error (`csrc/kernel_paths.h`'s mutations) and must see it.

use super::bounds::{self, Approx, Shape, EXP_ERROR};
use super::*;
use crate::cpu_kernels::{cpu_has_avx2_fma, cpu_has_avx512f};
use tch::{Device, Kind};

/// `csrc/kernel_paths.h`'s codes: libtorch, the AVX2 kernels (and the
/// same with AVX-512 attention tiles), and the AVX2 kernels with exp off by
/// 1e-6 or every result off by 4 units in the last place.
const LIBTORCH: i32 = 0;
const AVX2: i32 = 1;
const AVX512: i32 = 2;
const EXP_OFF: i32 = 1 | (1 << 8);
const RESULT_OFF: i32 = 1 | (2 << 8);

/// Uniform values in [-scale, scale) from a seeded ChaCha stream: apart
/// from libtorch's global generator, which tests running beside these
/// reseed and draw from.
pub(super) fn uniform(shape: &[i64], scale: f32, seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product::<i64>() as usize;
    let values: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
    Tensor::from_slice(&values).view(shape)
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.detach().contiguous().view([-1])).unwrap()
}

/// How many of `got` miss their bounds, and the worst distance in units of
/// the bound.
fn misses(reference: &[Approx], got: &[f32]) -> (usize, f64) {
    assert_eq!(reference.len(), got.len());
    let missed = reference
        .iter()
        .zip(got)
        .filter(|(r, g)| !r.holds(**g))
        .count();
    let worst = reference
        .iter()
        .zip(got)
        .map(|(r, g)| r.ratio(*g))
        .fold(0.0, f64::max);
    (missed, worst)
}

/// The kernels' exp over `x` (all <= 0) under `code`'s mutation.
#[cfg(target_arch = "x86_64")]
fn kernel_exp(x: &[f32], code: i32) -> Vec<f32> {
    let mut y = vec![0.0f32; x.len()];
    // SAFETY: both slices hold x.len() floats; called only where the CPU
    // has AVX2 and FMA.
    unsafe {
        ffi::hearth_exp_nonpositive_avx2(x.as_ptr(), y.as_mut_ptr(), x.len() as i64, code >> 8)
    };
    y
}

/// The kernels' exp is within [`EXP_ERROR`] of float64's exp over every
/// float from -87.5 to 0 in steps of 2^-14 (and their neighbours), and an
/// exp off by 1e-6 relative or by 4 units in the last place is not.
#[test]
#[cfg(target_arch = "x86_64")]
fn the_kernels_exp_is_within_its_bound() {
    if !cpu_has_avx2_fma() {
        return;
    }
    let mut x: Vec<f32> = (0..=(87.5 * 16384.0) as i32)
        .map(|k| -(k as f32) / 16384.0)
        .flat_map(|x| {
            [
                x,
                f32::from_bits(x.to_bits() + 1),
                f32::from_bits(x.to_bits().saturating_sub(1)),
            ]
        })
        .filter(|x| *x <= 0.0)
        .collect();
    x.extend([-0.0, f32::MIN_POSITIVE.ln(), -87.33654, -87.3365]);
    let reference: Vec<Approx> = x.iter().map(|&x| Approx::of(x).exp()).collect();
    let (missed, worst) = misses(&reference, &kernel_exp(&x, AVX2));
    assert_eq!(
        missed, 0,
        "exp misses its bound at {missed} points (worst {worst:.2} of it)"
    );
    let worst_relative = x
        .iter()
        .zip(kernel_exp(&x, AVX2))
        .filter(|(x, _)| (**x as f64).exp() >= f32::MIN_POSITIVE as f64)
        .map(|(x, y)| (y as f64 / (*x as f64).exp() - 1.0).abs())
        .fold(0.0, f64::max);
    eprintln!(
        "exp: worst relative error {:.2}u against a bound of {:.0}u",
        worst_relative / bounds::U,
        EXP_ERROR / bounds::U
    );
    for (code, what) in [(EXP_OFF, "off by 1e-6"), (RESULT_OFF, "off by 4 ulps")] {
        let (missed, _) = misses(&reference, &kernel_exp(&x, code));
        eprintln!("exp {what}: {missed} of {} values miss the bound", x.len());
        assert!(missed > 0, "an exp {what} passes the test");
    }
}

/// GELU over normal values, a tail that is not a multiple of 8, and the
/// extremes (large magnitudes, zeros, infinities), and an upstream
/// gradient.
fn gelu_inputs() -> (Tensor, Tensor) {
    let x = uniform(&[3, 1001], 8.0, 7);
    x.narrow(1, 0, 6).copy_(&Tensor::from_slice(&[
        0.0f32,
        -0.0,
        30.0,
        -30.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]));
    let small = uniform(&[1, 1001], 0.05, 9);
    (Tensor::cat(&[x, small], 0), uniform(&[4, 1001], 2.0, 8))
}

/// GELU by `code`'s kernels: values and the gradient of sum(gelu(x) * g).
fn gelu_and_gradient(x: &Tensor, g: &Tensor, code: i32) -> (Vec<f32>, Vec<f32>) {
    let input = x.detach().set_requires_grad(true);
    let y = gelu_on(&input, code);
    (&y * g).sum(Kind::Float).backward();
    (values(&y), values(&input.grad()))
}

/// How many GELU values and gradients by `code` miss their bounds (the
/// gradient is g * gelu'(x), one more rounding of the derivative's bound
/// scaled by |g|), and the worst ratio.
fn gelu_misses(x: &Tensor, g: &Tensor, code: i32) -> (usize, usize, f64) {
    let (y, dx) = gelu_and_gradient(x, g, code);
    let (xs, gs) = (values(x), values(g));
    let refs: Vec<(Approx, Approx)> = xs.iter().map(|&x| bounds::gelu(x)).collect();
    let value_refs: Vec<Approx> = refs.iter().map(|r| r.0).collect();
    let grad_refs: Vec<Approx> = refs
        .iter()
        .zip(&gs)
        .map(|((_, d), &g)| d.mul(Approx::of(g)))
        .collect();
    let (values_off, worst_value) = misses(&value_refs, &y);
    let (grads_off, worst_grad) = misses(&grad_refs, &dx);
    (values_off, grads_off, worst_value.max(worst_grad))
}

/// The fused GELU's values and gradients are within the rounding bounds of
/// its own operations (`bounds::gelu`: every float32 rounding of the
/// Abramowitz-Stegun formula, the kernels' exp at [`EXP_ERROR`]) of the
/// same formula in float64; and within that formula's own distance from
/// the true GELU (erf's, at most 1.5e-7 by Abramowitz and Stegun, times
/// |x|/2, and 0.75e-7 in the derivative) of PyTorch's float64 GELU. A GELU
/// whose exp is off by 1e-6 relative, or whose results are off by 4 units
/// in the last place, misses the first bound.
#[test]
fn gelu_and_its_gradient_are_within_their_rounding_bounds() {
    if !cpu_has_avx2_fma() {
        return;
    }
    let (x, g) = gelu_inputs();
    let (values_off, grads_off, worst) = gelu_misses(&x, &g, AVX2);
    assert_eq!(
        values_off, 0,
        "{values_off} GELU values miss their bounds (worst {worst:.2})"
    );
    assert_eq!(
        grads_off, 0,
        "{grads_off} GELU gradients miss their bounds (worst {worst:.2})"
    );
    eprintln!("gelu: worst error {worst:.3} of its bound");

    let exact_in = x.to_kind(Kind::Double).set_requires_grad(true);
    let exact = exact_in.gelu("none");
    (&exact * g.to_kind(Kind::Double))
        .sum(Kind::Double)
        .backward();
    let (y, dx) = gelu_and_gradient(&x, &g, AVX2);
    let (xs, gs) = (values(&x), values(&g));
    let exact: Vec<f64> = Vec::try_from(exact.detach().view([-1])).unwrap();
    let exact_grad: Vec<f64> = Vec::try_from(exact_in.grad().view([-1])).unwrap();
    for i in 0..xs.len() {
        let (reference, derivative) = bounds::gelu(xs[i]);
        if !reference.v.is_finite() || !exact[i].is_finite() {
            continue;
        }
        let formula = 0.75e-7 * (xs[i] as f64).abs();
        assert!(
            (y[i] as f64 - exact[i]).abs() <= formula + reference.e * (1.0 + 1e-6),
            "gelu({}) = {} is further than Abramowitz-Stegun's error from PyTorch's float64 {}",
            xs[i],
            y[i],
            exact[i]
        );
        let grad_bound =
            gs[i].abs() as f64 * (0.75e-7 + derivative.e) + bounds::U * exact_grad[i].abs();
        assert!(
            (dx[i] as f64 - exact_grad[i]).abs() <= grad_bound * (1.0 + 1e-6) + 1e-30,
            "gelu'({}) * {} = {} is too far from PyTorch's float64 {}",
            xs[i],
            gs[i],
            dx[i],
            exact_grad[i]
        );
    }

    for (code, what) in [
        (EXP_OFF, "exp off by 1e-6"),
        (RESULT_OFF, "results off by 4 ulps"),
    ] {
        let (values_off, grads_off, _) = gelu_misses(&x, &g, code);
        eprintln!(
            "gelu with {what}: {values_off} values and {grads_off} gradients miss their bounds"
        );
        assert!(
            values_off + grads_off > 0,
            "a GELU with {what} passes the test"
        );
    }
}

/// Off hearth's kernels, GELU is libtorch's own, bit for bit, values and
/// gradients.
#[test]
fn gelu_off_the_kernels_is_libtorchs_own() {
    let (x, g) = gelu_inputs();
    let (ours, ours_grad) = gelu_and_gradient(&x, &g, LIBTORCH);
    let input = x.detach().set_requires_grad(true);
    let theirs = input.gelu("none");
    (&theirs * &g).sum(Kind::Float).backward();
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same(&ours, &values(&theirs)));
    assert!(same(&ours_grad, &values(&input.grad())));
}

/// The public functions take the path this process chose.
#[test]
fn gelu_and_attention_take_the_processs_path() {
    let (x, g) = gelu_inputs();
    let code = path().code();
    let bits = |(y, dx): (Vec<f32>, Vec<f32>)| -> Vec<u32> {
        y.iter().chain(&dx).map(|v| v.to_bits()).collect()
    };
    let by_path = bits(gelu_and_gradient(&x, &g, code));
    let input = x.detach().set_requires_grad(true);
    let y = gelu(&input);
    (&y * &g).sum(Kind::Float).backward();
    assert_eq!(by_path, bits((values(&y), values(&input.grad()))));
    let qkv = uniform(&[2, 9, 48], 1.0, 3);
    assert_eq!(
        self_attention_is_fused(&qkv, 2),
        path().runs_hearths_kernels()
    );
    let ours = self_attention(&qkv, 2, true);
    assert!(ours.equal(&self_attention_on(&qkv, 2, true, code)));
}

/// A second derivative through the fused GELU is refused, not zero.
#[test]
fn a_second_derivative_through_the_fused_gelu_is_an_error() {
    if !cpu_has_avx2_fma() {
        return;
    }
    let x = Tensor::randn([16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = gelu_on(&x, AVX2).sum(Kind::Float);
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

/// Output and gradient of `attend(qkv)` under the upstream gradient
/// `grad_out`.
fn value_and_gradient(
    qkv: &Tensor,
    grad_out: &Tensor,
    attend: impl Fn(&Tensor) -> Tensor,
) -> (Vec<f32>, Vec<f32>) {
    let x = qkv.detach().set_requires_grad(true);
    let y = attend(&x);
    (&y * grad_out).sum(Kind::Float).backward();
    (values(&y), values(&x.grad()))
}

/// The shapes the attention test runs: causal and full attention, the
/// bench GPT's shape, sequences that are not multiples of the kernels'
/// 6-row tiles or 8-wide vectors, a single position, and (scale 0.05) rows
/// whose scores are all near zero, where softmax weighs every key.
const ATTENTION_CASES: [(Shape, f32); 8] = [
    (
        Shape {
            b: 2,
            t: 128,
            h: 4,
            d: 32,
            causal: true,
        },
        3.5,
    ),
    (
        Shape {
            b: 3,
            t: 13,
            h: 2,
            d: 8,
            causal: true,
        },
        3.5,
    ),
    (
        Shape {
            b: 2,
            t: 37,
            h: 3,
            d: 16,
            causal: false,
        },
        3.5,
    ),
    (
        Shape {
            b: 2,
            t: 1,
            h: 2,
            d: 8,
            causal: true,
        },
        3.5,
    ),
    (
        Shape {
            b: 1,
            t: 70,
            h: 1,
            d: 64,
            causal: true,
        },
        3.5,
    ),
    (
        Shape {
            b: 1,
            t: 200,
            h: 2,
            d: 24,
            causal: false,
        },
        3.5,
    ),
    (
        Shape {
            b: 2,
            t: 2,
            h: 2,
            d: 8,
            causal: false,
        },
        0.05,
    ),
    (
        Shape {
            b: 2,
            t: 9,
            h: 2,
            d: 8,
            causal: false,
        },
        0.05,
    ),
];

/// For each case: how many outputs and gradients of `code`'s attention miss
/// their bounds, and the worst ratio.
fn attention_misses(code: i32) -> Vec<(Shape, usize, usize, f64)> {
    ATTENTION_CASES
        .iter()
        .enumerate()
        .map(|(n, &(s, scale))| {
            let (b, t, h, d) = (s.b as i64, s.t as i64, s.h as i64, s.d as i64);
            let qkv = uniform(&[b, t, 3 * h * d], scale, 100 + n as u64);
            let grad_out = uniform(&[b, t, h * d], 1.7, 1000 + n as u64);
            let (out, grad) =
                value_and_gradient(&qkv, &grad_out, |x| self_attention_on(x, h, s.causal, code));
            let (out_ref, grad_ref) = bounds::attention(&values(&qkv), &values(&grad_out), s);
            let (out_off, worst_out) = misses(&out_ref, &out);
            let (grad_off, worst_grad) = misses(&grad_ref, &grad);
            (s, out_off, grad_off, worst_out.max(worst_grad))
        })
        .collect()
}

/// The fused attention's outputs and gradients are within the rounding
/// bounds of its own operations, in its own order (`bounds::attention`,
/// the float64 attention with scale 1/sqrt(head size)); and attention
/// whose results are off by 4 units in the last place misses them (a
/// single position's output has no rounding to hide it, and near-zero
/// scores little). An exp off by 1e-6 relative shows as well where the
/// softmax weighs several keys evenly; a factor every weight shares would
/// cancel, and rightly go unseen.
#[test]
fn self_attention_is_within_its_rounding_bounds() {
    if !cpu_has_avx2_fma() {
        return;
    }
    for (s, out_off, grad_off, worst) in attention_misses(AVX2) {
        assert!(
            out_off == 0 && grad_off == 0,
            "{s:?}: {out_off} outputs and {grad_off} gradients miss their bounds (worst {worst:.2} of it)"
        );
        eprintln!("attention {s:?}: worst error {worst:.3} of its bound");
    }
    for (code, what) in [
        (RESULT_OFF, "results off by 4 ulps"),
        (EXP_OFF, "exp off by 1e-6"),
    ] {
        let cases = attention_misses(code);
        let seen: usize = cases.iter().map(|c| c.1 + c.2).sum();
        for (s, out_off, grad_off, _) in cases.iter().filter(|c| c.1 + c.2 > 0) {
            eprintln!("attention with {what}: {s:?}: {out_off} outputs, {grad_off} gradients miss");
        }
        assert!(seen > 0, "attention with {what} passes the test");
    }
}

/// The avx512 path (the attention's products in AVX-512 tiles) gives the
/// AVX2 path's outputs and gradients bit for bit: each element of a
/// product is the same chain of fused multiply-adds over k in order,
/// whatever the width. So the bounds above hold it too. The cases are the
/// bounds test's and every width from 8 to 56 columns (sequences and head
/// sizes), on each side of the AVX-512 tile's 32- and 16-column steps and
/// its masked 8-column tail; a tile that dropped or misplaced a column, or
/// summed in another order, would differ somewhere here.
#[test]
#[cfg(target_arch = "x86_64")]
fn the_avx512_path_gives_the_avx2_paths_bits() {
    if !cpu_has_avx512f() {
        eprintln!("skipped: this CPU lacks AVX-512F");
        return;
    }
    let widths = (8..=56).step_by(8);
    let more = widths.clone().flat_map(|t| {
        widths.clone().flat_map(move |d| {
            [true, false].map(|causal| {
                let s = Shape {
                    b: 1,
                    t,
                    h: 2,
                    d,
                    causal,
                };
                (s, 2.0)
            })
        })
    });
    for (n, (s, scale)) in ATTENTION_CASES.into_iter().chain(more).enumerate() {
        let (b, t, h, d) = (s.b as i64, s.t as i64, s.h as i64, s.d as i64);
        let qkv = uniform(&[b, t, 3 * h * d], scale, 300 + n as u64);
        let grad_out = uniform(&[b, t, h * d], 1.7, 3000 + n as u64);
        let bits = |code| {
            let (out, grad) =
                value_and_gradient(&qkv, &grad_out, |x| self_attention_on(x, h, s.causal, code));
            out.iter()
                .chain(&grad)
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert!(bits(AVX512) == bits(AVX2), "{s:?}: the paths differ");
    }
    // The same bits would come from the AVX2 tiles run by mistake: the
    // width each path's tiles have tells them apart. (Checked by mutation:
    // a tile mask that drops a lane of the 8-column tail fails the loop
    // above.)
    // SAFETY: reads a constant of each path's tiles.
    let lanes = |code| unsafe { ffi::hearth_attention_tile_lanes(code) };
    assert_eq!((lanes(AVX2), lanes(AVX512)), (8, 16));
}

/// A bf16 or float16 projection under CPU autocast (mixed precision) runs
/// the float32 kernels on its float32 copy: its output and gradient are,
/// bit for bit, the float32 kernels' on the same values rounded to its own
/// precision (and those are held to their bounds above). Outside autocast
/// it is libtorch's own (`self_attention_elsewhere_is_libtorchs_own`).
#[test]
fn reduced_precision_attention_is_the_float32_kernels_rounded() {
    if !cpu_has_avx2_fma() {
        return;
    }
    let (b, t, h, d) = (2, 20, 2, 8);
    for kind in [Kind::BFloat16, Kind::Half] {
        let qkv = uniform(&[b, t, 3 * h * d], 3.5, 7).to_kind(kind);
        let grad_out = uniform(&[b, t, h * d], 1.7, 8).to_kind(kind);
        let x = qkv.detach().set_requires_grad(true);
        let y = {
            let _autocast = crate::AutocastGuard::new(Device::Cpu, kind).unwrap();
            self_attention_on(&x, h, true, AVX2)
        };
        (&y * &grad_out).sum(kind).backward();
        let x32 = qkv.to_kind(Kind::Float).set_requires_grad(true);
        let y32 = self_attention_on(&x32, h, true, AVX2);
        (&y32 * grad_out.to_kind(Kind::Float))
            .sum(Kind::Float)
            .backward();
        assert_eq!((y.kind(), x.grad().kind()), (kind, kind));
        assert!(y.equal(&y32.to_kind(kind)), "{kind:?}: output");
        assert!(
            x.grad().equal(&x32.grad().to_kind(kind)),
            "{kind:?}: gradient"
        );
        // And it is attention: libtorch's own in that precision agrees to
        // within a few of its units.
        let theirs = libtorch_attention(&qkv, h, true).to_kind(Kind::Float);
        let off = (y.to_kind(Kind::Float) - &theirs)
            .abs()
            .max()
            .double_value(&[]);
        let unit = if kind == Kind::BFloat16 {
            2f64.powi(-8)
        } else {
            2f64.powi(-11)
        };
        let largest = theirs.abs().max().double_value(&[]);
        assert!(
            off <= 8.0 * unit * largest,
            "{kind:?}: {off} from libtorch's"
        );
    }
}

/// Where the kernels do not apply (off them, float64, bf16 outside
/// autocast, a head size that is not a multiple of 8, more than 512
/// positions) the result is libtorch's, bit for bit.
#[test]
fn self_attention_elsewhere_is_libtorchs_own() {
    tch::manual_seed(12);
    for (code, kind, t, h, hd) in [
        (AVX2, Kind::Double, 16, 2, 8),
        (AVX2, Kind::BFloat16, 16, 2, 8),
        (AVX2, Kind::Float, 9, 2, 12),
        (AVX2, Kind::Float, 513, 1, 8),
        (LIBTORCH, Kind::Float, 16, 2, 8),
    ] {
        if code == AVX2 && !cpu_has_avx2_fma() {
            continue;
        }
        let qkv = Tensor::randn([2, t, 3 * h * hd], (kind, Device::Cpu));
        let ours = self_attention_on(&qkv, h, true, code);
        assert!(
            ours.equal(&libtorch_attention(&qkv, h, true)),
            "code {code} kind {kind:?} T={t} D={hd}"
        );
    }
}

/// A second derivative through the fused attention is refused, not zero.
#[test]
fn a_second_derivative_through_the_fused_attention_is_an_error() {
    if !cpu_has_avx2_fma() {
        return;
    }
    let qkv = Tensor::randn([1, 8, 48], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = self_attention_on(&qkv, 2, true, AVX2).sum(Kind::Float);
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
