//! Gradient utilities over a list of parameters.

use hearth_ops as ops;
use tch::{Kind, TchError, Tensor};

/// Scales the gradients of `parameters` so that their total `norm_type`
/// norm (2: L2; 1; `f64::INFINITY`: the largest absolute value; any
/// p > 0) is at most `max_norm`, as `torch.nn.utils.clip_grad_norm_`
/// (foreach path): the per-tensor norms come from one `_foreach_norm`, and
/// the scale stays on the device (no host sync). Returns the total norm
/// before clipping. Parameters without a gradient are skipped.
pub fn clip_grad_norm_(
    parameters: &[Tensor],
    max_norm: f64,
    norm_type: f64,
) -> Result<Tensor, TchError> {
    clip_grad_norm_across(parameters, max_norm, norm_type, None, &[])
}

/// The `p`-norm of `grads` taken together (a 0-d float tensor): the
/// `p`-norm of their norms, as PyTorch stacks them.
fn total_norm(grads: &[Tensor], p: f64) -> Result<Tensor, TchError> {
    if grads.is_empty() {
        return Ok(Tensor::from(0.0f32));
    }
    let norms = ops::foreach_norm(grads, p)?;
    Tensor::f_stack(&norms, 0)?
        .f_norm_scalaropt_dim(p, [0i64], false)
        .map(|n| n.to_kind(Kind::Float))
}

/// [`clip_grad_norm_`] where the parameters marked in `sharded` are this
/// process's shards of parameters spread over `group` (the others whole on
/// every process): the total norm is that of the whole gradients — for a
/// finite p the p-th powers of the shards' norms summed over the
/// processes plus this process's own of the others, for infinity the
/// largest over the processes — as FSDP's `clip_grad_norm_` computes it.
pub(super) fn clip_grad_norm_across(
    parameters: &[Tensor],
    max_norm: f64,
    norm_type: f64,
    group: Option<&dyn hearth_comm::ProcessGroup>,
    sharded: &[bool],
) -> Result<Tensor, TchError> {
    let with_grad = |want_sharded: bool| -> Vec<Tensor> {
        parameters
            .iter()
            .enumerate()
            .filter(|(i, _)| sharded.get(*i).copied().unwrap_or(false) == want_sharded)
            .map(|(_, p)| p.grad())
            .filter(|g| g.defined() && g.numel() > 0)
            .collect()
    };
    let p = norm_type;
    if p.is_nan() || p <= 0.0 {
        return Err(TchError::Torch(format!(
            "clip_grad_norm_: norm_type must be a number above 0 (2.0 for L2, f64::INFINITY for the largest value), not {p}"
        )));
    }
    let (shards, whole) = (with_grad(true), with_grad(false));
    let total = match group {
        Some(group) if !sharded.is_empty() => {
            let cpu = |t: Tensor| t.to_device(tch::Device::Cpu);
            let (shard_norm, local) = (cpu(total_norm(&shards, p)?), cpu(total_norm(&whole, p)?));
            let reduce = |t: &mut Tensor, op| {
                group
                    .all_reduce(t, op)
                    .map_err(|e| TchError::Torch(e.to_string()))
            };
            if p.is_infinite() {
                let mut largest = shard_norm;
                reduce(&mut largest, hearth_comm::ReduceOp::Max)?;
                largest.maximum(&local)
            } else {
                let mut powered = shard_norm.pow_tensor_scalar(p);
                reduce(&mut powered, hearth_comm::ReduceOp::Sum)?;
                (powered + local.pow_tensor_scalar(p)).pow_tensor_scalar(1.0 / p)
            }
        }
        _ => {
            if whole.is_empty() {
                return Ok(Tensor::from(0.0f32));
            }
            total_norm(&whole, p)?
        }
    };
    let grads: Vec<Tensor> = shards.into_iter().chain(whole).collect();
    if grads.is_empty() {
        return Ok(total);
    }
    let total = total.to_device(grads[0].device());
    let coef = (max_norm / (&total + 1e-6)).f_clamp_max(1.0)?;
    // Offloaded shards' gradients are in host memory, the others on the
    // GPU: one multiply per device.
    let mut rest = grads;
    while !rest.is_empty() {
        let device = rest[0].device();
        let (here, there): (Vec<Tensor>, Vec<Tensor>) =
            rest.into_iter().partition(|g| g.device() == device);
        ops::foreach_mul_(&here, &coef.to_device(device).to_kind(here[0].kind()))?;
        rest = there;
    }
    Ok(total.to_kind(Kind::Float))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clips_to_max_norm_and_returns_the_norm_before() {
        let p = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        (&p * Tensor::from_slice(&[3.0f32, 4.0]))
            .sum(Kind::Float)
            .backward();
        let total = clip_grad_norm_(&[p.shallow_clone()], 1.0, 2.0).unwrap();
        assert!((f64::try_from(&total).unwrap() - 5.0).abs() < 1e-6);
        let clipped: Vec<f32> = Vec::try_from(p.grad()).unwrap();
        assert!((clipped[0] - 0.6).abs() < 1e-5 && (clipped[1] - 0.8).abs() < 1e-5);
    }

    #[test]
    fn leaves_small_gradients_alone() {
        let p = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        (&p * Tensor::from_slice(&[0.3f32, 0.4]))
            .sum(Kind::Float)
            .backward();
        let _norm = clip_grad_norm_(&[p.shallow_clone()], 1.0, 2.0).unwrap();
        let g: Vec<f32> = Vec::try_from(p.grad()).unwrap();
        assert!((g[0] - 0.3).abs() < 1e-6 && (g[1] - 0.4).abs() < 1e-6);
    }

    #[test]
    fn a_norm_type_not_above_zero_is_refused_by_name() {
        let p = Tensor::ones([2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        p.sum(Kind::Float).backward();
        for bad in [0.0, -1.0, f64::NAN] {
            let e = clip_grad_norm_(&[p.shallow_clone()], 1.0, bad).unwrap_err();
            assert!(e.to_string().contains("norm_type"), "{e}");
        }
    }
}
