//! FSDP's configuration: [`FsdpPlugin`] (Accelerate's
//! `FullyShardedDataParallelPlugin`, from code, `HEARTH_FSDP_*` or `[fsdp]`)
//! and the settings a run resolves it to; and which units the wrap policy
//! cuts a model into ([`plan_units`]).

mod kinds;
mod plugin;
mod wrap;

pub use kinds::{
    BackwardPrefetch, MixedPrecisionPolicy, PolicyDtype, ShardingStrategy, StateDictType,
};
pub use plugin::{
    parse_bool, parse_list, policy_name, FsdpError, FsdpPlugin, FsdpSettings, FIELDS, NO_WRAP,
    USE_FSDP_ENV,
};
pub use wrap::{plan_units, policy_modules, policy_units, ShardingError};
