//! Data parallelism in the accelerator: prepared models start from rank 0's
//! parameters, and `backward` averages their gradients across processes,
//! overlapping the backward pass, unless inside `no_sync` (see
//! [`crate::parallel::GradientSync`]). With FSDP's SHARD_GRAD_OP a model's
//! gradients are reduce-scattered unit by unit instead, and an optimizer
//! prepared after it steps only this process's shards. With FULL_SHARD or
//! activation checkpointing a model runs unit by unit
//! ([`crate::parallel::Unitwise`]), and `backward` recomputes its units.
//!
//! The sharded side (FSDP: registering a model's units, HYBRID groups,
//! whole parameters on demand, optimizers over shards) is in `sharded`.

use super::sharding::ShardingError;
use super::Accelerator;
use crate::models::ModuleTree;
use crate::parallel::sharded::UnitShard;
use crate::parallel::{DdpOptions, FsdpSettings, GradientSync, Round, SyncStats, Unitwise};
use hearth_comm::{DistError, ProcessGroup};
use hearth_plugins::SearchPath;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use tch::{TchError, Tensor};

mod join;
mod sharded;

use sharded::Hybrid;
pub(super) use sharded::{ModelSharding, Summoned};

/// Why [`Accelerator::backward`] failed.
#[derive(Debug, thiserror::Error)]
pub enum BackwardError {
    /// libtorch's backward pass failed.
    #[error(transparent)]
    Torch(#[from] TchError),
    /// The gradients could not be averaged across processes.
    #[error("averaging gradients across processes failed")]
    Sync(#[from] DistError),
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
}

fn names_list(names: &[String]) -> String {
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
pub(super) struct DataParallel {
    options: DdpOptions,
    pub(super) fsdp: Option<FsdpSettings>,
    plugin_path: SearchPath,
    pub(super) models: RefCell<Vec<GradientSync>>,
    /// The units of every model sharded SHARD_GRAD_OP (handles), for the
    /// optimizers.
    units: RefCell<Vec<UnitShard>>,
    /// The unit-wise execution of every model that runs so.
    pub(super) unitwise: RefCell<Vec<Rc<Unitwise>>>,
    /// The HYBRID strategies' groups, made with the first model.
    hybrid: std::cell::OnceCell<Hybrid>,
    /// Inside `no_sync`.
    pub(super) no_sync: Cell<bool>,
    /// Inside `trigger_sync_in_backward`.
    pub(super) forced: Cell<bool>,
    /// Inside `join_uneven_inputs` with joining on: each synchronising
    /// backward pass first tells joined processes it is coming, and
    /// buffers are not broadcast before forward passes.
    pub(super) joining: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The buffers broadcast before every forward pass, for the final sync
    /// of a join.
    pub(super) broadcast_buffers: RefCell<Vec<Tensor>>,
}

impl DataParallel {
    pub(super) fn new(
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
    pub(super) fn while_set<R>(&self, flag: &Cell<bool>, f: impl FnOnce() -> R) -> R {
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
    pub(super) fn forget(&self) {
        self.models.borrow_mut().clear();
        self.broadcast_buffers.borrow_mut().clear();
        self.units.borrow_mut().clear();
        self.unitwise.borrow_mut().clear();
    }

    /// Makes every process start from rank 0's `parameters` and averages
    /// their gradients from now on; nothing in a world of one, nothing for
    /// parameters already registered (a model prepared twice).
    pub(super) fn register(
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
    pub(super) fn backward(
        &self,
        group: &dyn ProcessGroup,
        backward: impl FnOnce() -> Result<(), TchError>,
    ) -> Result<(), BackwardError> {
        let group = self.shard_group(group);
        let unitwise = self.unitwise.borrow();
        // The loss's own backward, then the recomputation of the units of
        // models that ran unit by unit (whose gradients the round's hooks
        // see come in, as from one backward pass).
        let backward = || -> Result<(), TchError> {
            backward()?;
            for u in unitwise.iter() {
                u.backward()
                    .map_err(|e| TchError::Torch(hearth_ops::error_chain(&e)))?;
            }
            Ok(())
        };
        let mut models = self.models.borrow_mut();
        if models.is_empty() || (self.no_sync.get() && !self.forced.get()) {
            return Ok(backward()?);
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

impl Accelerator {
    /// What gradient averaging across processes has done so far, over all
    /// prepared models (all zero in a world of one).
    pub fn gradient_sync_stats(&self) -> SyncStats {
        let unitwise: Vec<SyncStats> = self
            .ddp
            .unitwise
            .borrow()
            .iter()
            .map(|u| u.stats())
            .collect();
        self.ddp
            .models
            .borrow()
            .iter()
            .map(GradientSync::stats)
            .chain(unitwise)
            .fold(SyncStats::default(), |a, s| SyncStats {
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
            })
    }

    /// Makes every process hold rank 0's `buffers` of a model being
    /// prepared (as DDP does, and FSDP with `sync_module_states`); returns
    /// what sends them again before each training forward pass under DDP
    /// with `broadcast_buffers`.
    pub(super) fn register_buffers(
        &self,
        buffers: Vec<Tensor>,
    ) -> Result<Option<crate::parallel::BufferBroadcast>, super::PrepareError> {
        let group = self.process_group();
        if group.num_processes() == 1 || buffers.is_empty() {
            return Ok(None);
        }
        let (once, every_forward) = match &self.ddp.fsdp {
            Some(fsdp) => (fsdp.sync_module_states, false),
            None => (true, self.ddp.options.broadcast_buffers),
        };
        if !once {
            return Ok(None);
        }
        if !every_forward {
            let broadcast = |b: &Tensor| group.broadcast(&mut b.shallow_clone(), 0);
            tch::no_grad(|| buffers.iter().try_for_each(broadcast))
                .map_err(super::PrepareError::Dist)?;
            return Ok(None);
        }
        (self.ddp.broadcast_buffers.borrow_mut()).extend(buffers.iter().map(Tensor::shallow_clone));
        let sync = crate::parallel::BufferBroadcast::new(group, buffers, self.ddp.joining.clone())
            .map_err(super::PrepareError::Dist)?;
        Ok(Some(sync))
    }

    /// Registers a prepared model's parameters for averaging, or shards
    /// them when FSDP shards; returns how (see
    /// [`DataParallel::register_model`]).
    pub(super) fn register_for_sync(
        &self,
        tree: &ModuleTree,
        parameters: Vec<(String, Tensor)>,
        runs_units: bool,
    ) -> Result<ModelSharding, super::PrepareError> {
        let held: Vec<Tensor> = self
            .optimizers
            .iter()
            .flat_map(|o| super::lock(o).inner.parameters())
            .collect();
        let result = self.ddp.check_not_held(&held, &parameters).and_then(|()| {
            self.ddp.register_model(
                self.process_group(),
                tree,
                parameters,
                runs_units,
                self.device(),
            )
        });
        result.map_err(|e| match e {
            ShardingError::Dist(e) => super::PrepareError::Dist(e),
            e => super::PrepareError::Sharding(e),
        })
    }
}
