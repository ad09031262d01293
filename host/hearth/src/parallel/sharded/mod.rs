//! Sharding (FSDP's `SHARD_GRAD_OP`, ZeRO-2): each unit's parameters are
//! laid out in FSDP2's dim-0 shards (`layout`); backward reduce-scatters
//! a unit's gradients as soon as they are all in, so each process keeps
//! only the gradient rows it owns; the optimizer steps those rows and its
//! state exists only for them ([`ShardedOptimizer`]); after the step the
//! parameters are all-gathered whole again.

mod gradients;
mod layout;
mod optimizer;
mod units;

pub(super) use gradients::{start, write_gradient_shard};
pub use layout::{ParamShard, UnitShard};
pub use optimizer::ShardedOptimizer;
pub use units::{assign, assign_except, UnitError};
