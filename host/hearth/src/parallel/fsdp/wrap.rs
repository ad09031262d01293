//! Which units a model is cut into for sharding: the configured
//! wrap-policy plugin, asked once per model, and the modules it names
//! turned into units (`hearth model plan` prints them); and why sharding a
//! model can fail.

use super::FsdpSettings;
use crate::models::ModuleTree;
use crate::parallel::sharded::{assign_except, UnitError};
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
    /// The model cannot be cut at its units (a TorchScript model whose
    /// forward pass does not split there): the message names the unit.
    #[error("{0}")]
    Cut(String),
    /// The model's weights could not be read (a lazily loaded model read
    /// unit by unit as it is sharded).
    #[error("{0}")]
    Weights(String),
    /// Another process could not plan the units, or planned others.
    #[error("the processes do not agree on the units {0}")]
    Disagree(String),
}

/// The module paths the configured policy wraps in `tree` (the root not
/// listed), from the plugin named by `settings` on `search`, under its
/// manifest's limits as `settings.policy_limits` raises them, refused
/// unless it hashes as `settings.policy_pin` says when that is set.
pub fn policy_units(
    tree: &ModuleTree,
    settings: &FsdpSettings,
    search: &SearchPath,
) -> Result<Vec<String>, ShardingError> {
    let registry = Registry::discover(search)?;
    let found = registry.find(&settings.auto_wrap_policy)?;
    let manifest = (found.manifest.with_limits(settings.policy_limits.as_ref()))
        .with_pin(settings.policy_pin.as_deref());
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
