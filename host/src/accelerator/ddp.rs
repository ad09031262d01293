//! Data parallelism in the accelerator: prepared models start from rank 0's
//! parameters, and `backward` averages their gradients across processes,
//! overlapping the backward pass, unless inside `no_sync` (see
//! [`crate::dist::GradientSync`]).

use super::Accelerator;
use crate::dist::{DdpOptions, DistError, GradientSync, ProcessGroup, Round, SyncStats};
use std::cell::{Cell, RefCell};
use tch::{TchError, Tensor};

/// Why [`Accelerator::backward`] failed.
#[derive(Debug, thiserror::Error)]
pub enum BackwardError {
    /// libtorch's backward pass failed.
    #[error(transparent)]
    Torch(#[from] TchError),
    /// The gradients could not be averaged across processes.
    #[error("averaging gradients across processes failed")]
    Sync(#[from] DistError),
}

/// The gradient averaging of every prepared model, and whether it is on.
pub(super) struct DataParallel {
    options: DdpOptions,
    models: RefCell<Vec<GradientSync>>,
    /// Inside `no_sync`.
    pub(super) no_sync: Cell<bool>,
    /// Inside `trigger_sync_in_backward`.
    pub(super) forced: Cell<bool>,
}

impl DataParallel {
    pub(super) fn new(options: DdpOptions) -> Self {
        Self {
            options,
            models: RefCell::default(),
            no_sync: Cell::new(false),
            forced: Cell::new(false),
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

    /// Makes every process start from rank 0's `parameters` and averages
    /// their gradients from now on; nothing in a world of one, nothing for
    /// parameters already registered (a model prepared twice).
    pub(super) fn register(
        &self,
        group: &dyn ProcessGroup,
        parameters: Vec<Tensor>,
    ) -> Result<(), DistError> {
        if group.num_processes() == 1 || parameters.is_empty() {
            return Ok(());
        }
        let mut models = self.models.borrow_mut();
        let known = |p: &Tensor| {
            models
                .iter()
                .flat_map(|m| m.parameters())
                .any(|q| q.data_ptr() == p.data_ptr())
        };
        if parameters.iter().all(known) {
            return Ok(());
        }
        let sync = GradientSync::new(group, parameters, self.options)?;
        models.push(sync);
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
        let mut models = self.models.borrow_mut();
        if models.is_empty() || (self.no_sync.get() && !self.forced.get()) {
            return Ok(backward()?);
        }
        let mut round = Round::new(&mut models, group);
        round.during(backward)?;
        round.finish()?;
        Ok(())
    }
}

impl Accelerator {
    /// What gradient averaging across processes has done so far, over all
    /// prepared models (all zero in a world of one).
    pub fn gradient_sync_stats(&self) -> SyncStats {
        self.ddp
            .models
            .borrow()
            .iter()
            .map(GradientSync::stats)
            .fold(SyncStats::default(), |a, s| SyncStats {
                syncs: a.syncs.max(s.syncs),
                all_reduces: a.all_reduces + s.all_reduces,
                overlapped: a.overlapped + s.overlapped,
                bytes: a.bytes + s.bytes,
            })
    }

    /// Registers a prepared model's parameters for averaging.
    pub(super) fn register_for_sync(&self, parameters: Vec<Tensor>) -> Result<(), DistError> {
        self.ddp.register(self.process_group(), parameters)
    }
}
