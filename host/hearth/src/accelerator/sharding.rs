//! Sharding in the accelerator: which units a prepared model is cut into
//! (the configured wrap-policy plugin, asked once per model), and what
//! each process then holds (`hearth model plan`, `summary.json`'s memory).

use crate::models::ModuleTree;
use crate::parallel::sharded::{assign_except, UnitError};
use crate::parallel::FsdpSettings;
use hearth_plugins::{load_wrap_policy, PluginError, PolicyModule, Registry, SearchPath};

/// Why a model could not be sharded.
#[derive(Debug, thiserror::Error)]
pub enum ShardingError {
    /// The wrap policy could not be found, loaded or asked.
    #[error("the FSDP wrap policy failed")]
    Policy(#[from] PluginError),
    /// The units or ignored modules do not fit the model.
    #[error(transparent)]
    Units(#[from] UnitError),
    /// The processes could not set the sharding up.
    #[error("setting up sharding across processes failed")]
    Dist(#[from] hearth_comm::DistError),
    /// The optimizer cannot step shards.
    #[error("the optimizer cannot be sharded: {0}")]
    Optimizer(String),
    /// The model cannot run unit by unit, or gathering its units failed.
    #[error("{0}")]
    Unitwise(String),
    /// Another process could not plan the units, or planned others.
    #[error("the processes do not agree on the units {0}")]
    Disagree(String),
}

/// The module paths the configured policy wraps in `tree` (the root not
/// listed), from the plugin named by `settings` on `search`, under its
/// manifest's limits as `settings.policy_limits` raises them.
pub fn policy_units(
    tree: &ModuleTree,
    settings: &FsdpSettings,
    search: &SearchPath,
) -> Result<Vec<String>, ShardingError> {
    let registry = Registry::discover(search)?;
    let found = registry.find(&settings.auto_wrap_policy)?;
    let manifest = found.manifest.with_limits(settings.policy_limits.as_ref());
    let policy = load_wrap_policy(&manifest)?;
    let modules = policy_modules(tree);
    let mut units = policy.units(&settings.policy_options.to_string(), &modules)?;
    units.retain(|p| !p.is_empty());
    Ok(units)
}

/// The modules of `tree` as a wrap policy is shown them.
pub fn policy_modules(tree: &ModuleTree) -> Vec<PolicyModule> {
    tree.modules()
        .iter()
        .map(|m| PolicyModule {
            path: m.path.clone(),
            kind: m.kind.clone(),
            params: m.num_params,
            own_params: m.own_params,
            param_bytes: m.param_bytes,
            buffer_bytes: m.buffer_bytes,
            parent: m.parent,
        })
        .collect()
}

/// The units of `tree` under `settings` — each unit's path (the root `""`
/// first) and the names of the parameters it shards — leaving out ignored
/// modules and units that hold nothing.
pub fn plan_units(
    tree: &ModuleTree,
    settings: &FsdpSettings,
    search: &SearchPath,
) -> Result<Vec<(String, Vec<String>)>, ShardingError> {
    let paths = policy_units(tree, settings, search)?;
    let mut units = assign_except(tree, &paths, &settings.ignored_modules)?;
    units.retain(|(path, names)| path.is_empty() || !names.is_empty());
    Ok(units)
}

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
        let param_bytes = self
            .registered
            .models
            .iter()
            .flatten()
            .filter(|(_, t)| seen.insert(t.data_ptr() as usize))
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum::<u64>()
            + self
                .ddp
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

    /// The FSDP settings this accelerator shards with, if any.
    pub fn fsdp_settings(&self) -> Option<&FsdpSettings> {
        self.ddp.fsdp.as_ref()
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
