//! What FULL_SHARD adds to unit-wise execution: the shards, and when each
//! is gathered, prefetched and released.

use crate::parallel::fsdp::ShardingError;
use crate::parallel::fsdp::{BackwardPrefetch, MixedPrecisionPolicy};
use crate::parallel::sharded::UnitShard;
use hearth_comm::ProcessGroup;
use tch::{Device, Tensor};

/// What FULL_SHARD adds to unit-wise execution: the shards, and when each
/// is gathered and released.
pub struct FullShard {
    /// Its own channel among the processes.
    pub(super) group: Box<dyn ProcessGroup>,
    /// The wrap policy's units, their shards in storage of their own.
    pub(super) units: Vec<UnitShard>,
    /// False keeps gathered units whole from forward until backward
    /// released them (FSDP2's `reshard_after_forward=False`).
    pub(super) reshard_after_forward: bool,
    /// FSDP's mixed precision: what units are gathered in for use and
    /// what their gradients are reduced in.
    pub(super) policy: Option<MixedPrecisionPolicy>,
    /// When the next unit's gather starts, ahead of its use.
    pub(super) prefetch: Prefetch,
}

/// FULL_SHARD's prefetching: the all-gather of the units the next model
/// unit needs starts before the current one computes, so it can overlap
/// (FSDP's `forward_prefetch` and `backward_prefetch`). At most the
/// current unit and the next are gathered or in flight at once (what
/// FSDP1's `limit_all_gathers` guarantees).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// In forward, before the current unit runs.
    pub forward: bool,
    /// In backward, before (BACKWARD_PRE) or after (BACKWARD_POST) the
    /// current unit's gradients are computed.
    pub backward: BackwardPrefetch,
}

impl Default for Prefetch {
    fn default() -> Self {
        Self {
            forward: false,
            backward: BackwardPrefetch::NoPrefetch,
        }
    }
}

/// Reads the named parameters' values where the model left them unread
/// ([`crate::models::Model::materialize`]): called for each unit just
/// before it is sharded, so a lazily loaded model is read one unit at a
/// time.
pub type ReadWeights<'a> = &'a dyn Fn(&[String]) -> Result<(), String>;

/// All-gathers started ahead of use, by shard unit.
pub(super) type Ahead<'g> = Vec<(usize, hearth_comm::Pending<'g>)>;

/// How FULL_SHARD places, casts and prefetches (from the FSDP settings).
#[derive(Debug, Clone, Copy)]
pub struct FullShardOptions {
    /// False keeps gathered units whole from forward until backward.
    pub reshard_after_forward: bool,
    /// Every process first takes rank 0's values.
    pub sync_module_states: bool,
    /// Where the model trains: the shards go there (the whole parameters
    /// may still be elsewhere: they are released onto it).
    pub device: Device,
    /// The shards live in host memory instead (see [`UnitShard::own_shards`]).
    pub offload: bool,
    /// FSDP's mixed precision.
    pub policy: Option<MixedPrecisionPolicy>,
    /// When gathers start ahead of use.
    pub prefetch: Prefetch,
}

impl FullShard {
    /// Takes `units` (laid out for this process), gives their shards
    /// storage of their own and releases their whole parameters, as
    /// `options` say, one unit at a time: `read` first gives the unit its
    /// values.
    pub fn new(
        group: Box<dyn ProcessGroup>,
        mut units: Vec<UnitShard>,
        read: ReadWeights<'_>,
        options: FullShardOptions,
    ) -> Result<Self, ShardingError> {
        // Blocks this large go back to the system once freed, so that a
        // unit released below no longer counts (see free_large_blocks_at_once).
        hearth_ops::free_large_blocks_at_once(4 << 20);
        // Unit by unit: rank 0's values received, the shards taken, the
        // whole parameters freed, so that a process that never built its
        // weights (cpu-ram-efficient-loading) holds one unit whole at most.
        for unit in &mut units {
            let names: Vec<String> = unit.params.iter().map(|p| p.name.clone()).collect();
            read(&names).map_err(ShardingError::Weights)?;
            if options.sync_module_states {
                for p in &unit.params {
                    let mut t = p.full.detach();
                    group.broadcast(&mut t, 0)?;
                }
            }
            unit.own_shards(options.device, options.offload);
            unit.release_on(Some(options.device));
        }
        hearth_ops::return_freed_host_memory();
        Ok(Self {
            group,
            units,
            reshard_after_forward: options.reshard_after_forward,
            policy: options.policy,
            prefetch: options.prefetch,
        })
    }

    /// Bytes of this process's shards of the parameters.
    pub fn shard_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        self.units
            .iter()
            .flat_map(|u| &u.params)
            .map(|p| bytes(&p.shard))
            .sum()
    }

    /// Handles to the units (for the sharded optimizer).
    pub fn units(&self) -> Vec<UnitShard> {
        self.units.iter().map(UnitShard::shallow_clone).collect()
    }
}
