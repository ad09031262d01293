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

hearth_ops::spelled_enum! {
    ShardingStrategy: "sharding strategy" {
        FullShard = "FULL_SHARD" ("1"),
        ShardGradOp = "SHARD_GRAD_OP" ("2"),
        NoShard = "NO_SHARD" ("3"),
        HybridShard = "HYBRID_SHARD" ("4"),
        HybridShardZero2 = "HYBRID_SHARD_ZERO2" ("5"),
    }
}

impl ShardingStrategy {
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

hearth_ops::spelled_enum! {
    BackwardPrefetch: "prefetch mode" {
        BackwardPre = "BACKWARD_PRE",
        BackwardPost = "BACKWARD_POST",
        NoPrefetch = "NO_PREFETCH",
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

hearth_ops::spelled_enum! {
    StateDictType: "state dict type" {
        FullStateDict = "FULL_STATE_DICT" ("1"),
        ShardedStateDict = "SHARDED_STATE_DICT" ("3"),
        LocalStateDict = "LOCAL_STATE_DICT" ("2"),
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
