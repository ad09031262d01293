//! `DataParallel`: the data-parallel strategy a prepared model runs under (DDP or sharded), and its backward errors.

use super::join;
use super::sharded::Hybrid;
use crate::parallel::sharded::UnitShard;
use crate::parallel::{FsdpSettings, GradientSync, Round, Strategy, Unitwise};
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
/// Its fields are visible inside `parallel/` only (the compiler checks
/// it): the accelerator goes through its methods.
pub(crate) struct DataParallel {
    /// The run's parallelism: DDP's options and FSDP's settings.
    pub(in crate::parallel) strategy: Strategy,
    pub(super) plugin_path: SearchPath,
    pub(in crate::parallel) models: RefCell<Vec<GradientSync>>,
    /// The units of every model sharded SHARD_GRAD_OP (handles), for the
    /// optimizers.
    pub(super) units: RefCell<Vec<UnitShard>>,
    /// The unit-wise execution of every model that runs so.
    pub(in crate::parallel) unitwise: RefCell<Vec<Rc<Unitwise>>>,
    /// The HYBRID strategies' groups, made with the first model.
    pub(super) hybrid: std::cell::OnceCell<Hybrid>,
    /// Inside `no_sync`.
    pub(in crate::parallel) no_sync: Cell<bool>,
    /// Inside `trigger_sync_in_backward`.
    pub(in crate::parallel) forced: Cell<bool>,
    /// Inside `join_uneven_inputs` with joining on: each synchronising
    /// backward pass first tells joined processes it is coming, and
    /// buffers are not broadcast before forward passes.
    pub(in crate::parallel) joining: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The buffers broadcast before every forward pass, for the final sync
    /// of a join.
    pub(in crate::parallel) broadcast_buffers: RefCell<Vec<Tensor>>,
}

impl DataParallel {
    pub(crate) fn new(strategy: Strategy, plugin_path: SearchPath) -> Self {
        Self {
            strategy,
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

    /// The FSDP settings models are sharded with; `None` under DDP.
    pub(crate) fn fsdp(&self) -> Option<&FsdpSettings> {
        self.strategy.fsdp.as_ref()
    }

    /// The run's parallelism.
    pub(crate) fn strategy(&self) -> &Strategy {
        &self.strategy
    }

    /// Runs `f` without averaging gradients in its backward passes
    /// (DDP's `no_sync`).
    pub(crate) fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        self.while_set(&self.no_sync, f)
    }

    /// Runs `f` with gradient averaging on even inside `no_sync`
    /// (Accelerate's `trigger_sync_in_backward`).
    pub(crate) fn forced_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        self.while_set(&self.forced, f)
    }

    /// Turns joining (`join_uneven_inputs`) on or off; returns what it was.
    pub(crate) fn set_joining(&self, on: bool) -> bool {
        self.joining.swap(on, std::sync::atomic::Ordering::Relaxed)
    }

    /// What gradient averaging has done so far, over every prepared model.
    pub(crate) fn stats(&self) -> crate::parallel::SyncStats {
        let unitwise: Vec<_> = self.unitwise.borrow().iter().map(|u| u.stats()).collect();
        let models: Vec<_> = self
            .models
            .borrow()
            .iter()
            .map(GradientSync::stats)
            .collect();
        models
            .into_iter()
            .chain(unitwise)
            .fold(Default::default(), |a, s| crate::parallel::SyncStats {
                syncs: a.syncs.max(s.syncs),
                all_reduces: a.all_reduces + s.all_reduces,
                reduce_scatters: a.reduce_scatters + s.reduce_scatters,
                overlapped: a.overlapped + s.overlapped,
                bytes: a.bytes + s.bytes,
                gathers: a.gathers + s.gathers,
                gather_bytes: a.gather_bytes + s.gather_bytes,
                prefetched: a.prefetched + s.prefetched,
                recomputed: a.recomputed + s.recomputed,
                most_gathered: a.most_gathered.max(s.most_gathered),
                most_gathered_bytes: a.most_gathered_bytes.max(s.most_gathered_bytes),
            })
    }

    /// Makes every process hold rank 0's `buffers` of a model being
    /// prepared (as DDP does, and FSDP with `sync_module_states`); returns
    /// what sends them again before each training forward pass under DDP
    /// with `broadcast_buffers`.
    pub(crate) fn register_buffers(
        &self,
        group: &dyn ProcessGroup,
        buffers: Vec<Tensor>,
    ) -> Result<Option<crate::parallel::BufferBroadcast>, DistError> {
        if group.num_processes() == 1 || buffers.is_empty() {
            return Ok(None);
        }
        let (once, every_forward) = match &self.strategy.fsdp {
            Some(fsdp) => (fsdp.sync_module_states, false),
            None => (true, self.strategy.ddp.broadcast_buffers),
        };
        if !once {
            return Ok(None);
        }
        if !every_forward {
            let broadcast = |b: &Tensor| group.broadcast(&mut b.shallow_clone(), 0);
            return tch::no_grad(|| buffers.iter().try_for_each(broadcast)).map(|()| None);
        }
        (self.broadcast_buffers.borrow_mut()).extend(buffers.iter().map(Tensor::shallow_clone));
        crate::parallel::BufferBroadcast::new(group, buffers, self.joining.clone()).map(Some)
    }

    /// Forgets the unit-wise execution of a model being unwrapped.
    pub(crate) fn forget_unitwise(&self, unitwise: &Rc<Unitwise>) {
        self.unitwise
            .borrow_mut()
            .retain(|u| !Rc::ptr_eq(u, unitwise));
    }

    /// Runs `f` with `flag` set, restoring it afterwards (even if `f` panics).
    fn while_set<R>(&self, flag: &Cell<bool>, f: impl FnOnce() -> R) -> R {
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
        let sync = GradientSync::new(group, parameters, self.strategy.ddp)?;
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
