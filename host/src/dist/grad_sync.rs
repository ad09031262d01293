//! Data-parallel gradient averaging (PyTorch's `DistributedDataParallel`):
//! every process starts from rank 0's parameters, and after a backward pass
//! that ends an accumulation group the gradients are averaged across
//! processes, in buckets of about `bucket_cap_mb`.
//!
//! The buckets follow the parameters in reverse order (the order backward
//! produces gradients, as DDP's first-iteration guess). Their all-reduces
//! are all started before the first is waited for, so packing and unpacking
//! one bucket overlaps the communication of the others; they are started
//! after backward returns, not from inside it (libtorch's per-parameter
//! hooks are not reachable from tch), so communication does not overlap
//! the backward computation itself.

use super::{DistError, Pending, ProcessGroup, ReduceOp};
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
    /// PyTorch's default).
    pub bucket_cap_mb: f64,
    /// Compression of the gradients on the wire.
    pub comm_hook: CommHook,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            comm_hook: CommHook::No,
        }
    }
}

/// What gradient averaging has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SyncStats {
    /// Times the gradients were averaged (one per optimizer step).
    pub syncs: u64,
    /// All-reduces started (buckets × syncs).
    pub all_reduces: u64,
    /// Bytes this process sent into those all-reduces.
    pub bytes: u64,
}

/// The gradient averaging of one prepared model.
pub struct GradientSync {
    buckets: Vec<Vec<Tensor>>,
    options: DdpOptions,
    stats: SyncStats,
}

impl GradientSync {
    /// Makes every process start from rank 0's `parameters` (broadcast in
    /// buckets) and returns the averaging for them.
    pub fn new(
        group: &dyn ProcessGroup,
        parameters: Vec<Tensor>,
        options: DdpOptions,
    ) -> Result<Self, DistError> {
        let buckets = buckets(parameters, options.bucket_cap_mb);
        for bucket in &buckets {
            let mut flat = tch::no_grad(|| flatten(bucket.iter().map(|p| p.detach())));
            group.broadcast(&mut flat, 0)?;
            tch::no_grad(|| {
                for (p, value) in bucket.iter().zip(unflatten(&flat, bucket)) {
                    p.detach().copy_(&value);
                }
            });
        }
        Ok(Self {
            buckets,
            options,
            stats: SyncStats::default(),
        })
    }

    /// The parameters of each bucket, in the order they are averaged.
    pub fn buckets(&self) -> &[Vec<Tensor>] {
        &self.buckets
    }

    /// What averaging has done so far.
    pub fn stats(&self) -> SyncStats {
        self.stats
    }

    /// Replaces every gradient with its mean over the processes. A
    /// parameter without a gradient counts as zero; it gets the mean when
    /// some process had a gradient for it, and keeps none otherwise (so
    /// every process ends with the same gradients).
    pub fn sync(&mut self, group: &dyn ProcessGroup) -> Result<(), DistError> {
        let world = group.num_processes() as f64;
        let started: Vec<(Pending<'_>, Kind)> = self
            .buckets
            .iter()
            .map(|bucket| {
                let (flat, kind) = tch::no_grad(|| {
                    let grads: Vec<Tensor> = bucket.iter().map(Tensor::grad).collect();
                    // One flag per parameter: 1 where this process has a gradient.
                    let had: Vec<f32> = grads
                        .iter()
                        .map(|g| if g.defined() { 1.0 } else { 0.0 })
                        .collect();
                    let kind = bucket[0].kind();
                    let mut parts: Vec<Tensor> = grads
                        .into_iter()
                        .zip(bucket)
                        .map(|(g, p)| if g.defined() { g } else { p.zeros_like() }.reshape([-1]))
                        .collect();
                    parts.push(
                        Tensor::from_slice(&had)
                            .to_device(bucket[0].device())
                            .to_kind(kind),
                    );
                    // One copy: the gradients and their flags together.
                    (Tensor::cat(&parts, 0), kind)
                });
                let pending = match self.options.comm_hook {
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
                self.stats.all_reduces += 1;
                let wire_bytes = match self.options.comm_hook {
                    CommHook::No => kind.elt_size_in_bytes(),
                    _ => 2,
                };
                self.stats.bytes += (flat_len(bucket) * wire_bytes) as u64;
                Ok((pending, kind))
            })
            .collect::<Result<_, DistError>>()?;
        for ((pending, kind), bucket) in started.into_iter().zip(&self.buckets) {
            let mean = pending.wait()?.to_kind(kind);
            let n = bucket.len() as i64;
            let values = mean.narrow(0, 0, mean.size()[0] - n);
            let flags = mean.narrow(0, mean.size()[0] - n, n).to_kind(Kind::Float);
            let flags = Vec::<f32>::try_from(&flags).expect("flags convert to f32");
            tch::no_grad(|| -> Result<(), DistError> {
                for ((p, value), flag) in bucket.iter().zip(unflatten(&values, bucket)).zip(flags) {
                    let mut g = p.grad();
                    if g.defined() {
                        g.copy_(&value);
                    } else if flag > 0.0 {
                        crate::ops::set_grad(p, &value.contiguous()).map_err(|e| {
                            DistError::Mismatch {
                                op: "gradient sync",
                                rank: group.process_index(),
                                message: e.to_string(),
                            }
                        })?;
                    }
                }
                Ok(())
            })?;
        }
        self.stats.syncs += 1;
        Ok(())
    }
}

/// Groups `parameters` (reversed) into buckets of at most `cap_mb` MiB
/// (a larger parameter is a bucket of its own) holding one kind and device.
fn buckets(parameters: Vec<Tensor>, cap_mb: f64) -> Vec<Vec<Tensor>> {
    let cap = (cap_mb * 1024.0 * 1024.0).max(1.0) as usize;
    let mut out: Vec<Vec<Tensor>> = Vec::new();
    let mut filled = 0usize;
    for p in parameters.into_iter().rev() {
        let bytes = p.numel() * p.kind().elt_size_in_bytes();
        let fits = out.last().is_some_and(|b: &Vec<Tensor>| {
            b[0].kind() == p.kind() && b[0].device() == p.device() && filled + bytes <= cap
        });
        if fits {
            filled += bytes;
            out.last_mut().expect("checked above").push(p);
        } else {
            filled = bytes;
            out.push(vec![p]);
        }
    }
    out
}

fn flat_len(bucket: &[Tensor]) -> usize {
    bucket.iter().map(Tensor::numel).sum::<usize>() + bucket.len()
}

/// The tensors as one 1-d tensor.
fn flatten(tensors: impl Iterator<Item = Tensor>) -> Tensor {
    let flat: Vec<Tensor> = tensors.map(|t| t.reshape([-1])).collect();
    Tensor::cat(&flat, 0)
}

/// Views of `flat` shaped as each of `like`.
fn unflatten<'a>(flat: &'a Tensor, like: &'a [Tensor]) -> impl Iterator<Item = Tensor> + 'a {
    let mut at = 0i64;
    like.iter().map(move |p| {
        let n = p.numel() as i64;
        let part = flat.narrow(0, at, n).view(p.size().as_slice());
        at += n;
        part
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::SingleProcess;
    use tch::Device;

    fn param(n: i64) -> Tensor {
        Tensor::ones([n], (Kind::Float, Device::Cpu)).set_requires_grad(true)
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
        let b = buckets(ps, 1.0);
        let sizes: Vec<Vec<usize>> = b
            .iter()
            .map(|b| b.iter().map(Tensor::numel).collect())
            .collect();
        assert_eq!(
            sizes,
            vec![vec![300_000], vec![100_000, 100_000], vec![100_000]]
        );
    }

    #[test]
    fn a_world_of_one_keeps_its_gradients_and_counts_the_syncs() {
        let (a, b, unused) = (param(3), param(2), param(4));
        (&a * 2.0 + 0.0).sum(Kind::Float).backward();
        (&b * 3.0).sum(Kind::Float).backward();
        let mut sync = GradientSync::new(
            &SingleProcess,
            vec![a.shallow_clone(), b.shallow_clone(), unused.shallow_clone()],
            DdpOptions::default(),
        )
        .unwrap();
        sync.sync(&SingleProcess).unwrap();
        assert_eq!(Vec::<f32>::try_from(a.grad()).unwrap(), vec![2.0; 3]);
        assert_eq!(Vec::<f32>::try_from(b.grad()).unwrap(), vec![3.0; 2]);
        assert!(!unused.grad().defined(), "no process had a gradient for it");
        let stats = sync.stats();
        assert_eq!((stats.syncs, stats.all_reduces), (1, 1));
        assert_eq!(stats.bytes, ((3 + 2 + 4 + 3) * 4) as u64);
    }

    #[test]
    fn the_16_bit_hooks_round_the_gradients() {
        let p = param(1);
        (&p * 1.0001).sum(Kind::Float).backward();
        let options = DdpOptions {
            comm_hook: CommHook::Bf16,
            ..Default::default()
        };
        let mut sync = GradientSync::new(&SingleProcess, vec![p.shallow_clone()], options).unwrap();
        sync.sync(&SingleProcess).unwrap();
        // bfloat16 has 8 bits of mantissa: 1.0001 rounds to 1.
        assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), vec![1.0]);
        assert_eq!(
            sync.stats().bytes,
            4,
            "two 16-bit values: the gradient and its flag"
        );
    }
}
