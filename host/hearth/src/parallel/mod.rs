//! The data-parallel strategies, side by side, over the gradient round
//! they share ([`GradientSync`]): DDP (`ddp`: every process holds the
//! whole model and averages gradients in buckets) and sharding
//! ([`sharded`]: FSDP's SHARD_GRAD_OP, each process holding its shard of
//! the gradients and optimizer state), configured by [`FsdpPlugin`]; and
//! unit-wise execution ([`Unitwise`]: activation checkpointing, and
//! FULL_SHARD's gathering of each unit's parameters around its use). All
//! run over a [`hearth_comm::ProcessGroup`]; none knows which backend
//! carries its collectives. `data_parallel` is what an `Accelerator` holds
//! of them for its prepared models (registering, backward, join, sharded
//! models' whole parameters on demand); the façade only calls it.

pub(crate) mod data_parallel;
mod ddp;
mod fsdp;
mod grad_sync;
pub mod sharded;
mod strategy;
mod unitwise;

pub use data_parallel::BackwardError;
pub use ddp::{
    BufferBroadcast, CommHook, CommWrapper, DdpOptions, PowerSgdOptions, FIRST_BUCKET_MB,
};
pub use fsdp::{
    parse_bool as fsdp_flag, parse_list as fsdp_list, plan_units, policy_modules, policy_name,
    policy_units, BackwardPrefetch, FsdpError, FsdpPlugin, FsdpSettings, MixedPrecisionPolicy,
    PolicyDtype, ShardingError, ShardingStrategy, StateDictType, FIELDS as FSDP_FIELDS, NO_WRAP,
    USE_FSDP_ENV,
};
pub(crate) use grad_sync::Round;
pub use grad_sync::{GradientSync, SyncStats};
pub use strategy::Strategy;
pub use unitwise::{FullShard, FullShardOptions, Prefetch, ReadWeights, Unitwise, UnitwiseError};
