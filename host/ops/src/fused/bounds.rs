//! Float64 references for hearth's float32 kernels, each value with a bound
//! on how far the kernel's result may lie from it: a running error analysis
//! (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
//! §3.3) that follows the kernel's own float32 operations in the kernel's
//! own order. Each operation rounds to nearest, so it adds at most
//! u = 2^-24 times its result; the errors its operands carry pass through
//! it by its partial derivatives. Bounds are first order: the terms in u²
//! are below 1e-6 of them, which [`Approx::holds`] allows.
//!
//! Nothing here depends on the instructions libtorch dispatches to: the
//! kernels are hearth's own code (the same instructions on every CPU that
//! runs them) and the references are float64 arithmetic, so a bound that
//! holds on one machine holds on all of them.

/// float32's unit roundoff: round to nearest is off by at most this
/// fraction of the result.
pub const U: f64 = 1.0 / 16_777_216.0;

/// The relative error of the kernels' exp (`csrc/avx2_exp.h`), for x <= 0
/// with exp(x) a normal float: the reduction x - n ln2 is two roundings of
/// |r| <= ln2/2 (2u * 0.35, n * ln2's high part being exact); Taylor's
/// series cut after r^7 is off by r^8/8! * e^0.35 <= 0.13u; Horner's seven
/// fused steps round at most 1.4u, 1.2u * 0.35, ... of a result >= 0.7,
/// under 2.7u relative; and the product with 2^n rounds once more (u).
/// That is 4.5u; 5u leaves the coefficients' own rounding (under 0.01u).
/// `the_kernels_exp_is_within_its_bound` checks it over every normal
/// result.
pub const EXP_ERROR: f64 = 5.0 * U;

/// A float64 value of what a float32 kernel computes, and a bound on the
/// distance of the kernel's result from it.
#[derive(Clone, Copy, Debug)]
pub struct Approx {
    /// The exact (float64) value.
    pub v: f64,
    /// The bound on the float32 result's distance from `v`.
    pub e: f64,
}

impl Approx {
    /// An input the kernel reads as it is.
    pub fn exact(v: f64) -> Self {
        Approx { v, e: 0.0 }
    }

    /// A float32 input.
    pub fn of(x: f32) -> Self {
        Self::exact(x as f64)
    }

    /// `v`, carrying `e` from the operands, after one rounding.
    fn rounded(v: f64, e: f64) -> Self {
        Approx {
            v,
            e: e + U * v.abs(),
        }
    }

    /// self + o, rounded.
    pub fn add(self, o: Self) -> Self {
        Self::rounded(self.v + o.v, self.e + o.e)
    }

    /// self - o, rounded.
    pub fn sub(self, o: Self) -> Self {
        Self::rounded(self.v - o.v, self.e + o.e)
    }

    /// self * o, rounded.
    pub fn mul(self, o: Self) -> Self {
        Self::rounded(self.v * o.v, self.v.abs() * o.e + o.v.abs() * self.e)
    }

    /// self * b + c, rounded once (a fused multiply-add).
    pub fn fma(self, b: Self, c: Self) -> Self {
        Self::rounded(
            self.v * b.v + c.v,
            self.v.abs() * b.e + b.v.abs() * self.e + c.e,
        )
    }

    /// c - self * b, rounded once.
    pub fn fnma(self, b: Self, c: Self) -> Self {
        Self::rounded(
            c.v - self.v * b.v,
            self.v.abs() * b.e + b.v.abs() * self.e + c.e,
        )
    }

    /// 1 / self, rounded.
    pub fn recip(self) -> Self {
        Self::rounded(1.0 / self.v, self.e / (self.v * self.v))
    }

    /// self * k for a power of two k: exact.
    pub fn times_power_of_two(self, k: f64) -> Self {
        Approx {
            v: self.v * k,
            e: self.e * k.abs(),
        }
    }

    /// |self|: exact.
    pub fn abs(self) -> Self {
        Approx {
            v: self.v.abs(),
            e: self.e,
        }
    }

    /// -self: exact.
    pub fn neg(self) -> Self {
        Approx {
            v: -self.v,
            e: self.e,
        }
    }

    /// The kernels' exp of self (self <= 0): relative error [`EXP_ERROR`]
    /// on top of the argument's, and a result below the smallest normal
    /// float (which the kernel may give as zero or subnormal) off by at
    /// most that.
    pub fn exp(self) -> Self {
        let v = self.v.exp();
        Approx {
            v,
            e: v * (self.e + EXP_ERROR) + f32::MIN_POSITIVE as f64,
        }
    }

    /// logf of self (glibc's, within one unit in the last place: 2u).
    pub fn ln(self) -> Self {
        let v = self.v.ln();
        Approx {
            v,
            e: self.e / self.v + 2.0 * U * v.abs(),
        }
    }

    /// Whether a float32 result `got` is within the bound (with 1e-6 of it
    /// for the second-order terms); a reference that is not finite must be
    /// met exactly (NaN by NaN).
    pub fn holds(self, got: f32) -> bool {
        let got = got as f64;
        if !self.v.is_finite() {
            return got == self.v || (got.is_nan() && self.v.is_nan());
        }
        (got - self.v).abs() <= self.e * (1.0 + 1e-6)
    }

    /// How far `got` is from the value, in units of the bound.
    pub fn ratio(self, got: f32) -> f64 {
        if !self.v.is_finite() {
            return if self.holds(got) { 0.0 } else { f64::INFINITY };
        }
        let d = (got as f64 - self.v).abs();
        if d == 0.0 {
            0.0
        } else {
            d / self.e
        }
    }
}

/// `gelu8` of `csrc/gelu_avx2.cpp` for one x, operation by operation:
/// GELU and its derivative, with erf by Abramowitz and Stegun's 7.1.26 and
/// its float32 coefficients.
pub fn gelu(x: f32) -> (Approx, Approx) {
    let c = |f: f32| Approx::of(f);
    let one = c(1.0);
    let x = Approx::of(x);
    let v = x.mul(c(std::f32::consts::FRAC_1_SQRT_2));
    let negative = v.v.is_sign_negative();
    let a = v.abs();
    let t = c(0.327_591_1).fma(a, one).recip();
    let mut r = c(1.061_405_4).fma(t, c(-1.453_152));
    r = r.fma(t, c(1.421_413_7));
    r = r.fma(t, c(-0.284_496_74));
    r = r.fma(t, c(0.254_829_6));
    let e = x.mul(x).times_power_of_two(-0.5).exp();
    let w = e.mul(t).fnma(r, one);
    let erf = if negative { w.neg() } else { w };
    let one_plus_erf = one.add(erf);
    let y = x.times_power_of_two(0.5).mul(one_plus_erf);
    let density =
        c((std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2 * 0.5) as f32);
    let pdf = e.mul(density);
    let d = x.fma(pdf, one_plus_erf.times_power_of_two(0.5));
    (y, d)
}

/// The eight lanes of a vector summed as the kernels' `sum8` does:
/// pairwise, lane i with i + 4, then i + 2, then i + 1.
fn sum8(lanes: [Approx; 8]) -> Approx {
    let four: Vec<Approx> = (0..4).map(|i| lanes[i].add(lanes[i + 4])).collect();
    let two: Vec<Approx> = (0..2).map(|i| four[i].add(four[i + 2])).collect();
    two[0].add(two[1])
}

/// Σ_j terms_j as the kernels' row sums take it: term j added into lane
/// j % 8 in order, then [`sum8`].
fn lane_sum(terms: impl Iterator<Item = Approx>) -> Approx {
    let mut lanes = [Approx::exact(0.0); 8];
    for (j, term) in terms.enumerate() {
        lanes[j % 8] = lanes[j % 8].add(term);
    }
    sum8(lanes)
}

/// Σ_k a_k b_k as one lane of the kernels' register tiles takes it: fused
/// multiply-adds in order into an accumulator that starts at zero.
fn in_order(pairs: impl Iterator<Item = (Approx, Approx)>) -> Approx {
    pairs.fold(Approx::exact(0.0), |acc, (a, b)| a.fma(b, acc))
}

/// The shape of an attention problem: batch, positions, heads, head size,
/// causal.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub d: usize,
    pub causal: bool,
}

impl Shape {
    fn len(&self, i: usize) -> usize {
        if self.causal {
            i + 1
        } else {
            self.t
        }
    }
}

/// `csrc/attention_avx2.cpp`'s forward and backward of `qkv`
/// (`[b, t, 3 * h * d]`) under the upstream gradient `dout`
/// (`[b, t, h * d]`): the output (`[b, t, h * d]`) and the gradient of qkv,
/// each element with its bound. The scale is the exact 1/sqrt(d); the
/// kernels' float32 one is an input off by its rounding.
///
/// The output's bound uses what softmax cancels: with w_j = exp(S_j - m)
/// for the kernel's row maximum m and ŵ_j = w_j (1 + θ_j) what the kernel
/// holds, O = Σ ŵ_j v_j / Σ ŵ_j is off by Σ_j p_j θ_j (v_j - O) to first
/// order, the same θ_j entering the sum and the weighted sum (a factor all
/// weights share, m's error among them, cancels). The sums' own roundings
/// are taken in the kernel's order on the exact weights. The gradients'
/// bounds propagate every operation's error as it comes (looser, as
/// correlated errors are added as if independent, but still bounds).
pub fn attention(qkv: &[f32], dout: &[f32], s: Shape) -> (Vec<Approx>, Vec<Approx>) {
    let (hd, ld) = (s.h * s.d, 3 * s.h * s.d);
    let exact_scale = 1.0 / (s.d as f64).sqrt();
    let kernel_scale = 1.0f32 / (s.d as f32).sqrt();
    let scale = Approx {
        v: exact_scale,
        e: (kernel_scale as f64 - exact_scale).abs(),
    };
    let mut out = vec![Approx::exact(0.0); s.b * s.t * hd];
    let mut grad = vec![Approx::exact(0.0); s.b * s.t * ld];
    for b in 0..s.b {
        for h in 0..s.h {
            let at = |i: usize, part: usize, c: usize| {
                qkv[b * s.t * ld + i * ld + part * hd + h * s.d + c]
            };
            let d_out = |i: usize, c: usize| Approx::of(dout[b * s.t * hd + i * hd + h * s.d + c]);
            let score = |i: usize, j: usize| {
                in_order((0..s.d).map(|c| (Approx::of(at(i, 0, c)), Approx::of(at(j, 1, c)))))
                    .mul(scale)
            };
            let mut p = vec![vec![Approx::exact(0.0); s.t]; s.t];
            let mut ds = vec![vec![Approx::exact(0.0); s.t]; s.t];
            for i in 0..s.t {
                let len = s.len(i);
                let scores: Vec<Approx> = (0..len).map(|j| score(i, j)).collect();
                let top = (0..len).fold(0, |a, j| if scores[j].v > scores[a].v { j } else { a });
                let m = scores[top];

                // Forward: the output row, by softmax's cancellation.
                let shifted: Vec<Approx> = scores
                    .iter()
                    .map(|sc| Approx::rounded(sc.v - m.v, sc.e).exp())
                    .collect();
                let w: Vec<f64> = shifted.iter().map(|x| x.v).collect();
                let l = lane_sum(w.iter().map(|&wj| Approx::exact(wj)));
                for c in 0..s.d {
                    let n =
                        in_order((0..len).map(|j| (Approx::exact(w[j]), Approx::of(at(j, 2, c)))));
                    let o = n.v / l.v;
                    let weights: f64 = (0..len)
                        .map(|j| shifted[j].e / l.v * (at(j, 2, c) as f64 - o).abs())
                        .sum();
                    out[b * s.t * hd + i * hd + h * s.d + c] = Approx {
                        v: o,
                        e: weights + n.e / l.v + o.abs() * l.e / l.v + 2.0 * U * o.abs(),
                    };
                }

                // Backward: P from the log-sum-exp, dP, dS.
                let x: Vec<Approx> = scores.iter().map(|sc| sc.sub(m)).collect();
                let sum = lane_sum(x.iter().map(|x| x.exp()));
                let lse = m.add(sum.ln());
                for j in 0..len {
                    p[i][j] = scores[j].sub(lse).exp();
                }
                let dp: Vec<Approx> = (0..len)
                    .map(|j| in_order((0..s.d).map(|c| (d_out(i, c), Approx::of(at(j, 2, c))))))
                    .collect();
                let mut lanes = [Approx::exact(0.0); 8];
                for j in 0..len {
                    lanes[j % 8] = p[i][j].fma(dp[j], lanes[j % 8]);
                }
                let delta = sum8(lanes);
                for j in 0..len {
                    ds[i][j] = p[i][j].mul(dp[j].sub(delta));
                }
            }
            for i in 0..s.t {
                for c in 0..s.d {
                    let dq = in_order((0..s.len(i)).map(|j| (ds[i][j], Approx::of(at(j, 1, c)))));
                    grad[b * s.t * ld + i * ld + h * s.d + c] = dq.mul(scale);
                }
            }
            for j in 0..s.t {
                let queries = (0..s.t).filter(|&i| j < s.len(i));
                for c in 0..s.d {
                    let dk = in_order(queries.clone().map(|i| (ds[i][j], Approx::of(at(i, 0, c)))));
                    let dv = in_order(queries.clone().map(|i| (p[i][j], d_out(i, c))));
                    grad[b * s.t * ld + j * ld + hd + h * s.d + c] = dk.mul(scale);
                    grad[b * s.t * ld + j * ld + 2 * hd + h * s.d + c] = dv;
                }
            }
        }
    }
    (out, grad)
}
