//! The Llama-family operators against float64 PyTorch: each one's value
//! and gradients within the `pytorch_parity` bound — 4 times float32
//! libtorch's own distance from float64 (the chain each replaced, run op by
//! op), plus 64 units of float32 rounding of the largest float64 value —
//! on every kernel path this CPU has, and the kernels with a deliberate
//! error (`kPatternOff`, every result 2^-14 relative off) must miss it.
//! Off the kernels (`HEARTH_CPU_KERNELS=off`, other dtypes) each operator
//! is the float32 chain itself, value for value.

use super::llama::{rms_norm_on, rotary_on, swiglu_on};
use super::tests::uniform;
use crate::cpu_kernels::{cpu_has_avx2_fma, cpu_has_avx512f};
use tch::{Kind, Tensor};

/// `csrc/kernel_paths.h`: libtorch's chain, the AVX2 and AVX-512 paths,
/// and the mutation that every pattern kernel's test must see.
const LIBTORCH: i32 = 0;
const AVX2: i32 = 1;
const AVX512: i32 = 2;
const PATTERN_OFF: i32 = 3 << 8;

/// The kernel paths this CPU runs.
fn paths() -> Vec<i32> {
    let mut out = Vec::new();
    if cpu_has_avx2_fma() {
        out.push(AVX2);
    }
    if cpu_has_avx512f() {
        out.push(AVX512);
    }
    out
}

/// An operator under test: its inputs, of which the first `differentiable`
/// take a gradient, and its output for a code.
type Op<'a> = &'a dyn Fn(&[Tensor], i32) -> Tensor;
/// The chain it replaces, in the inputs' own dtype.
type Chain<'a> = &'a dyn Fn(&[Tensor]) -> Tensor;

/// The output and the gradients of the first `differentiable` inputs under
/// the upstream gradient `upstream`, with `inputs` in `kind`.
fn run(
    f: &dyn Fn(&[Tensor]) -> Tensor,
    inputs: &[Tensor],
    differentiable: usize,
    upstream: &Tensor,
    kind: Kind,
) -> Vec<Tensor> {
    let inputs: Vec<Tensor> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| t.to_kind(kind).set_requires_grad(i < differentiable))
        .collect();
    let out = f(&inputs);
    let loss = (&out * upstream.to_kind(kind)).sum(kind);
    let grads = Tensor::run_backward(&[loss], &inputs[..differentiable], false, false);
    std::iter::once(out.detach()).chain(grads).collect()
}

fn distance(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// The worst of `op`'s results (value, then each gradient) in units of its
/// bound; above 1 is a miss.
fn worst(
    op: Op,
    chain: Chain,
    inputs: &[Tensor],
    differentiable: usize,
    upstream: &Tensor,
    code: i32,
) -> f64 {
    let exact = run(chain, inputs, differentiable, upstream, Kind::Double);
    let f32_chain = run(chain, inputs, differentiable, upstream, Kind::Float);
    let got = run(
        &|x: &[Tensor]| op(x, code),
        inputs,
        differentiable,
        upstream,
        Kind::Float,
    );
    exact
        .iter()
        .zip(&f32_chain)
        .zip(&got)
        .map(|((e, f), g)| {
            let largest = e.abs().max().double_value(&[]);
            let bound = 4.0 * distance(f, e) + 64.0 * f64::from(f32::EPSILON) * largest;
            distance(g, e) / bound
        })
        .fold(0.0, f64::max)
}

/// `op` within its bound on every path, the mutated kernels outside it, and
/// libtorch's path the float32 chain exactly.
fn holds_pytorchs_values(
    what: &str,
    op: Op,
    chain: Chain,
    inputs: &[Tensor],
    differentiable: usize,
) {
    let upstream = uniform(&chain(inputs).size(), 1.0, 99);
    for code in paths() {
        let exact = worst(op, chain, inputs, differentiable, &upstream, code);
        assert!(
            exact <= 1.0,
            "{what} (path {code}) is {exact:.2} of its bound from float64"
        );
        let mutated = worst(
            op,
            chain,
            inputs,
            differentiable,
            &upstream,
            code | PATTERN_OFF,
        );
        eprintln!("{what}, path {code}: {exact:.3} of the bound; mutated {mutated:.1}");
        assert!(
            mutated > 1.0,
            "{what} (path {code}) 2^-14 off passes the test ({mutated:.2})"
        );
    }
    let theirs = run(chain, inputs, differentiable, &upstream, Kind::Float);
    let ours = run(
        &|x: &[Tensor]| op(x, LIBTORCH),
        inputs,
        differentiable,
        &upstream,
        Kind::Float,
    );
    for (a, b) in theirs.iter().zip(&ours) {
        assert_eq!(
            distance(a, b),
            0.0,
            "{what} off the kernels is not the chain itself"
        );
    }
}

fn rms_chain(x: &[Tensor]) -> Tensor {
    let h = x[0].to_kind(x[1].kind());
    let variance = h.pow_tensor_scalar(2).mean_dim(-1, true, None);
    &x[1] * (&h * (variance + 1e-6).rsqrt())
}

#[test]
fn rms_norm_holds_pytorchs_values() {
    // Rows of 260 (not a multiple of the vector width), 165 of them split
    // between threads, weights around 1.
    let x = uniform(&[5, 33, 260], 3.0, 1);
    let w = uniform(&[260], 0.5, 2) + 1.0;
    let op = |t: &[Tensor], code: i32| rms_norm_on(&t[0], &t[1], 1e-6, code);
    holds_pytorchs_values("RMSNorm", &op, &rms_chain, &[x, w], 2);
}

fn swiglu_chain(x: &[Tensor]) -> Tensor {
    x[0].silu() * &x[1]
}

#[test]
fn swiglu_holds_pytorchs_values() {
    // Gates across silu's curved range and its tails.
    let gate = uniform(&[7, 1001], 12.0, 3);
    let up = uniform(&[7, 1001], 2.0, 4);
    let op = |t: &[Tensor], code: i32| swiglu_on(&t[0], &t[1], code);
    holds_pytorchs_values("SwiGLU", &op, &swiglu_chain, &[gate, up], 2);
}

fn rotary_chain(x: &[Tensor]) -> Tensor {
    let half = x[0].size()[3] / 2;
    let rotated = Tensor::cat(
        &[-x[0].narrow(-1, half, half), x[0].narrow(-1, 0, half)],
        -1,
    );
    &x[0] * &x[1] + rotated * &x[2]
}

#[test]
fn rotary_holds_pytorchs_values() {
    // q as transformers has it: [B, T, H, D] seen as [B, H, T, D] (not
    // contiguous), cos and sin of real angles [B, 1, T, D], the halves
    // equal as transformers builds them.
    let q = uniform(&[2, 33, 4, 32], 2.0, 5);
    let angles = uniform(&[2, 1, 33, 16], 6.0, 6).repeat([1, 1, 1, 2]);
    let op = |t: &[Tensor], code: i32| rotary_on(&t[0].transpose(1, 2), &t[1], &t[2], code);
    let chain = |t: &[Tensor]| {
        rotary_chain(&[
            t[0].transpose(1, 2),
            t[1].shallow_clone(),
            t[2].shallow_clone(),
        ])
    };
    holds_pytorchs_values("rotary", &op, &chain, &[q, angles.cos(), angles.sin()], 1);
}

/// Timing aid, not a test of speed (run with --ignored --nocapture).
#[test]
#[ignore]
fn time_the_pattern_kernels() {
    let time = |what: &str, f: &dyn Fn()| {
        for _ in 0..3 {
            f();
        }
        let start = std::time::Instant::now();
        for _ in 0..20 {
            f();
        }
        eprintln!(
            "{what}: {:.3} ms",
            start.elapsed().as_secs_f64() * 1e3 / 20.0
        );
    };
    let code = *paths().last().unwrap_or(&LIBTORCH);
    for (name, c) in [("kernels", code), ("chain", LIBTORCH)] {
        let a = uniform(&[16, 64, 688], 4.0, 1).set_requires_grad(true);
        let b = uniform(&[16, 64, 688], 4.0, 2).set_requires_grad(true);
        let g = uniform(&[16, 64, 688], 1.0, 3);
        time(&format!("swiglu forward, {name}"), &|| {
            let _ = tch::no_grad(|| swiglu_on(&a, &b, c));
        });
        time(&format!("swiglu forward + backward, {name}"), &|| {
            let y = swiglu_on(&a, &b, c);
            let _ = Tensor::run_backward(&[(&y * &g).sum(Kind::Float)], &[&a, &b], false, false);
        });
        let x = uniform(&[16, 64, 256], 4.0, 1).set_requires_grad(true);
        let w = uniform(&[256], 1.0, 2).set_requires_grad(true);
        let gx = uniform(&[16, 64, 256], 1.0, 3);
        time(&format!("rms_norm forward + backward, {name}"), &|| {
            let y = rms_norm_on(&x, &w, 1e-6, c);
            let _ = Tensor::run_backward(&[(&y * &gx).sum(Kind::Float)], &[&x, &w], false, false);
        });
        let q = uniform(&[16, 64, 8, 32], 4.0, 1).set_requires_grad(true);
        let cs = uniform(&[16, 1, 64, 32], 1.0, 2);
        let gq = uniform(&[16, 8, 64, 32], 1.0, 3);
        time(&format!("rotary forward + backward, {name}"), &|| {
            let y = rotary_on(&q.transpose(1, 2), &cs, &cs, c);
            let _ = Tensor::run_backward(&[(&y * &gq).sum(Kind::Float)], &[&q], false, false);
        });
    }
}
