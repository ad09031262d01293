//! `DataParallel`: the data-parallel strategy a prepared model runs under (DDP or sharded), and its backward errors.

use super::join;
use super::sharded::Hybrid;
use crate::parallel::sharded::UnitShard;
use crate::parallel::{DdpOptions, FsdpSettings, GradientSync, Round, Unitwise};
use hearth_comm::{DistError, ProcessGroup};
use hearth_plugins::SearchPath;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use tch::{TchError, Tensor};

/// Why [`Accelerator::backward`](crate::accelerator::Accelerator::backward) failed.
#[derive(Debug, thiserror::Error)]
pub enum BackwardError {
    /// libtorch's backward pass failed.
    #[error(transparent)]
    Torch(#[from] TchError),
    /// The gradients could not be averaged across processes.
    #[error("averaging gradients across processes failed")]
    Sync(#[from] DistError),
    /// Unit-wise backward (recomputing the units; under FULL_SHARD their
    /// gathers and gradient reduce-scatters) failed.
    #[error(transparent)]
    Unitwise(#[from] crate::parallel::UnitwiseError),
    /// Parameters got no gradient on some process while DDP expects every
    /// parameter to take part in the loss.
    #[error("{} got no gradient in this backward pass on at least one of the {world} processes (reported by rank {rank}): DDP expects every parameter to take part in the loss; set DdpOptions::find_unused_parameters (Accelerate's DistributedDataParallelKwargs(find_unused_parameters=True); in a config, [distributed] find-unused-parameters = true), or make every parameter take part in the loss", names_list(.names))]
    UnusedParameters {
        /// The parameters.
        names: Vec<String>,
        /// This process.
        rank: usize,
        /// The number of processes.
        world: usize,
    },
    /// Something the step needs was left out of `prepare` (checked on the
    /// first synchronising backward pass).
    #[error("{problem}; {fix}. If leaving it out is deliberate, build the Accelerator with .check_prepared(false)")]
    Unprepared {
        /// What is left out, and what it breaks.
        problem: String,
        /// What to do.
        fix: String,
    },
}

pub(crate) fn names_list(names: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut text = names
        .iter()
        .take(SHOWN)
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        text += &format!(" and {} more", names.len() - SHOWN);
    }
    format!(
        "parameter{} {text}",
        if names.len() == 1 { "" } else { "s" }
    )
}

/// The gradient averaging of every prepared model, and whether it is on.
pub(crate) struct DataParallel {
    pub(crate) options: DdpOptions,
    pub(crate) fsdp: Option<FsdpSettings>,
    pub(super) plugin_path: SearchPath,
    pub(crate) models: RefCell<Vec<GradientSync>>,
    /// The units of every model sharded SHARD_GRAD_OP (handles), for the
    /// optimizers.
    pub(super) units: RefCell<Vec<UnitShard>>,
    /// The unit-wise execution of every model that runs so.
    pub(crate) unitwise: RefCell<Vec<Rc<Unitwise>>>,
    /// The HYBRID strategies' groups, made with the first model.
    pub(super) hybrid: std::cell::OnceCell<Hybrid>,
    /// Inside `no_sync`.
    pub(crate) no_sync: Cell<bool>,
    /// Inside `trigger_sync_in_backward`.
    pub(crate) forced: Cell<bool>,
    /// Inside `join_uneven_inputs` with joining on: each synchronising
    /// backward pass first tells joined processes it is coming, and
    /// buffers are not broadcast before forward passes.
    pub(crate) joining: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The buffers broadcast before every forward pass, for the final sync
    /// of a join.
    pub(crate) broadcast_buffers: RefCell<Vec<Tensor>>,
}

impl DataParallel {
    pub(crate) fn new(
        options: DdpOptions,
        fsdp: Option<FsdpSettings>,
        plugin_path: SearchPath,
    ) -> Self {
        Self {
            options,
            fsdp,
            plugin_path,
            models: RefCell::default(),
            units: RefCell::default(),
            unitwise: RefCell::default(),
            hybrid: std::cell::OnceCell::new(),
            no_sync: Cell::new(false),
            forced: Cell::new(false),
            joining: Default::default(),
            broadcast_buffers: RefCell::default(),
        }
    }

    /// Runs `f` with `flag` set, restoring it afterwards (even if `f` panics).
    pub(crate) fn while_set<R>(&self, flag: &Cell<bool>, f: impl FnOnce() -> R) -> R {
        struct Restore<'a>(&'a Cell<bool>, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.set(self.1);
            }
        }
        let _restore = Restore(flag, flag.replace(true));
        f()
    }

    /// Forgets every prepared model (`free_memory`): their gradients are
    /// no longer averaged or reduce-scattered.
    pub(crate) fn forget(&self) {
        self.models.borrow_mut().clear();
        self.broadcast_buffers.borrow_mut().clear();
        self.units.borrow_mut().clear();
        self.unitwise.borrow_mut().clear();
    }

    /// Makes every process start from rank 0's `parameters` and averages
    /// their gradients from now on; nothing in a world of one, nothing for
    /// parameters already registered (a model prepared twice).
    pub(crate) fn register(
        &self,
        group: &dyn ProcessGroup,
        parameters: Vec<(String, Tensor)>,
    ) -> Result<(), DistError> {
        if group.num_processes() == 1 || parameters.is_empty() {
            return Ok(());
        }
        let mut models = self.models.borrow_mut();
        let known = |p: &Tensor| {
            models
                .iter()
                .flat_map(|m| m.parameters().iter().chain(m.frozen()))
                .any(|q| q.data_ptr() == p.data_ptr())
        };
        if parameters.iter().all(|(_, p)| known(p)) {
            return Ok(());
        }
        let sync = GradientSync::new(group, parameters, self.options)?;
        // A model with every parameter frozen was broadcast; nothing to average.
        if !sync.parameters().is_empty() {
            models.push(sync);
        }
        Ok(())
    }

    /// Runs `backward` and averages the gradients of the prepared models,
    /// their buckets started as their gradients come in; outside a sync
    /// step (inside `no_sync`, not forced) only runs `backward`.
    pub(crate) fn backward(
        &self,
        group: &dyn ProcessGroup,
        backward: impl FnOnce() -> Result<(), TchError>,
    ) -> Result<(), BackwardError> {
        let group = self.shard_group(group);
        let unitwise = self.unitwise.borrow();
        // The loss's own backward, then the recomputation of the units of
        // models that ran unit by unit (whose gradients the round's hooks
        // see come in, as from one backward pass).
        let backward = || -> Result<(), BackwardError> {
            backward()?;
            for u in unitwise.iter() {
                u.backward()?;
            }
            Ok(())
        };
        let mut models = self.models.borrow_mut();
        if models.is_empty() || (self.no_sync.get() && !self.forced.get()) {
            return backward();
        }
        if self.joining.load(std::sync::atomic::Ordering::Relaxed) {
            // Processes that ran out of inputs learn a round is coming.
            join::any_active(group, true)?;
        }
        let mut round = Round::new(&mut models, group);
        round.during(backward)?;
        round.finish()?;
        let names: Vec<String> = models.iter_mut().flat_map(|m| m.take_unused()).collect();
        if !names.is_empty() {
            return Err(BackwardError::UnusedParameters {
                names,
                rank: group.process_index(),
                world: group.num_processes(),
            });
        }
        Ok(())
    }
}
