//! The gradient rounds of `join_uneven_inputs` (see
//! [`Accelerator::join_uneven_inputs`](crate::accelerator::Accelerator::join_uneven_inputs)):
//! a process out of inputs shadows the others' rounds, then every process
//! takes the last one's parameters and buffers.

use super::DataParallel;
use crate::parallel::Round;
use hearth_comm::{DistError, ProcessGroup, ReduceOp};
use tch::Tensor;

impl DataParallel {
    /// True when some prepared model is sharded (sharded models do not
    /// join: PyTorch's FSDP is not joinable either).
    pub(crate) fn shards(&self) -> bool {
        self.models.borrow().iter().any(|m| !m.units().is_empty())
            || !self.unitwise.borrow().is_empty()
    }

    /// This process has run out of inputs inside `join_uneven_inputs`:
    /// until every process has, it takes part in each gradient round the
    /// others run (with zero gradients); then every process takes the
    /// parameters and buffers of the last process to join (the highest
    /// rank among the last), as PyTorch's `Join` with DDP does.
    pub(crate) fn join(&self, group: &dyn ProcessGroup) -> Result<(), DistError> {
        let mut last = true;
        while any_active(group, false)? {
            last = false;
            Round::shadow(&mut self.models.borrow_mut(), group)?;
        }
        let mut root = Tensor::from_slice(&[if last {
            group.process_index() as f64 + 1.0
        } else {
            0.0
        }]);
        group.all_reduce(&mut root, ReduceOp::Max)?;
        let root = root.double_value(&[0]) as usize - 1;
        for model in self.models.borrow().iter() {
            model.take_parameters_from(group, root)?;
        }
        tch::no_grad(|| {
            (self.broadcast_buffers.borrow().iter())
                .try_for_each(|b| group.broadcast(&mut b.shallow_clone(), root))
        })
    }
}

/// Whether some process is still training inside `join_uneven_inputs`:
/// every process all-reduces whether it is (`active`), the joined ones
/// to learn whether another gradient round is coming.
pub(crate) fn any_active(group: &dyn ProcessGroup, active: bool) -> Result<bool, DistError> {
    let mut flag = Tensor::from_slice(&[f32::from(u8::from(active))]);
    group.all_reduce(&mut flag, ReduceOp::Max)?;
    Ok(flag.double_value(&[0]) > 0.0)
}
