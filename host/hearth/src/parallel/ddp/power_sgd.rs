//! PowerSGD gradient compression (Vogels et al., 2019), as PyTorch's
//! `powerSGD_hook` does it and Accelerate registers it for
//! `comm_hook="power_sgd"` with `comm_state_option`: each bucket's matrices
//! are sent as two thin factors P (n × rank) and Q (m × rank) instead of
//! n × m values; vectors and matrices that would not shrink by
//! `min_compression_rate` are all-reduced whole. The error the
//! approximation makes is added to the next step's gradients (error
//! feedback), and Q is reused from the step before (warm start).
//!
//! Step for step, with the same seeds, orders and kernels as PyTorch's hook,
//! so the gradients match it (`tests/oracles/ddp_power_sgd.py`):
//! 1. before `start_powerSGD_iter` synchronisations: a plain mean;
//! 2. the bucket's error from the last step is added, and a copy kept;
//! 3. the matrices, grouped by shape in order of first appearance, take
//!    Q from the last step (orthogonalised) or, the first time, from
//!    `torch.randn` seeded by numpy's `RandomState(random_seed).randint(1e9)`;
//! 4. P = M·Q is all-reduced (summed) beside the uncompressed values (their
//!    mean); P is orthogonalised, Q = Mᵀ·P all-reduced and divided by the
//!    number of processes; M becomes P·Qᵀ;
//! 5. the error is the copy minus the result.

use hearth_comm::{DistError, Pending, ProcessGroup, ReduceOp};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// PowerSGD's settings (PyTorch's `PowerSGDState` arguments, Accelerate's
/// `comm_state_option`, spelled as there), PyTorch's defaults.
#[derive(
    Debug, Clone, Copy, PartialEq, serde::Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct PowerSgdOptions {
    /// The rank of the approximation (1: P and Q are single columns).
    pub matrix_approximation_rank: usize,
    /// Synchronisations averaged in full before compression starts
    /// (at least 2 with error feedback or warm start, as PyTorch requires).
    #[serde(rename = "start_powerSGD_iter")]
    pub start_power_sgd_iter: u64,
    /// A matrix is compressed only when its size is more than this many
    /// times the size of P and Q together.
    pub min_compression_rate: f64,
    /// The approximation's error is added to the next step's gradients.
    pub use_error_feedback: bool,
    /// Q starts from the last step's instead of random values.
    pub warm_start: bool,
    /// Added to each column's norm when orthogonalising (0: none).
    pub orthogonalization_epsilon: f64,
    /// Seeds the draws of Q's first values (the same on every process).
    pub random_seed: u32,
    /// Synchronisations between two logged compression figures.
    pub compression_stats_logging_frequency: u64,
    /// Matrices of one shape are compressed as one batch.
    pub batch_tensors_with_same_shape: bool,
}

impl Default for PowerSgdOptions {
    fn default() -> Self {
        Self {
            matrix_approximation_rank: 1,
            start_power_sgd_iter: 1_000,
            min_compression_rate: 2.0,
            use_error_feedback: true,
            warm_start: true,
            orthogonalization_epsilon: 0.0,
            random_seed: 0,
            compression_stats_logging_frequency: 10_000,
            batch_tensors_with_same_shape: false,
        }
    }
}

impl PowerSgdOptions {
    /// Refuses what PyTorch's `PowerSGDState` refuses, and values that mean
    /// nothing; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.matrix_approximation_rank == 0 {
            return Err("comm_state_option.matrix_approximation_rank must be at least 1".into());
        }
        if (self.use_error_feedback || self.warm_start) && self.start_power_sgd_iter <= 1 {
            return Err(format!(
                "comm_state_option.start_powerSGD_iter = {}: expect `start_powerSGD_iter` > 1 if \
                 `use_error_feedback` or `warm_start` is enabled, because PowerSGD can only be \
                 applied after the first two iterations in DDP (PyTorch's rule); set it to 2 or more",
                self.start_power_sgd_iter
            ));
        }
        for (name, value) in [
            ("min_compression_rate", self.min_compression_rate),
            ("orthogonalization_epsilon", self.orthogonalization_epsilon),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(format!(
                    "comm_state_option.{name} must be a number of at least 0, not {value}"
                ));
            }
        }
        Ok(())
    }
}

/// numpy's legacy `RandomState(seed)` (MT19937 seeded by `init_genrand`),
/// as far as PowerSGD draws from it.
#[derive(Clone)]
struct NumpyRandomState(rand_mt::Mt);

impl NumpyRandomState {
    fn new(seed: u32) -> Self {
        Self(rand_mt::Mt::new(seed))
    }

    /// `randint(1_000_000_000)`: 32-bit draws masked to 30 bits until one
    /// is below 10⁹ (numpy's legacy bounded integers).
    fn randint_1e9(&mut self) -> u64 {
        const HIGH: u32 = 999_999_999;
        const MASK: u32 = (1 << 30) - 1;
        loop {
            let v = self.0.next_u32() & MASK;
            if v <= HIGH {
                return v as u64;
            }
        }
    }
}

/// The PowerSGD state of one model (PyTorch's `PowerSGDState`).
pub(crate) struct PowerSgd {
    options: PowerSgdOptions,
    /// Synchronisations finished.
    iter: u64,
    rng: NumpyRandomState,
    /// Per bucket: the local error of the last approximation.
    error: HashMap<usize, Tensor>,
    /// Per bucket: Q of the last step (all its matrices, flat).
    q_memory: HashMap<usize, Tensor>,
    numel_before: u64,
    numel_after: u64,
    next_report: u64,
}

/// A group of matrices compressed together: one, or with
/// `batch_tensors_with_same_shape` all of one shape, as `[batch, n, m]`.
struct Batch {
    /// Views of the bucket's values, one per matrix.
    matrices: Vec<Tensor>,
    n: i64,
    m: i64,
    rank: i64,
}

impl Batch {
    fn len(&self) -> i64 {
        self.matrices.len() as i64
    }

    /// The matrices as `[batch, n, m]`: a view of the one, or a stacked copy.
    fn stacked(&self) -> Tensor {
        match self.matrices.as_slice() {
            [one] => one.unsqueeze(0),
            many => Tensor::stack(many, 0),
        }
    }

    /// Writes `values` (`[batch, n, m]`) into the matrices.
    fn write(&self, values: &Tensor) {
        for (i, matrix) in self.matrices.iter().enumerate() {
            matrix.shallow_clone().copy_(&values.get(i as i64));
        }
    }
}

/// A bucket's PowerSGD synchronisation under way.
pub(crate) enum InFlight<'g> {
    /// Before `start_powerSGD_iter`: the plain mean of the values, and the
    /// flags summed (divided when waited for).
    Plain {
        pending: Pending<'g>,
        flags: i64,
        world: f64,
    },
    /// The uncompressed values (with the flags) and P are being summed.
    Compressed(Box<Compressing<'g>>),
}

/// What the second half of a compressed synchronisation needs.
pub(crate) struct Compressing<'g> {
    bucket: usize,
    world: f64,
    /// The bucket's values (error added), overwritten with the result.
    input: Tensor,
    /// `input` as it was before, for the error.
    input_copy: Option<Tensor>,
    /// Views of `input`: the values sent whole.
    uncompressed: Vec<Tensor>,
    batches: Vec<Batch>,
    /// Q of every batch, flat, as sent.
    q: Tensor,
    uncompressed_sum: Pending<'g>,
    p_sum: Pending<'g>,
}

/// Views of `q` (flat) as each batch's `[batch, rows, rank]`, with `rows`
/// n (for P) or m (for Q).
fn factors<'a>(
    flat: &'a Tensor,
    batches: &'a [Batch],
    rows: impl Fn(&Batch) -> i64 + 'a,
) -> impl Iterator<Item = Tensor> + 'a {
    let mut at = 0;
    batches.iter().map(move |b| {
        let len = b.len() * rows(b) * b.rank;
        let view = flat.narrow(0, at, len).view([b.len(), rows(b), b.rank]);
        at += len;
        view
    })
}

/// Orthonormalises the columns of each matrix of `matrices`
/// (`[batch, rows, rank]`) in place: Gram–Schmidt up to rank 2 and in
/// 16-bit kinds, QR otherwise (PyTorch's `_orthogonalize`).
fn orthogonalize(matrices: &Tensor, epsilon: f64) {
    let rank = matrices.size()[2];
    if rank <= 2 || matches!(matrices.kind(), Kind::Half | Kind::BFloat16) {
        for i in 0..rank {
            let mut col = matrices.narrow(2, i, 1);
            // torch.norm(col, dim=1, keepdim=True): linalg.vector_norm.
            let norm = col.norm_scalaropt_dim(2, [1i64].as_slice(), true);
            if epsilon == 0.0 {
                let _ = col.g_div_(&norm);
            } else {
                let _ = col.g_div_(&(norm + epsilon));
            }
            if i + 1 < rank {
                let mut rest = matrices.narrow(2, i + 1, rank - i - 1);
                let along = (&col * &rest).sum_dim_intlist([1i64].as_slice(), true, None::<Kind>);
                let _ = rest.g_sub_(&(along * &col));
            }
        }
    } else {
        let (q, _r) = Tensor::linalg_qr(matrices, "reduced");
        matrices.shallow_clone().copy_(&q);
    }
}

impl PowerSgd {
    /// A fresh state (options validated by the caller).
    pub(crate) fn new(options: PowerSgdOptions) -> Self {
        Self {
            rng: NumpyRandomState::new(options.random_seed),
            options,
            iter: 0,
            error: HashMap::new(),
            q_memory: HashMap::new(),
            numel_before: 0,
            numel_after: 0,
            next_report: 0,
        }
    }

    /// Starts bucket `bucket`'s synchronisation: `values` are its gradients
    /// (flat, in the kind sent), `flags` one per parameter (1 where this
    /// process has a gradient), `shapes` the parameters'. Returns it and the
    /// bytes this process sends.
    pub(crate) fn start<'g>(
        &mut self,
        group: &'g dyn ProcessGroup,
        bucket: usize,
        values: Tensor,
        flags: Tensor,
        shapes: &[Vec<i64>],
    ) -> Result<(InFlight<'g>, u64), DistError> {
        let world = group.num_processes() as f64;
        let element = values.kind().elt_size_in_bytes() as u64;
        if self.iter < self.options.start_power_sgd_iter {
            // `_allreduce_fut`: divided first, then summed; the flags are
            // summed as counts, exact in 16 bits.
            let n = flags.numel() as i64;
            let flat = Tensor::cat(&[values / world, flags], 0);
            let bytes = flat.numel() as u64 * element;
            let pending = group.all_reduce_start(&flat, ReduceOp::Sum)?;
            return Ok((
                InFlight::Plain {
                    pending,
                    flags: n,
                    world,
                },
                bytes,
            ));
        }
        let input = values;
        let input_copy = if self.options.use_error_feedback {
            match self.error.get(&bucket) {
                Some(error) => {
                    let _ = input.shallow_clone().g_add_(error);
                }
                None => {
                    self.error.insert(bucket, input.zeros_like());
                }
            }
            Some(input.copy())
        } else {
            None
        };
        let (uncompressed, batches) = self.split(&input, shapes);
        let need_random_q = !self.options.warm_start || !self.q_memory.contains_key(&bucket);
        let q = if need_random_q {
            // One seed per bucket and step, drawn even when nothing in the
            // bucket is compressed (as PyTorch's hook draws it).
            let seed = self.rng.randint_1e9();
            let shapes: Vec<[i64; 3]> = batches.iter().map(|b| [b.len(), b.m, b.rank]).collect();
            let shapes: Vec<&[i64]> = shapes.iter().map(|s| s.as_slice()).collect();
            let qs = hearth_ops::randn_seeded(&shapes, input.kind(), seed)
                .map_err(|e| mismatch(group, e))?;
            let qs: Vec<Tensor> = qs.iter().map(|q| q.to_device(input.device())).collect();
            let flat = flatten_or_empty(&qs, &input);
            for q in factors(&flat, &batches, |b| b.m) {
                orthogonalize(&q, self.options.orthogonalization_epsilon);
            }
            flat
        } else {
            let flat = self.q_memory[&bucket].shallow_clone();
            for q in factors(&flat, &batches, |b| b.m) {
                orthogonalize(&q, self.options.orthogonalization_epsilon);
            }
            flat
        };
        let ps: Vec<Tensor> = batches
            .iter()
            .zip(factors(&q, &batches, |b| b.m))
            .map(|(b, q)| b.stacked().bmm(&q))
            .collect();
        let p = flatten_or_empty(&ps, &input);
        let mut whole: Vec<Tensor> = uncompressed.iter().map(|t| t.reshape([-1])).collect();
        whole.push(flags);
        let whole = Tensor::cat(&whole, 0);
        let bytes = (whole.numel() + p.numel() + q.numel()) as u64 * element;
        let uncompressed_sum = group.all_reduce_start(&whole, ReduceOp::Sum)?;
        let p_sum = group.all_reduce_start(&p, ReduceOp::Sum)?;
        Ok((
            InFlight::Compressed(Box::new(Compressing {
                bucket,
                world,
                input,
                input_copy,
                uncompressed,
                batches,
                q,
                uncompressed_sum,
                p_sum,
            })),
            bytes,
        ))
    }

    /// Cuts a bucket's values into the tensors sent whole and the batches
    /// of matrices compressed (grouped by shape, in order of first
    /// appearance, as PyTorch's hook orders them), counting the sizes.
    fn split(&mut self, input: &Tensor, shapes: &[Vec<i64>]) -> (Vec<Tensor>, Vec<Batch>) {
        let mut uncompressed = Vec::new();
        let mut by_shape: Vec<((i64, i64), Vec<Tensor>)> = Vec::new();
        let mut at = 0;
        for shape in shapes {
            let numel: i64 = shape.iter().product();
            let tensor = input.narrow(0, at, numel);
            at += numel;
            let n = shape.first().copied().unwrap_or(1);
            let m = if n == 0 { 0 } else { numel / n };
            let rank = (self.options.matrix_approximation_rank as i64)
                .min(n)
                .min(m);
            let (before, after) = (n * m, (n + m) * rank);
            self.numel_before += before as u64;
            if (after as f64) * self.options.min_compression_rate < before as f64 {
                self.numel_after += after as u64;
                let matrix = tensor.view([n, m]);
                match by_shape.iter_mut().find(|(s, _)| *s == (n, m)) {
                    Some((_, group)) => group.push(matrix),
                    None => by_shape.push(((n, m), vec![matrix])),
                }
            } else {
                self.numel_after += before as u64;
                uncompressed.push(tensor);
            }
        }
        let rank_of = |n: i64, m: i64| {
            (self.options.matrix_approximation_rank as i64)
                .min(n)
                .min(m)
        };
        let mut batches = Vec::new();
        for ((n, m), matrices) in by_shape {
            let rank = rank_of(n, m);
            if self.options.batch_tensors_with_same_shape {
                batches.push(Batch {
                    matrices,
                    n,
                    m,
                    rank,
                });
            } else {
                batches.extend(matrices.into_iter().map(|matrix| Batch {
                    matrices: vec![matrix],
                    n,
                    m,
                    rank,
                }));
            }
        }
        (uncompressed, batches)
    }

    /// Finishes a synchronisation [`start`](Self::start) began: the values
    /// (the mean, or its approximation) followed by each flag's share of
    /// processes, in the kind sent.
    pub(crate) fn finish(
        &mut self,
        group: &dyn ProcessGroup,
        in_flight: InFlight<'_>,
    ) -> Result<Tensor, DistError> {
        let c = match in_flight {
            InFlight::Plain {
                pending,
                flags,
                world,
            } => {
                return Ok(super::bucket::counts_to_shares(
                    pending.wait()?,
                    flags,
                    world,
                ))
            }
            InFlight::Compressed(c) => *c,
        };
        let shares = c.uncompressed_sum.wait()? / c.world;
        let mut at = 0;
        for t in &c.uncompressed {
            let n = t.numel() as i64;
            t.shallow_clone().copy_(&shares.narrow(0, at, n));
            at += n;
        }
        let flags = shares.narrow(0, at, shares.size()[0] - at);
        // P is orthogonalised, not divided.
        let p = c.p_sum.wait()?;
        for p in factors(&p, &c.batches, |b| b.n) {
            orthogonalize(&p, self.options.orthogonalization_epsilon);
        }
        let qs: Vec<Tensor> = (c.batches.iter())
            .zip(factors(&p, &c.batches, |b| b.n))
            .map(|(b, p)| b.stacked().transpose(1, 2).bmm(&p))
            .collect();
        let q = flatten_or_empty(&qs, &c.q);
        let mut q_sum = q.shallow_clone();
        group.all_reduce(&mut q_sum, ReduceOp::Sum)?;
        let q = q_sum / c.world;
        for ((b, p), q) in (c.batches.iter())
            .zip(factors(&p, &c.batches, |b| b.n))
            .zip(factors(&q, &c.batches, |b| b.m))
        {
            b.write(&p.bmm(&q.transpose(1, 2)));
        }
        if let Some(copy) = c.input_copy {
            self.error.insert(c.bucket, copy - &c.input);
        }
        if self.options.warm_start {
            self.q_memory.insert(c.bucket, q);
        }
        Ok(Tensor::cat(&[c.input, flags], 0))
    }

    /// Counts a finished synchronisation of every bucket (PyTorch's
    /// `maybe_increase_iter` on the last bucket) and logs the compression
    /// figures every `compression_stats_logging_frequency`.
    pub(crate) fn end_round(&mut self) {
        if self.iter >= self.options.start_power_sgd_iter && self.iter >= self.next_report {
            let rate = self.numel_before as f64 / self.numel_after.max(1) as f64;
            tracing::info!(
                "PowerSGD: step {}, {} values before compression, {} after ({rate:.1}× less)",
                self.iter,
                self.numel_before,
                self.numel_after
            );
            self.next_report = self.iter + self.options.compression_stats_logging_frequency.max(1);
        }
        self.iter += 1;
    }
}

fn flatten_or_empty(parts: &[Tensor], like: &Tensor) -> Tensor {
    if parts.is_empty() {
        Tensor::empty([0], (like.kind(), like.device()))
    } else {
        super::bucket::flatten(parts.iter().map(Tensor::shallow_clone))
    }
}

fn mismatch(group: &dyn ProcessGroup, e: tch::TchError) -> DistError {
    DistError::Mismatch {
        op: "PowerSGD",
        rank: group.process_index(),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_numpys_random_state_randint() {
        let _rng = crate::global_rng();
        // numpy.random.RandomState(s).randint(1_000_000_000) for s = 0 and
        // 7, as numpy gives them (the PowerSGD oracle test checks the rest).
        let mut zero = NumpyRandomState::new(0);
        assert_eq!(zero.randint_1e9(), 209_652_396);
        let mut seven = NumpyRandomState::new(7);
        assert_eq!(seven.randint_1e9(), 327_741_615);
    }

    #[test]
    fn a_start_below_two_with_error_feedback_is_refused_as_pytorch_refuses_it() {
        let _rng = crate::global_rng();
        let options = PowerSgdOptions {
            start_power_sgd_iter: 1,
            ..Default::default()
        };
        let e = options.validate().unwrap_err();
        assert!(
            e.contains("start_powerSGD_iter") && e.contains("> 1"),
            "{e}"
        );
        let options = PowerSgdOptions {
            start_power_sgd_iter: 0,
            use_error_feedback: false,
            warm_start: false,
            ..Default::default()
        };
        assert!(options.validate().is_ok());
        let e = PowerSgdOptions {
            matrix_approximation_rank: 0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.contains("matrix_approximation_rank"), "{e}");
        for (rate, epsilon) in [(f64::NAN, 0.0), (-1.0, 0.0), (2.0, f64::INFINITY)] {
            let e = PowerSgdOptions {
                min_compression_rate: rate,
                orthogonalization_epsilon: epsilon,
                ..Default::default()
            }
            .validate()
            .unwrap_err();
            let field = if rate == 2.0 {
                "orthogonalization_epsilon"
            } else {
                "min_compression_rate"
            };
            assert!(e.contains(field) && e.contains("at least 0"), "{e}");
        }
    }

    #[test]
    fn gram_schmidt_and_qr_give_orthonormal_columns() {
        let _rng = crate::global_rng();
        for rank in [1, 2, 3] {
            // A private generator: the global one is other tests'.
            let m = hearth_ops::randn_seeded(&[&[2, 7, rank]], Kind::Double, 7).unwrap();
            let m = &m[0];
            orthogonalize(m, 0.0);
            let gram = m.transpose(1, 2).bmm(m);
            let eye =
                Tensor::eye(rank, (Kind::Double, tch::Device::Cpu)).expand([2, rank, rank], false);
            assert!(gram.allclose(&eye, 1e-9, 1e-9, false), "rank {rank}");
        }
    }
}
