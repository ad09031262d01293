//! DDP's side of the gradient round (PyTorch's `DistributedDataParallel`):
//! gradients cut into buckets of about `bucket_cap_mb`, each bucket's
//! gradients all-reduced to their mean on every process, optionally
//! compressed on the wire (16 bits, or PowerSGD's low-rank factors).

use super::grad_sync::Collective;
use super::power_sgd::{PowerSgd, PowerSgdOptions};
use hearth_comm::{DistError, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

/// How gradients are compressed for the all-reduce (Accelerate's
/// `DDPCommunicationHookType`): the 16-bit hooks cast to half or bfloat16,
/// divide by the number of processes, sum, and cast back — half the bytes
/// on the wire, at 16-bit precision; PowerSGD sends low-rank factors of
/// each matrix (see [`super::power_sgd`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CommHook {
    /// Full-precision gradients.
    #[default]
    No,
    /// IEEE half precision on the wire (`fp16_compress_hook`).
    Fp16,
    /// bfloat16 on the wire (`bf16_compress_hook`).
    Bf16,
    /// PowerSGD (`powerSGD_hook`), set by [`DdpOptions::comm_state_option`].
    PowerSgd,
    /// Refused: PyTorch's `batched_powerSGD_hook` fails its own check.
    BatchedPowerSgd,
}

/// A cast around the comm hook (Accelerate's `comm_wrapper`, PyTorch's
/// `fp16_compress_wrapper` / `bf16_compress_wrapper`): the hook runs on the
/// gradients in 16 bits, and its result is cast back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CommWrapper {
    /// The hook sees the gradients' own kind.
    #[default]
    No,
    /// Half precision.
    Fp16,
    /// bfloat16.
    Bf16,
}

impl CommWrapper {
    /// The kind the hook runs in, when it is cast.
    pub(crate) fn kind(self) -> Option<Kind> {
        match self {
            Self::No => None,
            Self::Fp16 => Some(Kind::Half),
            Self::Bf16 => Some(Kind::BFloat16),
        }
    }
}

/// The data-parallel settings that apply to hearth (Accelerate's
/// `DistributedDataParallelKwargs`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    /// Gradients are averaged in buckets of about this many MiB (25, as
    /// PyTorch's default; left at 25, the first bucket holds at most
    /// [`FIRST_BUCKET_MB`] as DDP's does).
    pub bucket_cap_mb: f64,
    /// Compression of the gradients on the wire.
    pub comm_hook: CommHook,
    /// A 16-bit cast around `comm_hook` (refused with [`CommHook::No`],
    /// where Accelerate registers no hook to wrap).
    pub comm_wrapper: CommWrapper,
    /// PowerSGD's settings (with [`CommHook::PowerSgd`] only).
    pub comm_state_option: PowerSgdOptions,
    /// Rank 0's buffers (BatchNorm's running statistics, say) are sent to
    /// every process before each training forward pass (PyTorch's
    /// default); off, each process keeps its own.
    pub broadcast_buffers: bool,
    /// Parameters may go without a gradient in a backward pass that
    /// syncs (PyTorch's `find_unused_parameters`): such a gradient counts
    /// as zero in the mean. Off (the default), a parameter that some
    /// process got no gradient for is an error naming it, as DDP's is.
    pub find_unused_parameters: bool,
    /// The model uses the same parameters in every step (PyTorch's
    /// `static_graph`): unused parameters are allowed, as with
    /// `find_unused_parameters`, since the set found in the first step
    /// holds for all (the buckets are rebuilt once, after the first step,
    /// either way).
    pub static_graph: bool,
    /// Gradients are views into the buckets that are all-reduced
    /// (PyTorch's `gradient_as_bucket_view`): once a gradient lives there
    /// (zeroed in place, or accumulated over `no_sync` micro-batches) it is
    /// not copied into a bucket before the all-reduce (without a comm hook),
    /// and the means are written into the buckets, so into the gradients.
    /// Numerically the same. Frozen parameters take room in the buckets too.
    pub gradient_as_bucket_view: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            comm_hook: CommHook::No,
            comm_wrapper: CommWrapper::No,
            comm_state_option: PowerSgdOptions::default(),
            broadcast_buffers: true,
            find_unused_parameters: false,
            static_graph: false,
            gradient_as_bucket_view: false,
        }
    }
}

impl DdpOptions {
    /// Whether a parameter may go without a gradient in a synchronising
    /// backward pass.
    pub fn allows_unused_parameters(&self) -> bool {
        self.find_unused_parameters || self.static_graph
    }

    /// Refuses combinations that would do nothing or what hearth cannot
    /// match; the message names the field and says what to set.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.bucket_cap_mb.is_finite() && self.bucket_cap_mb > 0.0) {
            return Err(format!(
                "bucket_cap_mb must be a positive number of MiB, not {}",
                self.bucket_cap_mb
            ));
        }
        match self.comm_hook {
            CommHook::BatchedPowerSgd => {
                return Err(
                    "comm_hook = batched_power_sgd: PyTorch's batched_powerSGD_hook \
                            fails its own check (it orthogonalises a 2-d matrix where \
                            _orthogonalize asserts 3-d), so there is nothing to match; use \
                            comm_hook = power_sgd, with batch_tensors_with_same_shape = true \
                            in comm_state_option to batch matrices of one shape"
                        .into(),
                )
            }
            CommHook::PowerSgd => self.comm_state_option.validate()?,
            CommHook::No if self.comm_wrapper != CommWrapper::No => {
                return Err(format!(
                    "comm_wrapper = {} wraps a comm hook, and comm_hook is no (Accelerate \
                     registers nothing then): set comm_hook = power_sgd, fp16 or bf16, or \
                     leave comm_wrapper out",
                    format!("{:?}", self.comm_wrapper).to_lowercase()
                ))
            }
            _ => {}
        }
        if self.comm_hook != CommHook::PowerSgd
            && self.comm_state_option != PowerSgdOptions::default()
        {
            return Err(
                "comm_state_option sets PowerSGD's state, and comm_hook is not power_sgd: \
                 set comm_hook = power_sgd, or leave comm_state_option out"
                    .into(),
            );
        }
        Ok(())
    }
}

/// `bucket`'s gradients (zeros where this process has none) as one flat
/// tensor, and a flag per parameter: 1 where this process has a gradient.
/// A `shadow` (a joined process) sends zeros, flagged present where
/// `flag_present` (so that refusing unused parameters does not count it as
/// missing them) and absent otherwise (so that a parameter no training
/// process used keeps no gradient, as PyTorch's joined ranks leave it).
/// With a `view` (the bucket's own buffer, `gradient_as_bucket_view`), the
/// gradients are moved into it and become views of it.
fn pack(
    bucket: &[Tensor],
    shadow: bool,
    flag_present: bool,
    view: Option<&Tensor>,
) -> (Tensor, Tensor) {
    tch::no_grad(|| {
        if let (false, Some(buffer)) = (shadow, view) {
            return pack_into(bucket, buffer);
        }
        if shadow {
            let (kind, device) = (bucket[0].kind(), bucket[0].device());
            let numel = bucket.iter().map(Tensor::numel).sum::<usize>() as i64;
            // Frozen parameters have no gradient anywhere.
            let present: Vec<f32> = (bucket.iter())
                .map(|p| f32::from(u8::from(flag_present && p.requires_grad())))
                .collect();
            return (
                Tensor::zeros([numel], (kind, device)),
                Tensor::from_slice(&present).to_device(device).to_kind(kind),
            );
        }
        let grads: Vec<Tensor> = bucket.iter().map(Tensor::grad).collect();
        let had: Vec<f32> = grads
            .iter()
            .map(|g| if g.defined() { 1.0 } else { 0.0 })
            .collect();
        let (kind, device) = (bucket[0].kind(), bucket[0].device());
        // All ones (always so inside backward) needs no copy from the host,
        // which would wait for the device.
        let flags = if had.iter().all(|&h| h == 1.0) {
            Tensor::ones([had.len() as i64], (kind, device))
        } else {
            Tensor::from_slice(&had).to_device(device).to_kind(kind)
        };
        let values = flatten(grads.into_iter().zip(bucket).map(|(g, p)| {
            if g.defined() {
                g
            } else {
                p.zeros_like()
            }
        }));
        (values, flags)
    })
}

/// [`pack`] into `buffer` (a bucket's gradients, then its flags): each
/// gradient not yet in it is copied there and replaced by its view.
fn pack_into(bucket: &[Tensor], buffer: &Tensor) -> (Tensor, Tensor) {
    let n = bucket.len() as i64;
    let numel = buffer.size()[0] - n;
    let values = buffer.narrow(0, 0, numel);
    let mut had = Vec::with_capacity(bucket.len());
    for (p, mut view) in bucket.iter().zip(unflatten(&values, bucket)) {
        let g = p.grad();
        if !g.defined() {
            let _ = view.zero_();
            had.push(0.0f32);
            continue;
        }
        had.push(1.0);
        if g.data_ptr() != view.data_ptr() {
            view.copy_(&g);
            hearth_ops::set_grad(p, &view).expect("a view of the gradient's own shape and kind");
        }
    }
    let mut flags = buffer.narrow(0, numel, n);
    if had.iter().all(|&h| h == 1.0) {
        let _ = flags.fill_(1.0);
    } else {
        flags.copy_(&Tensor::from_slice(&had));
    }
    (values, flags)
}

/// Starts bucket `index`'s all-reduce: its gradients and a flag per
/// parameter (1 where this process has a gradient), compressed as the
/// options say; `power_sgd` is the model's PowerSGD state when the hook is
/// PowerSGD; a `shadow` sends zeros (see [`super::grad_sync::Round::shadow`]);
/// `view` is the bucket's buffer under `gradient_as_bucket_view`.
/// Returns the collective, the kind to cast its result back to, and the
/// bytes this process sends.
pub(super) fn start<'g>(
    group: &'g dyn ProcessGroup,
    options: DdpOptions,
    power_sgd: Option<&mut PowerSgd>,
    index: usize,
    bucket: &[Tensor],
    shadow: bool,
    view: Option<&Tensor>,
) -> Result<(Collective<'g>, Kind, u64), DistError> {
    let world = group.num_processes() as f64;
    let kind = bucket[0].kind();
    let flag_present = !options.allows_unused_parameters();
    let (mut values, mut flags) = pack(bucket, shadow, flag_present, view);
    if let Some(wrapped) = options.comm_wrapper.kind() {
        (values, flags) = (values.to_kind(wrapped), flags.to_kind(wrapped));
    }
    let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    // `_compress_hook`: cast, then divide, then sum; the flags are summed
    // as counts (whole numbers are exact in 16 bits, up to 256 in
    // bfloat16) and divided when they come back.
    let sixteen = |wire: Kind| {
        let values = values.to_kind(wire) / world;
        Tensor::cat(&[values, flags.to_kind(wire)], 0)
    };
    let (collective, sent) = match (options.comm_hook, power_sgd) {
        (CommHook::PowerSgd, Some(state)) => {
            let shapes: Vec<Vec<i64>> = bucket.iter().map(Tensor::size).collect();
            let (in_flight, sent) =
                tch::no_grad(|| state.start(group, index, values, flags, &shapes))?;
            (Collective::PowerSgd(in_flight), sent)
        }
        (CommHook::Fp16 | CommHook::Bf16, _) => {
            let wire = if options.comm_hook == CommHook::Fp16 {
                Kind::Half
            } else {
                Kind::BFloat16
            };
            let flat = sixteen(wire);
            let pending = group.all_reduce_start(&flat, ReduceOp::Sum)?;
            let flags = bucket.len() as i64;
            (Collective::Counted { pending, flags }, bytes(&flat))
        }
        _ => {
            let flat = match view {
                // The gradients and flags are in it already, in order.
                Some(buffer) if !shadow => buffer.shallow_clone(),
                _ => Tensor::cat(&[values, flags], 0),
            };
            (
                Collective::One(group.all_reduce_start(&flat, ReduceOp::Mean)?),
                bytes(&flat),
            )
        }
    };
    Ok((collective, kind, sent))
}

/// `reduced` (values, then `flags` per-parameter counts of processes, as
/// the 16-bit paths sum them) with the counts divided into shares of the
/// `world`, as [`write_means`] reads them.
pub(super) fn counts_to_shares(reduced: Tensor, flags: i64, world: f64) -> Tensor {
    let len = reduced.size()[0];
    let _ = reduced.narrow(0, len - flags, flags).g_div_scalar_(world);
    reduced
}

/// With the default bucket size, the first bucket holds at most this many
/// MiB, so that its all-reduce starts early in backward (DDP's
/// `_DEFAULT_FIRST_BUCKET_BYTES`, used when `bucket_cap_mb` is left unset).
pub const FIRST_BUCKET_MB: f64 = 1.0;

/// Cuts `params`, taken in `order`, into buckets of at most `cap_mb` MiB
/// (a larger parameter is a bucket of its own) holding one kind and device;
/// with the default cap the first bucket holds at most [`FIRST_BUCKET_MB`].
pub(super) fn buckets(order: &[usize], params: &[Tensor], cap_mb: f64) -> Vec<Vec<usize>> {
    let bytes_of = |mb: f64| (mb * 1024.0 * 1024.0).max(1.0) as usize;
    let cap = bytes_of(cap_mb);
    let first_cap = if cap_mb == DdpOptions::default().bucket_cap_mb {
        bytes_of(FIRST_BUCKET_MB)
    } else {
        cap
    };
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut filled = 0usize;
    for &i in order {
        let p = &params[i];
        let bytes = p.numel() * p.kind().elt_size_in_bytes();
        let limit = if out.len() == 1 { first_cap } else { cap };
        let fits = out.last().is_some_and(|b: &Vec<usize>| {
            let q = &params[b[0]];
            q.kind() == p.kind() && q.device() == p.device() && filled + bytes <= limit
        });
        if fits {
            filled += bytes;
            out.last_mut().expect("checked above").push(i);
        } else {
            filled = bytes;
            out.push(vec![i]);
        }
    }
    out
}

/// The tensors as one 1-d tensor.
pub(super) fn flatten(tensors: impl Iterator<Item = Tensor>) -> Tensor {
    let flat: Vec<Tensor> = tensors.map(|t| t.reshape([-1])).collect();
    Tensor::cat(&flat, 0)
}

/// Views of `flat` shaped as each of `like`.
pub(super) fn unflatten<'a>(
    flat: &'a Tensor,
    like: &'a [Tensor],
) -> impl Iterator<Item = Tensor> + 'a {
    let mut at = 0i64;
    like.iter().map(move |p| {
        let n = p.numel() as i64;
        let part = flat.narrow(0, at, n).view(p.size().as_slice());
        at += n;
        part
    })
}

/// Writes the means of `reduced` (a bucket's gradients and flags, as
/// [`start`] packed them) into the gradients of `bucket`; a parameter no
/// process had a gradient for keeps none. With a `view` (the bucket's
/// buffer, `gradient_as_bucket_view`) the means are written into it and a
/// gradient is its view. Returns the positions in `bucket` of the
/// parameters that require a gradient and that some process had none for
/// (the same on every process: the flags are reduced).
pub(super) fn write_means(
    group: &dyn ProcessGroup,
    bucket: &[Tensor],
    reduced: &Tensor,
    view: Option<&Tensor>,
) -> Result<Vec<usize>, DistError> {
    let n = bucket.len() as i64;
    let reduced = match view {
        Some(buffer) => {
            tch::no_grad(|| buffer.shallow_clone().copy_(reduced));
            buffer.shallow_clone()
        }
        None => reduced.shallow_clone(),
    };
    let values = reduced.narrow(0, 0, reduced.size()[0] - n);
    let flags = reduced
        .narrow(0, reduced.size()[0] - n, n)
        .to_kind(Kind::Float);
    let flags = Vec::<f32>::try_from(&flags).expect("flags convert to f32");
    // Each flag is the share of processes that had the gradient; as a
    // count of processes it is a whole number (rounded: 16-bit shares are
    // not exact).
    let world = group.num_processes() as f64;
    let count = |share: f32| (share as f64 * world).round();
    let missing = (flags.iter().enumerate())
        .filter(|&(i, &flag)| count(flag) < world && bucket[i].requires_grad())
        .map(|(i, _)| i)
        .collect();
    tch::no_grad(|| {
        for ((p, value), flag) in bucket.iter().zip(unflatten(&values, bucket)).zip(flags) {
            let mut g = p.grad();
            if g.defined() {
                if g.data_ptr() != value.data_ptr() {
                    g.copy_(&value);
                }
            } else if count(flag) > 0.0 {
                hearth_ops::set_grad(p, &value.contiguous()).map_err(|e| DistError::Mismatch {
                    op: "gradient sync",
                    rank: group.process_index(),
                    message: e.to_string(),
                })?;
            }
        }
        Ok(missing)
    })
}

/// A model's buffers kept equal to rank 0's: sent from it once when the
/// model is prepared and, under DDP's `broadcast_buffers`, before every
/// training forward pass.
pub struct BufferBroadcast {
    group: Box<dyn ProcessGroup>,
    buffers: Vec<Tensor>,
    /// Set while processes may have run out of inputs (inside
    /// `join_uneven_inputs`): a joined rank 0 sends nothing, so each
    /// process keeps its own until the join ends.
    paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl BufferBroadcast {
    /// `buffers` sent from rank 0 over a channel of their own in `group`,
    /// once now; none is sent while `paused` is set.
    pub fn new(
        group: &dyn ProcessGroup,
        buffers: Vec<Tensor>,
        paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Self, DistError> {
        let this = Self {
            group: group.duplicate()?,
            buffers,
            paused,
        };
        this.send()?;
        Ok(this)
    }

    /// Sends rank 0's buffers to every process (nothing while paused).
    pub fn run(&self) -> Result<(), DistError> {
        if self.paused.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        self.send()
    }

    fn send(&self) -> Result<(), DistError> {
        tch::no_grad(|| {
            self.buffers
                .iter()
                .try_for_each(|b| self.group.broadcast(&mut b.shallow_clone(), 0))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn param(n: i64) -> Tensor {
        Tensor::ones([n], (Kind::Float, Device::Cpu)).set_requires_grad(true)
    }

    /// The sizes of the buckets `params` are cut into, in the first order
    /// (reversed).
    fn bucket_sizes(params: Vec<Tensor>, cap_mb: f64) -> Vec<Vec<usize>> {
        let order: Vec<usize> = (0..params.len()).rev().collect();
        buckets(&order, &params, cap_mb)
            .iter()
            .map(|b| b.iter().map(|&i| params[i].numel()).collect())
            .collect()
    }

    /// A world of that many processes, seen from rank 0, without collectives.
    struct World(usize);
    impl ProcessGroup for World {
        fn process_index(&self) -> usize {
            0
        }
        fn num_processes(&self) -> usize {
            self.0
        }
        fn local_process_index(&self) -> usize {
            0
        }
        fn num_local_processes(&self) -> usize {
            self.0
        }
        fn backend(&self) -> &'static str {
            "test"
        }
    }

    /// Seven shares of 1/7 summed one by one in bfloat16 (as a ring
    /// all-reduce would) make 0.9921875, not 1: the share is read as a
    /// count of processes, rounded, so the parameter is not taken for one
    /// some process had no gradient for; a share one process short is.
    #[test]
    fn a_share_summed_in_16_bits_still_counts_every_process() {
        let p = param(2);
        let reduced = Tensor::from_slice(&[0.5f32, 0.25, 0.992_187_5]);
        let missing = write_means(&World(7), std::slice::from_ref(&p), &reduced, None).unwrap();
        assert!(missing.is_empty());
        assert_eq!(Vec::<f32>::try_from(&p.grad()).unwrap(), vec![0.5, 0.25]);
        let short = Tensor::from_slice(&[0.5f32, 0.25, 6.0 / 7.0]);
        let missing = write_means(&World(7), &[param(2)], &short, None).unwrap();
        assert_eq!(missing, vec![0]);
    }

    #[test]
    fn buckets_hold_reversed_parameters_up_to_the_cap() {
        // 1 MiB cap: 256 Ki floats per bucket.
        let ps = vec![
            param(100_000),
            param(100_000),
            param(100_000),
            param(300_000),
        ];
        assert_eq!(
            bucket_sizes(ps, 1.0),
            vec![vec![300_000], vec![100_000, 100_000], vec![100_000]]
        );
    }

    #[test]
    fn with_the_default_cap_the_first_bucket_holds_one_mib() {
        // Four parameters of 400 KB each.
        let sizes = |cap_mb: f64| bucket_sizes((0..4).map(|_| param(100_000)).collect(), cap_mb);
        let default = DdpOptions::default().bucket_cap_mb;
        assert_eq!(sizes(default), vec![vec![100_000; 2], vec![100_000; 2]]);
        assert_eq!(
            sizes(24.0),
            vec![vec![100_000; 4]],
            "any other cap holds for every bucket"
        );
    }
}
