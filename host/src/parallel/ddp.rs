//! DDP's side of the gradient round (PyTorch's `DistributedDataParallel`):
//! gradients cut into buckets of about `bucket_cap_mb`, each bucket's
//! gradients all-reduced to their mean on every process, optionally
//! compressed to 16 bits on the wire.

use crate::dist::{DistError, Pending, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

/// How gradients are compressed for the all-reduce (Accelerate's
/// `DDPCommunicationHookType`): the 16-bit hooks divide by the number of
/// processes, cast to half or bfloat16, sum, and cast back — half the bytes
/// on the wire, at 16-bit precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CommHook {
    /// Full-precision gradients.
    #[default]
    No,
    /// IEEE half precision on the wire (`fp16_compress_hook`).
    Fp16,
    /// bfloat16 on the wire (`bf16_compress_hook`).
    Bf16,
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
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            comm_hook: CommHook::No,
            broadcast_buffers: true,
            find_unused_parameters: false,
            static_graph: false,
        }
    }
}

impl DdpOptions {
    /// Whether a parameter may go without a gradient in a synchronising
    /// backward pass.
    pub fn allows_unused_parameters(&self) -> bool {
        self.find_unused_parameters || self.static_graph
    }
}

/// Packs `bucket`'s gradients and a flag per parameter (1 where this
/// process has a gradient) into one tensor and starts its all-reduce.
pub(super) fn start<'g>(
    group: &'g dyn ProcessGroup,
    options: DdpOptions,
    bucket: &[Tensor],
) -> Result<(Pending<'g>, Kind), DistError> {
    let world = group.num_processes() as f64;
    let (flat, kind) = tch::no_grad(|| {
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
        let mut parts: Vec<Tensor> = grads
            .into_iter()
            .zip(bucket)
            .map(|(g, p)| if g.defined() { g } else { p.zeros_like() }.reshape([-1]))
            .collect();
        parts.push(flags);
        // One copy: the gradients and their flags together.
        (Tensor::cat(&parts, 0), kind)
    });
    let pending = match options.comm_hook {
        CommHook::No => group.all_reduce_start(&flat, ReduceOp::Mean),
        hook => {
            let wire = if hook == CommHook::Fp16 {
                Kind::Half
            } else {
                Kind::BFloat16
            };
            group.all_reduce_start(&(flat / world).to_kind(wire), ReduceOp::Sum)
        }
    }?;
    Ok((pending, kind))
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

pub(super) fn flat_len(bucket: &[Tensor]) -> usize {
    bucket.iter().map(Tensor::numel).sum::<usize>() + bucket.len()
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
/// process had a gradient for keeps none. Returns the positions in
/// `bucket` of the parameters that require a gradient and that some
/// process had none for (the same on every process: the flags are reduced).
pub(super) fn write_means(
    group: &dyn ProcessGroup,
    bucket: &[Tensor],
    reduced: &Tensor,
) -> Result<Vec<usize>, DistError> {
    let n = bucket.len() as i64;
    let values = reduced.narrow(0, 0, reduced.size()[0] - n);
    let flags = reduced
        .narrow(0, reduced.size()[0] - n, n)
        .to_kind(Kind::Float);
    let flags = Vec::<f32>::try_from(&flags).expect("flags convert to f32");
    // Each flag is the share of processes that had the gradient.
    let missing = (flags.iter().enumerate())
        .filter(|&(i, &flag)| flag < 0.999 && bucket[i].requires_grad())
        .map(|(i, _)| i)
        .collect();
    tch::no_grad(|| {
        for ((p, value), flag) in bucket.iter().zip(unflatten(&values, bucket)).zip(flags) {
            let mut g = p.grad();
            if g.defined() {
                g.copy_(&value);
            } else if flag > 0.0 {
                crate::ops::set_grad(p, &value.contiguous()).map_err(|e| DistError::Mismatch {
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
}

impl BufferBroadcast {
    /// `buffers` sent from rank 0 over a channel of their own in `group`,
    /// once now.
    pub fn new(group: &dyn ProcessGroup, buffers: Vec<Tensor>) -> Result<Self, DistError> {
        let this = Self {
            group: group.duplicate()?,
            buffers,
        };
        this.run()?;
        Ok(this)
    }

    /// Sends rank 0's buffers to every process.
    pub fn run(&self) -> Result<(), DistError> {
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
