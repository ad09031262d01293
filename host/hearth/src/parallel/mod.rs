//! The data-parallel strategies, side by side, over the gradient round
//! they share ([`GradientSync`]): DDP ([`ddp`]: every process holds the
//! whole model and averages gradients in buckets) and sharding
//! ([`sharded`]: FSDP's SHARD_GRAD_OP, each process holding its shard of
//! the gradients and optimizer state), configured by [`FsdpPlugin`]; and
//! unit-wise execution ([`Unitwise`]: activation checkpointing, and
//! FULL_SHARD's gathering of each unit's parameters around its use). All
//! run over a [`hearth_comm::ProcessGroup`]; none knows which backend
//! carries its collectives.

mod ddp;
mod fsdp;
mod grad_sync;
mod power_sgd;
pub mod sharded;
mod unitwise;

pub use ddp::{BufferBroadcast, CommHook, CommWrapper, DdpOptions, FIRST_BUCKET_MB};
pub use fsdp::{
    policy_name, BackwardPrefetch, FsdpError, FsdpPlugin, FsdpSettings, MixedPrecisionPolicy,
    PolicyDtype, ShardingStrategy, StateDictType, FIELDS as FSDP_FIELDS, NO_WRAP, USE_FSDP_ENV,
};
pub(crate) use grad_sync::Round;
pub use grad_sync::{GradientSync, SyncStats};
pub use power_sgd::PowerSgdOptions;
pub use unitwise::{FullShard, FullShardOptions, Prefetch, Unitwise, UnitwiseError};
