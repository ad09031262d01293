//! Unit-wise execution: a prepared model's forward pass runs its units
//! ([`crate::models::Unit`]) one after another, each on what the one
//! before it gave, and the accelerator's backward then walks them in
//! reverse, one at a time, each fed the gradients of its outputs.
//!
//! It runs two ways:
//! - **Recomputing** (activation checkpointing, FSDP-NOTES design (b)):
//!   forward runs each unit without a graph, keeping only its inputs;
//!   backward recomputes it, with a graph, from those inputs. The
//!   generator's state before each unit is kept and restored for its
//!   recomputation, so dropout masks are the same twice. No graph outlives
//!   one unit.
//! - **Keeping graphs** (FULL_SHARD without checkpointing, design (c)):
//!   forward keeps each unit's graph, cut from the next unit's at detached
//!   leaves; backward runs each unit's graph from its outputs' gradients.
//!
//! Under FULL_SHARD (ZeRO-3) the shards a unit needs are all-gathered just
//! before it runs, in forward and again in backward, and a shard unit's
//! gradients are reduce-scattered as soon as the first model unit using it
//! (the last one backward reaches) is done. Between the two, when graphs
//! are kept, the whole parameters' memory is freed but their storage kept
//! (autograd saved views of them), and the backward gather gives that
//! storage its values back ([`crate::parallel::sharded::UnitShard::free`]).
//!
//! `execution.rs` holds what a unit-wise execution keeps, `shards.rs` its
//! shard units' gathers, prefetches and reduce-scatters, `passes.rs` the
//! forward and backward passes, `full_shard.rs` the FULL_SHARD settings.

mod execution;
mod full_shard;
mod passes;
mod shards;
#[cfg(test)]
mod tests;

pub use execution::{Unitwise, UnitwiseError};
pub use full_shard::{FullShard, FullShardOptions, Prefetch, ReadWeights};
