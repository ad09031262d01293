//! FSDP's configuration: [`FsdpPlugin`] (Accelerate's
//! `FullyShardedDataParallelPlugin`, from code, `HEARTH_FSDP_*` or `[fsdp]`)
//! and the settings a run resolves it to.

mod kinds;
mod plugin;

pub use kinds::{
    BackwardPrefetch, MixedPrecisionPolicy, PolicyDtype, ShardingStrategy, StateDictType,
};
pub use plugin::{policy_name, FsdpError, FsdpPlugin, FsdpSettings, FIELDS, NO_WRAP, USE_FSDP_ENV};
