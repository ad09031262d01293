//! What the accelerator asks of its data parallelism
//! ([`crate::parallel::data_parallel::DataParallel`]): the gradient
//! averaging statistics users read, and registering a prepared model's
//! parameters and buffers with it.

use super::Accelerator;
use crate::models::ModuleTree;
use crate::parallel::data_parallel::ModelSharding;
use crate::parallel::{GradientSync, ShardingError, SyncStats};
use tch::Tensor;

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
                most_gathered_bytes: a.most_gathered_bytes.max(s.most_gathered_bytes),
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
    /// them when FSDP shards, `read` giving each unit its values first;
    /// returns how (see [`DataParallel::register_model`]).
    pub(super) fn register_for_sync(
        &self,
        tree: &ModuleTree,
        parameters: Vec<(String, Tensor)>,
        runs_units: bool,
        read: crate::parallel::ReadWeights<'_>,
    ) -> Result<ModelSharding, super::PrepareError> {
        let parameters_seen: Vec<(String, Tensor)> = parameters
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .collect();
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
                read,
            )
        });
        let sharding = result.map_err(|e| match e {
            ShardingError::Dist(e) => super::PrepareError::Dist(e),
            e => super::PrepareError::Sharding(e),
        })?;
        self.unprepared
            .note_model(&parameters_seen, !sharding.units.is_empty());
        Ok(sharding)
    }
}
