//! What the accelerator asks of its data parallelism
//! ([`crate::parallel::data_parallel::DataParallel`]): the gradient
//! averaging statistics users read, and registering a prepared model's
//! parameters and buffers with it.

use super::Accelerator;
use crate::models::ModuleTree;
use crate::parallel::data_parallel::ModelSharding;
use crate::parallel::{ShardingError, SyncStats};
use tch::Tensor;

impl Accelerator {
    /// What gradient averaging across processes has done so far, over all
    /// prepared models (all zero in a world of one).
    pub fn gradient_sync_stats(&self) -> SyncStats {
        self.data_parallel.stats()
    }

    /// Makes every process hold rank 0's `buffers` of a model being
    /// prepared; returns what sends them again before each training
    /// forward pass, if anything does (see `DataParallel::register_buffers`).
    pub(super) fn register_buffers(
        &self,
        buffers: Vec<Tensor>,
    ) -> Result<Option<crate::parallel::BufferBroadcast>, super::PrepareError> {
        (self.data_parallel)
            .register_buffers(self.process_group(), buffers)
            .map_err(super::PrepareError::Dist)
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
        let result = self
            .data_parallel
            .check_not_held(&held, &parameters)
            .and_then(|()| {
                self.data_parallel.register_model(
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
