//! `hearth model plan`: the module tree of a config's model, the units its
//! wrap policy picks, and what each of N processes would hold.

use super::config::{OptimizerKind, TrainConfig};
use super::error::TrainError;
use super::setup;
use super::RunOptions;
use crate::parallel::{FsdpSettings, ShardingStrategy};
use serde::Serialize;
use tch::Tensor;

/// One module, as the plan lists it.
#[derive(Debug, Clone, Serialize)]
pub struct PlannedModule {
    /// Dotted path (`""` is the root).
    pub path: String,
    /// Class, as PyTorch names it.
    pub class: String,
    /// Parameters of the module and everything below it.
    pub params: u64,
    /// Bytes of its parameters and buffers, and everything below it.
    pub bytes: u64,
}

/// Bytes one process holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PerProcess {
    /// Parameters.
    pub param_bytes: u64,
    /// Gradients (between backward and the optimizer step).
    pub grad_bytes: u64,
    /// Optimizer state.
    pub optimizer_bytes: u64,
}

/// A model's sharding plan.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Every module, parents before children.
    pub modules: Vec<PlannedModule>,
    /// The units (`""` is the root), in the model's order.
    pub units: Vec<String>,
    /// What the process holding the most (rank 0) holds.
    pub per_process: PerProcess,
    /// FULL_SHARD: the most parameter bytes held whole at once during a
    /// step — the root unit (kept whole from forward to backward) and the
    /// largest other unit (the one at work), or every unit with
    /// `reshard-after-forward = false`; what a run's
    /// `gradient_sync.most_gathered_bytes` measures. 0 for the strategies
    /// that keep every parameter whole.
    pub whole_bytes: u64,
    /// The strategy (`DDP` without `[fsdp]`).
    pub strategy: String,
    /// The wrap policy (`none` without `[fsdp]`).
    pub policy: String,
    /// The number of processes planned for.
    pub processes: usize,
}

/// State tensors of one parameter's shard of `bytes` bytes under the config's
/// optimizer: what hearth's optimizers create on their first step.
fn optimizer_bytes(config: &TrainConfig, bytes: u64) -> u64 {
    match config.optimizer.kind {
        // exp_avg and exp_avg_sq like the parameter, and a float32 step.
        OptimizerKind::Adamw | OptimizerKind::Adam => 2 * bytes + 4,
        OptimizerKind::Sgd if config.optimizer.momentum.unwrap_or(0.0) != 0.0 => bytes,
        OptimizerKind::Sgd => 0,
    }
}

/// [`Plan::whole_bytes`] of `units` (the root first) over `params`.
fn whole_bytes(
    units: &[(String, Vec<String>)],
    params: &[(String, Tensor)],
    settings: &FsdpSettings,
) -> u64 {
    let by_name: std::collections::HashMap<&str, &Tensor> =
        params.iter().map(|(n, p)| (n.as_str(), p)).collect();
    let bytes = |names: &Vec<String>| -> u64 {
        names
            .iter()
            .filter_map(|n| by_name.get(n.as_str()))
            .map(|p| {
                let kind = settings
                    .mixed_precision_policy
                    .map_or(p.kind(), |policy| policy.param_dtype.kind());
                p.numel() as u64 * kind.elt_size_in_bytes() as u64
            })
            .sum()
    };
    let sizes: Vec<u64> = units.iter().map(|(_, names)| bytes(names)).collect();
    match settings.reshard_after_forward {
        false => sizes.iter().sum(),
        true => {
            sizes.first().copied().unwrap_or(0) + sizes.iter().skip(1).max().copied().unwrap_or(0)
        }
    }
}

/// `config`'s model on the CPU, its weights allocated and never written
/// (a plan reads only names, shapes and dtypes).
fn unwritten_model(config: &TrainConfig) -> Result<Box<dyn crate::models::Model>, TrainError> {
    let data = setup::dataset(config, None)?;
    tch::no_grad(|| {
        setup::model(
            config,
            data.as_ref(),
            tch::Device::Cpu,
            crate::models::Weights::Unmaterialised,
        )
    })
}

/// The module tree of `config`'s model, built without writing its weights.
pub fn module_tree(config: &TrainConfig) -> Result<crate::models::ModuleTree, TrainError> {
    Ok(unwritten_model(config)?.module_tree().clone())
}

/// The plan of `config`'s model on `processes` processes.
pub fn plan(
    config: &TrainConfig,
    options: &RunOptions,
    processes: usize,
) -> Result<Plan, TrainError> {
    let model = unwritten_model(config)?;
    let tree = model.module_tree();
    let params: Vec<(String, Tensor)> = model.named_parameters();
    let settings: Option<FsdpSettings> = config.fsdp_settings().cloned();
    let search = setup::search_path(config, options);
    let units: Vec<(String, Vec<String>)> = match &settings {
        Some(s) => crate::accelerator::plan_units(tree, s, &search)
            .map_err(|e| TrainError::Prepare(crate::accelerator::PrepareError::Sharding(e)))?,
        None => vec![(
            String::new(),
            params.iter().map(|(n, _)| n.clone()).collect(),
        )],
    };
    let strategy = settings.as_ref().map(|s| s.sharding_strategy);
    // The HYBRID strategies are planned as on one machine (N processes
    // sharing the shards).
    let shards = strategy.is_some_and(ShardingStrategy::shards);
    // FULL_SHARD holds only its shards of the parameters between steps.
    let shards_params = strategy.is_some_and(ShardingStrategy::shards_parameters);
    let sharded: std::collections::HashSet<&str> = units
        .iter()
        .flat_map(|(_, names)| names.iter().map(String::as_str))
        .collect();
    let mut per = PerProcess::default();
    for (name, p) in &params {
        let element = p.kind().elt_size_in_bytes() as u64;
        let full = p.numel() as u64 * element;
        let held = if shards && sharded.contains(name.as_str()) {
            // Rank 0's rows: FSDP2's ceil(d0 / N)-row chunks.
            let size = p.size();
            let rows = size.first().copied().unwrap_or(1) as u64;
            let row: u64 = size.iter().skip(1).map(|&d| d as u64).product();
            let chunk = rows.div_ceil(processes as u64);
            chunk.min(rows) * row * element
        } else {
            full
        };
        per.param_bytes += if shards_params { held } else { full };
        if p.requires_grad() {
            per.grad_bytes += held;
            per.optimizer_bytes += optimizer_bytes(config, held);
        }
    }
    let whole_bytes = match (&settings, shards_params) {
        (Some(s), true) => whole_bytes(&units, &params, s),
        _ => 0,
    };
    Ok(Plan {
        whole_bytes,
        modules: tree
            .modules()
            .iter()
            .map(|m| PlannedModule {
                path: m.path.clone(),
                class: m.kind.clone(),
                params: m.num_params,
                bytes: m.param_bytes + m.buffer_bytes,
            })
            .collect(),
        units: units.into_iter().map(|(path, _)| path).collect(),
        per_process: per,
        strategy: settings
            .as_ref()
            .map_or("DDP".into(), |s| s.sharding_strategy.as_str().into()),
        policy: settings.map_or("none".into(), |s| s.auto_wrap_policy),
        processes,
    })
}
