//! What unit-wise execution holds for one prepared model: which shard
//! units each model unit needs, what each forward pass kept for its
//! backward, the counts, and why it fails.

use super::FullShard;
use crate::models::Model;
use crate::parallel::SyncStats;
use hearth_comm::DistError;
use std::cell::{Cell, RefCell};
use std::rc::Weak;
use tch::{Device, Kind, Tensor};

/// What one forward pass kept for its backward.
pub(super) struct Tape {
    pub(super) model: Weak<dyn Model>,
    /// Each model unit's inputs (one tensor, or several for a model whose
    /// units pass on more: [`crate::models::Unit::forward_all`]); the
    /// leaves its graph starts from when the graph was kept.
    pub(super) inputs: Vec<Vec<Tensor>>,
    /// Each model unit's outputs, their graphs kept (empty when backward
    /// recomputes the units).
    pub(super) outputs: Vec<Vec<Tensor>>,
    /// The generator's state before each model unit ran.
    pub(super) rng: Vec<Tensor>,
    /// What forward returned: a leaf whose gradient backward starts from.
    pub(super) output: Tensor,
    pub(super) train: bool,
    pub(super) autocast: Option<(Device, Kind)>,
}

/// Which shard units each model unit needs, and the first and last model
/// unit needing each shard unit.
pub(super) struct Uses {
    pub(super) per_unit: Vec<Vec<usize>>,
    pub(super) first: Vec<Option<usize>>,
    pub(super) last: Vec<Option<usize>>,
}

/// Unit-wise execution of one prepared model.
pub struct Unitwise {
    pub(super) full_shard: Option<FullShard>,
    /// Backward recomputes each unit (activation checkpointing); else
    /// forward keeps each unit's graph, FULL_SHARD freeing the memory of
    /// its whole parameters in between (FSDP without checkpointing).
    pub(super) recompute: bool,
    pub(super) uses: RefCell<Option<Uses>>,
    pub(super) tapes: RefCell<Vec<Tape>>,
    pub(super) stats: Cell<SyncStats>,
}

/// Why unit-wise execution failed (the model's forward cannot return an
/// error, so forward panics with it; backward returns it).
#[derive(Debug, thiserror::Error)]
pub enum UnitwiseError {
    /// A collective failed.
    #[error("FULL_SHARD: {op} of unit `{unit}` failed")]
    Dist {
        /// What was being done.
        op: &'static str,
        /// The shard unit's path.
        unit: String,
        /// The failure.
        #[source]
        source: DistError,
    },
    /// libtorch failed running a unit or its backward. Its message is part of this
    /// one (not a `source`), so that a check of the text, such as
    /// [`crate::accelerator::is_out_of_memory`] in
    /// `find_executable_batch_size`, sees an out-of-memory error.
    #[error("model unit {unit} failed: {error}")]
    Torch {
        /// The model unit's index.
        unit: usize,
        /// The failure.
        error: tch::TchError,
    },
}

/// Whether autograd records operations now (read by setting it and
/// putting it back: libtorch has no getter that tch exposes).
pub(super) fn grad_enabled() -> bool {
    // SAFETY: plain calls on libtorch's thread-local grad mode, restored at once.
    unsafe {
        let previous = torch_sys::at_grad_set_enabled(0);
        torch_sys::at_grad_set_enabled(previous);
        previous != 0
    }
}

/// Backward through a unit from its outputs, each with the gradient it
/// got (those that need none, or got none, left out): the unit's inputs
/// and parameters get the gradients one backward pass through the whole
/// model would give them.
pub(super) fn backward_from(outputs: &[Tensor], grads: &[Tensor]) -> Result<(), tch::TchError> {
    let (outputs, grads): (Vec<Tensor>, Vec<Tensor>) = outputs
        .iter()
        .zip(grads)
        .filter(|(out, grad)| out.requires_grad() && grad.defined())
        .map(|(out, grad)| (out.shallow_clone(), grad.shallow_clone()))
        .unzip();
    match outputs.is_empty() {
        true => Ok(()),
        false => hearth_ops::backward(&outputs, &grads),
    }
}

/// A unit's inputs as the leaves its graph starts from: the floating-point
/// ones detached, requiring gradients (their gradients are the previous
/// unit's output gradients), the others as they are.
pub(super) fn leaves(inputs: &[Tensor]) -> Vec<Tensor> {
    inputs
        .iter()
        .map(|input| match input.is_floating_point() {
            true => input.detach().set_requires_grad(true),
            false => input.shallow_clone(),
        })
        .collect()
}

/// Whether parameter `name` belongs to one of `modules`.
pub(super) fn under(name: &str, modules: &[&str]) -> bool {
    modules.iter().any(|m| crate::models::under(name, m))
}

impl Unitwise {
    /// Unit-wise execution, sharded with `full_shard` or (activation
    /// checkpointing alone) with whole parameters; backward recomputes the
    /// units when `recompute`, else uses the graphs forward kept (which
    /// needs `full_shard`: without it nothing is gained).
    pub fn new(full_shard: Option<FullShard>, recompute: bool) -> Self {
        Self {
            recompute: recompute || full_shard.is_none(),
            full_shard,
            uses: RefCell::default(),
            tapes: RefCell::default(),
            stats: Cell::default(),
        }
    }

    /// The FULL_SHARD part, if sharded.
    pub fn full_shard(&self) -> Option<&FullShard> {
        self.full_shard.as_ref()
    }

    /// Reduce-scatters, gathers and recomputations done so far.
    pub fn stats(&self) -> SyncStats {
        self.stats.get()
    }

    pub(super) fn count(&self, f: impl FnOnce(&mut SyncStats)) {
        let mut stats = self.stats.get();
        f(&mut stats);
        self.stats.set(stats);
    }
}
