//! DDP's buckets: gradients cut into buckets of about `bucket_cap_mb`,
//! packed with a flag per parameter into one flat tensor, and the reduced
//! means written back. The lowest layer of DDP: the comm hooks send what
//! this packs.

use hearth_comm::{DistError, ProcessGroup};
use tch::{Kind, Tensor};

/// `bucket`'s gradients (zeros where this process has none) as one flat
/// tensor, and a flag per parameter: 1 where this process has a gradient.
/// A `shadow` (a joined process) sends zeros, flagged present where
/// `flag_present` (so that refusing unused parameters does not count it as
/// missing them) and absent otherwise (so that a parameter no training
/// process used keeps no gradient, as PyTorch's joined ranks leave it).
/// With a `view` (the bucket's own buffer, `gradient_as_bucket_view`), the
/// gradients are moved into it and become views of it.
pub(crate) fn pack(
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

/// `reduced` (values, then `flags` per-parameter counts of processes, as
/// the 16-bit paths sum them) with the counts divided into shares of the
/// `world`, as [`write_means`] reads them.
pub(crate) fn counts_to_shares(reduced: Tensor, flags: i64, world: f64) -> Tensor {
    let len = reduced.size()[0];
    let _ = reduced.narrow(0, len - flags, flags).g_div_scalar_(world);
    reduced
}

/// With the default bucket size, the first bucket holds at most this many
/// MiB, so that its all-reduce starts early in backward (DDP's
/// `_DEFAULT_FIRST_BUCKET_BYTES`, used when `bucket_cap_mb` is left unset).
pub const FIRST_BUCKET_MB: f64 = 1.0;

/// The bucket size DDP uses when `bucket_cap_mb` is not set (PyTorch's
/// 25 MiB).
pub const DEFAULT_BUCKET_CAP_MB: f64 = 25.0;

/// Cuts `params`, taken in `order`, into buckets of at most `cap_mb` MiB
/// (a larger parameter is a bucket of its own) holding one kind and device;
/// with the default cap the first bucket holds at most [`FIRST_BUCKET_MB`].
pub(crate) fn buckets(order: &[usize], params: &[Tensor], cap_mb: f64) -> Vec<Vec<usize>> {
    let bytes_of = |mb: f64| (mb * 1024.0 * 1024.0).max(1.0) as usize;
    let cap = bytes_of(cap_mb);
    let first_cap = if cap_mb == DEFAULT_BUCKET_CAP_MB {
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
pub(crate) fn flatten(tensors: impl Iterator<Item = Tensor>) -> Tensor {
    let flat: Vec<Tensor> = tensors.map(|t| t.reshape([-1])).collect();
    Tensor::cat(&flat, 0)
}

/// Views of `flat` shaped as each of `like`.
pub(crate) fn unflatten<'a>(
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
pub(crate) fn write_means(
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
        let default = DEFAULT_BUCKET_CAP_MB;
        assert_eq!(sizes(default), vec![vec![100_000; 2], vec![100_000; 2]]);
        assert_eq!(
            sizes(24.0),
            vec![vec![100_000; 4]],
            "any other cap holds for every bucket"
        );
    }
}
