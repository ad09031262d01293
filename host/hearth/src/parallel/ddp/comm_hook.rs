//! How a bucket goes on the wire (Accelerate's `DDPCommunicationHookType`
//! and `comm_wrapper`): full precision, 16 bits, or PowerSGD's low-rank
//! factors; [`start`] launches a bucket's all-reduce under the hook and
//! [`Collective`] is that all-reduce under way.

use super::bucket::{counts_to_shares, pack};
use super::power_sgd::{self, PowerSgd};
use hearth_comm::{DistError, Pending, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

/// How gradients are compressed for the all-reduce (Accelerate's
/// `DDPCommunicationHookType`): the 16-bit hooks cast to half or bfloat16,
/// divide by the number of processes, sum, and cast back — half the bytes
/// on the wire, at 16-bit precision; PowerSGD sends low-rank factors of
/// each matrix (see `power_sgd`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum CommHook {
    /// Full-precision gradients.
    #[default]
    No,
    /// IEEE half precision on the wire (`fp16_compress_hook`).
    Fp16,
    /// bfloat16 on the wire (`bf16_compress_hook`).
    Bf16,
    /// PowerSGD (`powerSGD_hook`), set by [`DdpOptions::comm_state_option`](crate::parallel::DdpOptions::comm_state_option).
    PowerSgd,
    /// Refused: PyTorch's `batched_powerSGD_hook` fails its own check.
    BatchedPowerSgd,
}

/// A cast around the comm hook (Accelerate's `comm_wrapper`, PyTorch's
/// `fp16_compress_wrapper` / `bf16_compress_wrapper`): the hook runs on the
/// gradients in 16 bits, and its result is cast back.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
)]
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

/// A bucket's collective under way.
pub(crate) enum Collective<'g> {
    /// One all-reduce or reduce-scatter.
    One(Pending<'g>),
    /// An all-reduce whose last `flags` values are sums of 1s (counts of
    /// processes), divided by the number of processes when waited for.
    Counted { pending: Pending<'g>, flags: i64 },
    /// PowerSGD's rounds (the rest run when it is waited for).
    PowerSgd(power_sgd::InFlight<'g>),
}

impl Collective<'_> {
    /// The result: for DDP the bucket's values and each flag's share.
    pub(crate) fn wait(
        self,
        power_sgd: Option<&mut PowerSgd>,
        group: &dyn ProcessGroup,
    ) -> Result<Tensor, DistError> {
        match (self, power_sgd) {
            (Self::One(pending), _) => pending.wait(),
            (Self::Counted { pending, flags }, _) => Ok(counts_to_shares(
                pending.wait()?,
                flags,
                group.num_processes() as f64,
            )),
            (Self::PowerSgd(in_flight), Some(state)) => {
                tch::no_grad(|| state.finish(group, in_flight))
            }
            (Self::PowerSgd(_), None) => unreachable!("PowerSGD started without its state"),
        }
    }
}

/// How [`start`] sends a bucket: the hook, the cast around it, and whether
/// a parameter's flag marks it present (DDP refusing unused parameters) or
/// having a gradient.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wire {
    /// The comm hook.
    pub hook: CommHook,
    /// The cast around it.
    pub wrapper: CommWrapper,
    /// See [`super::bucket::pack`].
    pub flag_present: bool,
}

/// Starts bucket `index`'s all-reduce: its gradients and a flag per
/// parameter (1 where this process has a gradient), sent as `wire` says;
/// `power_sgd` is the model's PowerSGD state when the hook is PowerSGD; a
/// `shadow` sends zeros (see `GradientSync`'s shadow rounds);
/// `view` is the bucket's buffer under `gradient_as_bucket_view`.
/// Returns the collective, the kind to cast its result back to, and the
/// bytes this process sends.
pub(crate) fn start<'g>(
    group: &'g dyn ProcessGroup,
    wire: Wire,
    power_sgd: Option<&mut PowerSgd>,
    index: usize,
    bucket: &[Tensor],
    shadow: bool,
    view: Option<&Tensor>,
) -> Result<(Collective<'g>, Kind, u64), DistError> {
    let world = group.num_processes() as f64;
    let kind = bucket[0].kind();
    let flag_present = wire.flag_present;
    let (mut values, mut flags) = pack(bucket, shadow, flag_present, view);
    if let Some(wrapped) = wire.wrapper.kind() {
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
    let (collective, sent) = match (wire.hook, power_sgd) {
        (CommHook::PowerSgd, Some(state)) => {
            let shapes: Vec<Vec<i64>> = bucket.iter().map(Tensor::size).collect();
            let (in_flight, sent) =
                tch::no_grad(|| state.start(group, index, values, flags, &shapes))?;
            (Collective::PowerSgd(in_flight), sent)
        }
        (CommHook::Fp16 | CommHook::Bf16, _) => {
            let on_wire = if wire.hook == CommHook::Fp16 {
                Kind::Half
            } else {
                Kind::BFloat16
            };
            let flat = sixteen(on_wire);
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
