//! What the user asks of sharding through the accelerator: what each
//! process holds (`summary.json`'s memory), the FSDP settings, and the
//! model's weights as one process would hold them.

use crate::parallel::FsdpSettings;

/// What this process holds for training, in bytes (`summary.json`'s
/// `memory`): measured from the tensors hearth holds, at the last
/// optimizer step (gradients before they were dropped).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryStats {
    /// Parameters of the prepared models (whole ones: DDP and SHARD_GRAD_OP
    /// keep them whole on every process; FULL_SHARD this process's shards,
    /// plus the whole parameters of any unit gathered at the moment).
    pub param_bytes: u64,
    /// Gradients the optimizers stepped from (this process's shards when
    /// sharded).
    pub grad_bytes: u64,
    /// Optimizer state (this process's shards when sharded).
    pub optimizer_bytes: u64,
}

impl super::Accelerator {
    /// What this process holds: parameters, gradients and optimizer
    /// state, in bytes (gradients and state as of the last optimizer step).
    pub fn memory_stats(&self) -> MemoryStats {
        let mut seen = std::collections::HashSet::new();
        // Parameters only: a model's buffers are remembered beside them.
        let param_bytes = self
            .registered
            .models
            .iter()
            .zip(&self.registered.buffers)
            .flat_map(|(state, buffers)| state.iter().filter(|(n, _)| !buffers.contains(n)))
            .filter(|(_, t)| seen.insert(t.data_ptr() as usize))
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum::<u64>()
            + self
                .data_parallel
                .full_shards()
                .iter()
                .filter_map(|u| u.full_shard().map(|f| f.shard_bytes()))
                .sum::<u64>();
        let (grad_bytes, optimizer_bytes) = self
            .optimizers
            .iter()
            .filter_map(|o| super::lock(o).held)
            .fold((0, 0), |(g, s), (g1, s1)| (g + g1, s + s1));
        MemoryStats {
            param_bytes,
            grad_bytes,
            optimizer_bytes,
        }
    }

    /// The parallelism this accelerator runs its prepared models under.
    pub fn strategy(&self) -> &crate::parallel::Strategy {
        self.data_parallel.strategy()
    }

    /// The FSDP settings this accelerator shards with, if any.
    pub fn fsdp_settings(&self) -> Option<&FsdpSettings> {
        self.data_parallel.fsdp()
    }

    /// True when `prepare` shards a model where it is before placing it on
    /// the device (FULL_SHARD, or cpu-offload on a GPU): each unit's shard
    /// is moved on its own, so the device never holds the whole model.
    pub(super) fn shards_before_placing(&self) -> bool {
        self.fsdp_settings().is_some_and(|f| {
            f.sharding_strategy.shards_parameters() || (f.cpu_offload && self.device().is_cuda())
        })
    }

    /// How this process builds a model's weights before `prepare`:
    /// unmaterialised under `cpu-ram-efficient-loading` on every process
    /// but the one `sync-module-states` broadcasts from (the first of the
    /// world, or of each machine under HYBRID), which alone builds them.
    pub fn model_weights(&self) -> crate::models::Weights {
        let receives = self.fsdp_settings().is_some_and(|f| {
            f.cpu_ram_efficient_loading
                && match f.sharding_strategy.hybrid() {
                    true => self.local_process_index() != 0,
                    false => self.process_index() != 0,
                }
        });
        match receives {
            true => crate::models::Weights::Unmaterialised,
            false => crate::models::Weights::Initialised,
        }
    }

    /// Where to build a model before `prepare`: the CPU when `prepare`
    /// shards it onto the GPU unit by unit (FULL_SHARD, cpu-offload; as
    /// Accelerate's FSDP models are built on the CPU), else the device.
    pub fn model_init_device(&self) -> tch::Device {
        match self.shards_before_placing() {
            true => tch::Device::Cpu,
            false => self.device(),
        }
    }
}
