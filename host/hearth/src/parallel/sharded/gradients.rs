//! Reduce-scattering a unit's gradients and writing each process's shard of them.

use super::UnitShard;
use hearth_comm::{DistError, Pending, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

/// Starts the reduce-scatter of `unit`'s gradients, in `reduce` when given
/// (a mixed-precision policy's reduce dtype), else in the parameters'
/// kind; returns it, the kind and the bytes this process sends. A unit
/// whose parameters are all frozen has nothing to send: `None`.
pub(in crate::parallel) fn start<'g>(
    group: &'g dyn ProcessGroup,
    unit: &UnitShard,
    reduce: Option<Kind>,
) -> Result<Option<(Pending<'g>, Kind, u64)>, DistError> {
    if let Some(p) = unit
        .params
        .iter()
        .find(|p| p.grad_offset.is_none() && p.full.grad().defined())
    {
        return Err(DistError::Mismatch {
            op: "gradient reduce-scatter",
            rank: group.process_index(),
            message: format!(
                "parameter `{}` required no gradient when the model was sharded, so it is \
                 not reduce-scattered nor stepped, and it has one now: prepare the model \
                 after unfreezing it",
                p.name
            ),
        });
    }
    if !unit.trains() {
        return Ok(None);
    }
    // The trainable parameters' kind (a frozen bf16 base beside float32
    // LoRA tensors reduces them in float32).
    let first = unit.trainable().next().expect("a unit that trains");
    let kind = reduce.unwrap_or(first.full.kind());
    let world = group.num_processes();
    let flat = tch::no_grad(|| unit.pack_gradients(world, kind));
    // The whole gradients are in the packed copy: drop them now, so that
    // at most the units in flight hold whole gradients (ZeRO-2's saving).
    let full: Vec<Tensor> = unit.params.iter().map(|p| p.full.shallow_clone()).collect();
    hearth_ops::clear_grads(&full).map_err(|e| DistError::Mismatch {
        op: "gradient reduce-scatter",
        rank: group.process_index(),
        message: e.to_string(),
    })?;
    let bytes = (flat.numel() * kind.elt_size_in_bytes()) as u64;
    Ok(Some((
        group.reduce_scatter_start(&flat, ReduceOp::Mean)?,
        kind,
        bytes,
    )))
}

/// Adds to each parameter shard of `unit` its rows of `reduced` (this
/// process's part of the mean gradients) as its gradient; a parameter no
/// process had a gradient for keeps none (as DDP's).
pub(in crate::parallel) fn write_gradient_shard(
    group: &dyn ProcessGroup,
    unit: &UnitShard,
    reduced: &Tensor,
) -> Result<(), DistError> {
    let fail = |e: tch::TchError| DistError::Mismatch {
        op: "gradient reduce-scatter",
        rank: group.process_index(),
        message: e.to_string(),
    };
    let had = unit.had_gradients(reduced);
    // Offloaded shards take their gradients in (pinned) host memory.
    let host;
    let reduced = match unit.offloaded() {
        true => {
            host = hearth_ops::to_pinned_host(reduced).map_err(fail)?;
            &host
        }
        false => reduced,
    };
    for ((p, g), had) in unit.gradient_shards(reduced).zip(had) {
        if !had {
            continue;
        }
        // Reduced in a policy's reduce dtype, stepped in the shards' own.
        let g = g.to_kind(p.shard.kind());
        let mut existing = p.shard.grad();
        if existing.defined() {
            // A second synced backward before zero_grad adds up, as DDP's.
            let _ = tch::no_grad(|| existing.f_add_(&g)).map_err(fail)?;
        } else {
            hearth_ops::set_grad(&p.shard, &g).map_err(fail)?;
        }
    }
    Ok(())
}
