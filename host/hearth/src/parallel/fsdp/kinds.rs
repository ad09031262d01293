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

/// A floating-point type of FSDP's mixed precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PolicyDtype {
    /// float32.
    #[serde(rename = "fp32")]
    Float32,
    /// bfloat16.
    #[serde(rename = "bf16")]
    BFloat16,
    /// float16.
    #[serde(rename = "fp16")]
    Float16,
}

impl PolicyDtype {
    fn parse(value: &str) -> Result<Self, String> {
        let v = value.trim().to_ascii_lowercase();
        match v.strip_prefix("torch.").unwrap_or(&v) {
            "fp32" | "float32" | "float" => Ok(Self::Float32),
            "bf16" | "bfloat16" => Ok(Self::BFloat16),
            "fp16" | "float16" | "half" => Ok(Self::Float16),
            _ => Err(format!(
                "`{}` is not a dtype; use bf16, fp16 or fp32",
                value.trim()
            )),
        }
    }

    /// Its short name (`bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Float32 => "fp32",
            Self::BFloat16 => "bf16",
            Self::Float16 => "fp16",
        }
    }

    /// The libtorch kind.
    pub fn kind(self) -> tch::Kind {
        match self {
            Self::Float32 => tch::Kind::Float,
            Self::BFloat16 => tch::Kind::BFloat16,
            Self::Float16 => tch::Kind::Half,
        }
    }
}

/// FSDP's mixed precision (FSDP2's `MixedPrecisionPolicy`, FSDP1's
/// `MixedPrecision`): whole parameters are gathered in `param_dtype` for
/// forward and backward, gradients are reduced in `reduce_dtype`; the
/// shards the optimizer steps, and its state, stay float32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MixedPrecisionPolicy {
    /// What the whole parameters, and so the computation, are in.
    pub param_dtype: PolicyDtype,
    /// What gradients are reduce-scattered in.
    pub reduce_dtype: PolicyDtype,
}

impl MixedPrecisionPolicy {
    /// From Accelerate's string form (`"bf16"`: both dtypes) or its dict's
    /// keys as `param_dtype=bf16,reduce_dtype=fp32` (`param`/`reduce` for
    /// short; `reduce_dtype` defaults to `param_dtype`, as in FSDP2).
    pub(super) fn parse(value: &str) -> Result<Self, String> {
        if !value.contains('=') {
            if value.trim().eq_ignore_ascii_case("fp8") {
                return Err(
                    "`fp8` needs an FP8 GPU, which hearth does not drive yet; use bf16".into(),
                );
            }
            let dtype = PolicyDtype::parse(value)?;
            return Ok(Self {
                param_dtype: dtype,
                reduce_dtype: dtype,
            });
        }
        let (mut param, mut reduce) = (None, None);
        for pair in value.split(',').filter(|p| !p.trim().is_empty()) {
            let (key, dtype) = pair
                .split_once('=')
                .ok_or_else(|| format!("`{}` is not key=dtype", pair.trim()))?;
            let dtype = PolicyDtype::parse(dtype)?;
            match key
                .trim()
                .trim_end_matches("_dtype")
                .trim_end_matches("-dtype")
            {
                "param" => param = Some(dtype),
                "reduce" => reduce = Some(dtype),
                "buffer" | "output" => {
                    return Err(format!(
                        "`{}` is not supported: hearth leaves buffers as they are and returns \
                         float32 outputs; set param_dtype and reduce_dtype only",
                        key.trim()
                    ))
                }
                other => {
                    return Err(format!(
                        "unknown key `{other}`; use param_dtype and reduce_dtype"
                    ))
                }
            }
        }
        let param_dtype = param.ok_or("param_dtype is missing")?;
        Ok(Self {
            param_dtype,
            reduce_dtype: reduce.unwrap_or(param_dtype),
        })
    }

    /// False for float32 throughout, which changes nothing.
    pub fn casts(&self) -> bool {
        (self.param_dtype, self.reduce_dtype) != (PolicyDtype::Float32, PolicyDtype::Float32)
    }
}
