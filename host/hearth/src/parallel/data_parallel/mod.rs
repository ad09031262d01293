//! The data parallelism an `Accelerator` runs its prepared models under
//! ([`DataParallel`]): prepared models start from rank 0's
//! parameters, and `backward` averages their gradients across processes,
//! overlapping the backward pass, unless inside `no_sync` (see
//! [`crate::parallel::GradientSync`]). With FSDP's SHARD_GRAD_OP a model's
//! gradients are reduce-scattered unit by unit instead, and an optimizer
//! prepared after it steps only this process's shards. With FULL_SHARD or
//! activation checkpointing a model runs unit by unit
//! ([`crate::parallel::Unitwise`]), and `backward` recomputes its units.
//!
//! The sharded side (FSDP: registering a model's units, HYBRID groups,
//! whole parameters on demand, optimizers over shards) is in `sharded`.

mod join;
mod sharded;
mod strategy;
pub use strategy::*;

pub(crate) use sharded::{ModelSharding, Summoned};
