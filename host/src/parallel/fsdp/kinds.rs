//! The named choices of the FSDP plugin, with Accelerate's spellings and
//! numbers: the sharding strategy, the backward prefetch and the state
//! dict type.

/// How parameters, gradients and optimizer state are spread (Accelerate's
/// numbers in brackets).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ShardingStrategy {
    /// (1) ZeRO-3: parameters too, gathered per unit around its use.
    FullShard,
    /// (2) ZeRO-2: gradients and optimizer state sharded, parameters whole.
    ShardGradOp,
    /// (3) Everything replicated: DDP.
    NoShard,
    /// (4) FULL_SHARD within a machine, replicated across machines.
    HybridShard,
    /// (5) SHARD_GRAD_OP within a machine, replicated across machines.
    HybridShardZero2,
}

impl ShardingStrategy {
    const ALL: [(Self, &'static str); 5] = [
        (Self::FullShard, "FULL_SHARD"),
        (Self::ShardGradOp, "SHARD_GRAD_OP"),
        (Self::NoShard, "NO_SHARD"),
        (Self::HybridShard, "HYBRID_SHARD"),
        (Self::HybridShardZero2, "HYBRID_SHARD_ZERO2"),
    ];

    /// Accelerate's name (`"SHARD_GRAD_OP"`).
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(s, _)| *s == self)
            .expect("listed")
            .1
    }

    /// From a name (any case) or Accelerate's number, 1–5.
    pub fn parse(value: &str) -> Result<Self, String> {
        let value = value.trim();
        if let Ok(n) = value.parse::<usize>() {
            if (1..=5).contains(&n) {
                return Ok(Self::ALL[n - 1].0);
            }
        }
        Self::ALL
            .iter()
            .find(|(_, name)| name.eq_ignore_ascii_case(value))
            .map(|(s, _)| *s)
            .ok_or_else(|| {
                format!(
                    "`{value}` is not a sharding strategy; use one of FULL_SHARD (1), SHARD_GRAD_OP (2), NO_SHARD (3), HYBRID_SHARD (4), HYBRID_SHARD_ZERO2 (5)"
                )
            })
    }

    /// True when gradients and optimizer state are sharded.
    pub fn shards(self) -> bool {
        self != Self::NoShard
    }

    /// True when the parameters are sharded too between uses (ZeRO-3:
    /// FULL_SHARD, HYBRID_SHARD).
    pub fn shards_parameters(self) -> bool {
        matches!(self, Self::FullShard | Self::HybridShard)
    }

    /// True when the shards are spread over one machine's processes and
    /// replicated across machines.
    pub fn hybrid(self) -> bool {
        matches!(self, Self::HybridShard | Self::HybridShardZero2)
    }
}

/// When the next unit's parameters are gathered in backward (FSDP1's
/// `BackwardPrefetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum BackwardPrefetch {
    /// Before the current unit's gradient computation.
    BackwardPre,
    /// After it.
    BackwardPost,
    /// Not prefetched.
    NoPrefetch,
}

impl BackwardPrefetch {
    pub(super) fn parse(value: &str) -> Result<Self, String> {
        match value.trim().to_ascii_uppercase().as_str() {
            "BACKWARD_PRE" => Ok(Self::BackwardPre),
            "BACKWARD_POST" => Ok(Self::BackwardPost),
            "NO_PREFETCH" => Ok(Self::NoPrefetch),
            _ => Err(format!(
                "`{value}` is not a prefetch mode; use BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH"
            )),
        }
    }
}

/// What `save_state`/`save_model` write for a sharded model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum StateDictType {
    /// Rank 0 gathers whole tensors: exactly what a DDP run writes.
    FullStateDict,
    /// Each process writes its own shards.
    ShardedStateDict,
    /// Each process writes its flat shards as they are.
    LocalStateDict,
}

impl StateDictType {
    pub(super) fn parse(value: &str) -> Result<Self, String> {
        match value.trim().to_ascii_uppercase().as_str() {
            "FULL_STATE_DICT" | "1" => Ok(Self::FullStateDict),
            "LOCAL_STATE_DICT" | "2" => Ok(Self::LocalStateDict),
            "SHARDED_STATE_DICT" | "3" => Ok(Self::ShardedStateDict),
            _ => Err(format!(
                "`{value}` is not a state dict type; use FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT"
            )),
        }
    }
}
