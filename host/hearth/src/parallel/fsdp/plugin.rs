//! `FsdpPlugin`: Accelerate's `FullyShardedDataParallelPlugin`, every
//! field, set in code, from `HEARTH_FSDP_*` variables (Accelerate's
//! `FSDP_*`) or from a `[fsdp]` table. Precedence: a field set in code (or
//! by `hearth run`'s flags) > the environment > the config file > the
//! default.
//!
//! What hearth does not do (LOCAL_STATE_DICT, a casting mixed-precision
//! policy where parameters stay whole, RAM-efficient loading without
//! `sync-module-states`) is refused by [`FsdpPlugin::resolve`] with a
//! message that says so, never ignored.

use super::kinds::{BackwardPrefetch, MixedPrecisionPolicy, ShardingStrategy, StateDictType};

/// Accelerate's `FullyShardedDataParallelPlugin`: `None` is "not set"
/// (the environment, then the default, decides).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FsdpPlugin {
    /// `sharding-strategy` (default FULL_SHARD, as Accelerate's).
    pub sharding_strategy: Option<ShardingStrategy>,
    /// `fsdp-version`: 1 or 2 (default 1). Version 2 takes its strategy
    /// from `reshard-after-forward` unless `sharding-strategy` is set.
    pub fsdp_version: Option<u8>,
    /// `reshard-after-forward`. FSDP2 (no `sharding-strategy`): true is
    /// FULL_SHARD, false SHARD_GRAD_OP, as Accelerate maps them. With
    /// FULL_SHARD named, false keeps a unit's gathered parameters from its
    /// forward until backward is done with them.
    pub reshard_after_forward: Option<bool>,
    /// `auto-wrap-policy`: the wrap-policy plugin that picks the units
    /// (`transformer-based`, `size-based`, `no-wrap` or a third party's;
    /// Accelerate's `TRANSFORMER_BASED_WRAP` spellings are accepted).
    /// Default: `no-wrap` (one unit, the root).
    pub auto_wrap_policy: Option<String>,
    /// `transformer-cls-names-to-wrap`: the classes `transformer-based` wraps.
    pub transformer_cls_names_to_wrap: Option<Vec<String>>,
    /// `min-num-params`: the threshold of `size-based` (default 0, which
    /// wraps nothing but the root, as Accelerate's).
    pub min_num_params: Option<u64>,
    /// `backward-prefetch` (default NO_PREFETCH, as Accelerate's `None`).
    /// With SHARD_GRAD_OP and NO_SHARD parameters are never freed, so
    /// there is nothing to prefetch.
    pub backward_prefetch: Option<BackwardPrefetch>,
    /// `forward-prefetch` (default false); as `backward-prefetch`.
    pub forward_prefetch: Option<bool>,
    /// `limit-all-gathers` (default true); as `backward-prefetch`.
    pub limit_all_gathers: Option<bool>,
    /// `mixed-precision-policy`: `"bf16"` (param and reduce dtypes), or
    /// `"param_dtype=bf16,reduce_dtype=fp32"`.
    pub mixed_precision_policy: Option<String>,
    /// `cpu-offload` (default false; part 2).
    pub cpu_offload: Option<bool>,
    /// `ignored-modules`: module paths whose parameters are neither
    /// sharded nor averaged (each process trains its own copy, as FSDP's).
    pub ignored_modules: Option<Vec<String>>,
    /// `state-dict-type` (default FULL_STATE_DICT).
    pub state_dict_type: Option<StateDictType>,
    /// `sync-module-states` (default false, as Accelerate's): every process
    /// starts from rank 0's parameters (without it, seed every process alike).
    pub sync_module_states: Option<bool>,
    /// `use-orig-params` (default true). hearth always keeps the original
    /// parameters and their names (what `true` gives in PyTorch); `false`
    /// behaves the same.
    pub use_orig_params: Option<bool>,
    /// `activation-checkpointing` (default false; part 2).
    pub activation_checkpointing: Option<bool>,
    /// `cpu-ram-efficient-loading` (default false; needs `sync-module-states`).
    pub cpu_ram_efficient_loading: Option<bool>,
    /// `policy-options`: a JSON object of options for a third-party wrap
    /// policy (hearth's own; Accelerate's policies take only the two
    /// fields above, which are added to it).
    pub policy_options: Option<serde_json::Map<String, serde_json::Value>>,
    /// The limits raised for the wrap-policy plugin, over its manifest's (a
    /// run config's `[plugin-limits.<the policy's name>]`).
    pub policy_limits: Option<hearth_plugins::LimitOverrides>,
    /// The sha256 the wrap-policy plugin's component must have (a run
    /// config's `[fsdp] auto-wrap-policy-sha256` or `hearth.lock`).
    pub policy_pin: Option<String>,
}

/// Every field: its `[fsdp]` key and its environment variable.
pub const FIELDS: [(&str, &str); 18] = [
    ("sharding-strategy", "HEARTH_FSDP_SHARDING_STRATEGY"),
    ("fsdp-version", "HEARTH_FSDP_VERSION"),
    ("reshard-after-forward", "HEARTH_FSDP_RESHARD_AFTER_FORWARD"),
    ("auto-wrap-policy", "HEARTH_FSDP_AUTO_WRAP_POLICY"),
    (
        "transformer-cls-names-to-wrap",
        "HEARTH_FSDP_TRANSFORMER_CLS_TO_WRAP",
    ),
    ("min-num-params", "HEARTH_FSDP_MIN_NUM_PARAMS"),
    ("backward-prefetch", "HEARTH_FSDP_BACKWARD_PREFETCH"),
    ("forward-prefetch", "HEARTH_FSDP_FORWARD_PREFETCH"),
    ("limit-all-gathers", "HEARTH_FSDP_LIMIT_ALL_GATHERS"),
    (
        "mixed-precision-policy",
        "HEARTH_FSDP_MIXED_PRECISION_POLICY",
    ),
    ("cpu-offload", "HEARTH_FSDP_OFFLOAD_PARAMS"),
    ("ignored-modules", "HEARTH_FSDP_IGNORED_MODULES"),
    ("state-dict-type", "HEARTH_FSDP_STATE_DICT_TYPE"),
    ("sync-module-states", "HEARTH_FSDP_SYNC_MODULE_STATES"),
    ("use-orig-params", "HEARTH_FSDP_USE_ORIG_PARAMS"),
    (
        "activation-checkpointing",
        "HEARTH_FSDP_ACTIVATION_CHECKPOINTING",
    ),
    (
        "cpu-ram-efficient-loading",
        "HEARTH_FSDP_CPU_RAM_EFFICIENT_LOADING",
    ),
    ("policy-options", "HEARTH_FSDP_POLICY_OPTIONS"),
];

/// Turns FSDP on from the environment alone (Accelerate's `ACCELERATE_USE_FSDP`).
pub const USE_FSDP_ENV: &str = "HEARTH_USE_FSDP";

/// A bad FSDP setting.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{source_name} `{key}`: {message}")]
pub struct FsdpError {
    /// Where the value came from: `[fsdp]`, an environment variable, the builder.
    pub source_name: String,
    /// The key.
    pub key: String,
    /// What is wrong, and what to do.
    pub message: String,
}

/// The settings a run uses, defaults filled in and checked.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FsdpSettings {
    /// What is sharded.
    pub sharding_strategy: ShardingStrategy,
    /// The wrap policy plugin.
    pub auto_wrap_policy: String,
    /// Options for the policy (JSON: `transformer_cls_names_to_wrap`, `min_num_params`).
    pub policy_options: serde_json::Value,
    /// Modules left out of sharding and averaging.
    pub ignored_modules: Vec<String>,
    /// Every process starts from rank 0's parameters.
    pub sync_module_states: bool,
    /// What checkpoints hold.
    pub state_dict_type: StateDictType,
    /// FULL_SHARD: a unit's whole parameters are released right after its
    /// forward (true), or kept until backward is done with them (false).
    pub reshard_after_forward: bool,
    /// The model runs unit by unit, keeping only each unit's input in
    /// forward and recomputing the unit in backward (FULL_SHARD always does).
    pub activation_checkpointing: bool,
    /// Shards, their gradients and the optimizer state in host memory
    /// (`cpu-offload`), copied to the GPU unit by unit; a CPU run has them
    /// there anyway.
    pub cpu_offload: bool,
    /// FULL_SHARD starts the next unit's all-gather before the current unit
    /// runs in forward (`forward-prefetch`, default false).
    pub forward_prefetch: bool,
    /// ... and in backward (`backward-prefetch`, default NO_PREFETCH).
    pub backward_prefetch: BackwardPrefetch,
    /// `limit-all-gathers` (default true): hearth never has more than the
    /// current unit and the next gathered or in flight, so its bound always
    /// holds; false changes nothing.
    pub limit_all_gathers: bool,
    /// Only the process whose weights `sync-module-states` broadcasts builds
    /// them; the others' stay unmaterialised until they receive their
    /// shards (`cpu-ram-efficient-loading`).
    pub cpu_ram_efficient_loading: bool,
    /// FSDP's mixed precision (float32 throughout casts nothing, but like
    /// any policy it shards a world of one, as FSDP does).
    pub mixed_precision_policy: Option<MixedPrecisionPolicy>,
    /// The limits raised for the wrap-policy plugin, over its manifest's.
    #[serde(skip)]
    pub policy_limits: Option<hearth_plugins::LimitOverrides>,
    /// The sha256 the wrap-policy plugin is pinned to (a run's
    /// `hearth.lock`); its component must hash so.
    #[serde(skip)]
    pub policy_pin: Option<String>,
}

/// A boolean field's text (`true`, `yes`, `on`, `1`, … in any case).
pub fn parse_bool(value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Ok(true),
        "n" | "no" | "f" | "false" | "off" | "0" => Ok(false),
        _ => Err(format!("`{value}` is not true or false")),
    }
}

/// A list field's text: comma-separated names.
pub fn parse_list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The wrap policy FSDP uses when none is named: the whole model one unit.
pub const NO_WRAP: &str = "no-wrap";

/// The built-in policy a name means (Accelerate's spellings accepted).
pub fn policy_name(name: &str) -> String {
    match name.trim().to_ascii_uppercase().replace('-', "_").as_str() {
        "TRANSFORMER_BASED_WRAP" | "TRANSFORMER_BASED" => "transformer-based".into(),
        "SIZE_BASED_WRAP" | "SIZE_BASED" => "size-based".into(),
        "NO_WRAP" => NO_WRAP.into(),
        _ => name.trim().to_string(),
    }
}

impl FsdpPlugin {
    /// Sets the field `key` (its `[fsdp]` name) from its text form, as an
    /// environment variable would give it; lists are comma-separated.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        match key {
            "sharding-strategy" => {
                self.sharding_strategy = Some(value.parse::<ShardingStrategy>()?)
            }
            "fsdp-version" => {
                self.fsdp_version = Some(match value.trim() {
                    "1" => 1,
                    "2" => 2,
                    _ => return Err(format!("`{value}` is not an FSDP version; use 1 or 2")),
                })
            }
            // FSDP2's boolean. (Accelerate's version 1 reads a strategy
            // here only when sharding-strategy is unset, which its default
            // never leaves it: use sharding-strategy.)
            "reshard-after-forward" => self.reshard_after_forward = Some(parse_bool(value)?),
            "auto-wrap-policy" => self.auto_wrap_policy = Some(policy_name(value)),
            "transformer-cls-names-to-wrap" => {
                self.transformer_cls_names_to_wrap = Some(parse_list(value))
            }
            "min-num-params" => {
                self.min_num_params = Some(
                    value
                        .trim()
                        .parse()
                        .map_err(|_| format!("`{value}` is not a whole number of parameters"))?,
                )
            }
            "backward-prefetch" => {
                self.backward_prefetch = Some(value.parse::<BackwardPrefetch>()?)
            }
            "forward-prefetch" => self.forward_prefetch = Some(parse_bool(value)?),
            "limit-all-gathers" => self.limit_all_gathers = Some(parse_bool(value)?),
            "mixed-precision-policy" => self.mixed_precision_policy = Some(value.to_string()),
            "cpu-offload" => self.cpu_offload = Some(parse_bool(value)?),
            "ignored-modules" => self.ignored_modules = Some(parse_list(value)),
            "state-dict-type" => self.state_dict_type = Some(value.parse::<StateDictType>()?),
            "sync-module-states" => self.sync_module_states = Some(parse_bool(value)?),
            "use-orig-params" => self.use_orig_params = Some(parse_bool(value)?),
            "activation-checkpointing" => self.activation_checkpointing = Some(parse_bool(value)?),
            "cpu-ram-efficient-loading" => {
                self.cpu_ram_efficient_loading = Some(parse_bool(value)?)
            }
            "policy-options" => {
                self.policy_options = Some(
                    serde_json::from_str(value)
                        .map_err(|e| format!("is not a JSON object ({e})"))?,
                )
            }
            _ => {
                let keys: Vec<&str> = FIELDS.iter().map(|(k, _)| *k).collect();
                return Err(format!("unknown key; the keys are {}", keys.join(", ")));
            }
        }
        Ok(())
    }

    /// The fields set by `HEARTH_FSDP_*` variables.
    pub fn from_env() -> Result<Self, FsdpError> {
        Self::from_vars(|name| {
            tracing::debug!("read the environment variable {name}");
            std::env::var(name).ok()
        })
    }

    /// The fields set by the variables `var` returns.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, FsdpError> {
        let mut plugin = Self::default();
        for (key, env) in FIELDS {
            if let Some(value) = var(env) {
                plugin.set(key, &value).map_err(|message| FsdpError {
                    source_name: "environment variable".into(),
                    key: env.into(),
                    message,
                })?;
            }
        }
        Ok(plugin)
    }

    /// True when `HEARTH_USE_FSDP` asks for FSDP; a value that is not
    /// true or false is an error naming it.
    pub fn wanted_by_env() -> Result<bool, FsdpError> {
        tracing::debug!("read the environment variable {USE_FSDP_ENV}");
        match std::env::var(USE_FSDP_ENV) {
            Ok(v) => parse_bool(&v).map_err(|message| FsdpError {
                source_name: "environment variable".into(),
                key: USE_FSDP_ENV.into(),
                message,
            }),
            Err(_) => Ok(false),
        }
    }

    /// True when the field `key` (its `[fsdp]` name) is set.
    pub fn is_set(&self, key: &str) -> bool {
        match key {
            "sharding-strategy" => self.sharding_strategy.is_some(),
            "fsdp-version" => self.fsdp_version.is_some(),
            "reshard-after-forward" => self.reshard_after_forward.is_some(),
            "auto-wrap-policy" => self.auto_wrap_policy.is_some(),
            "transformer-cls-names-to-wrap" => self.transformer_cls_names_to_wrap.is_some(),
            "min-num-params" => self.min_num_params.is_some(),
            "backward-prefetch" => self.backward_prefetch.is_some(),
            "forward-prefetch" => self.forward_prefetch.is_some(),
            "limit-all-gathers" => self.limit_all_gathers.is_some(),
            "mixed-precision-policy" => self.mixed_precision_policy.is_some(),
            "cpu-offload" => self.cpu_offload.is_some(),
            "ignored-modules" => self.ignored_modules.is_some(),
            "state-dict-type" => self.state_dict_type.is_some(),
            "sync-module-states" => self.sync_module_states.is_some(),
            "use-orig-params" => self.use_orig_params.is_some(),
            "activation-checkpointing" => self.activation_checkpointing.is_some(),
            "cpu-ram-efficient-loading" => self.cpu_ram_efficient_loading.is_some(),
            "policy-options" => self.policy_options.is_some(),
            _ => false,
        }
    }

    /// The environment variable of field `key`.
    pub fn env_var(key: &str) -> Option<&'static str> {
        FIELDS.iter().find(|(k, _)| *k == key).map(|(_, env)| *env)
    }

    /// `self`'s fields, and `fallback`'s where `self` has none.
    pub fn or(self, fallback: Self) -> Self {
        macro_rules! pick {
            ($($f:ident),*) => { Self { $($f: self.$f.or(fallback.$f)),* } };
        }
        pick!(
            sharding_strategy,
            fsdp_version,
            reshard_after_forward,
            auto_wrap_policy,
            transformer_cls_names_to_wrap,
            min_num_params,
            backward_prefetch,
            forward_prefetch,
            limit_all_gathers,
            mixed_precision_policy,
            cpu_offload,
            ignored_modules,
            state_dict_type,
            sync_module_states,
            use_orig_params,
            activation_checkpointing,
            cpu_ram_efficient_loading,
            policy_options,
            policy_limits,
            policy_pin
        )
    }

    /// The strategy these fields ask for.
    pub fn strategy(&self) -> ShardingStrategy {
        match (
            self.sharding_strategy,
            self.fsdp_version,
            self.reshard_after_forward,
        ) {
            (Some(s), _, _) => s,
            (None, Some(2), Some(false)) => ShardingStrategy::ShardGradOp,
            _ => ShardingStrategy::FullShard,
        }
    }

    /// Fills in the defaults and checks that hearth does what the fields ask;
    /// `source_name` says where the fields came from, for the error.
    pub fn resolve(&self, source_name: &str) -> Result<FsdpSettings, FsdpError> {
        let refuse = |key: &str, message: String| FsdpError {
            source_name: source_name.into(),
            key: key.into(),
            message,
        };
        const LATER: &str = "is not implemented in hearth yet";
        let strategy = self.strategy();
        let cpu_ram_efficient_loading = self.cpu_ram_efficient_loading.unwrap_or(false);
        if cpu_ram_efficient_loading && self.sync_module_states != Some(true) {
            // Accelerate's rule: the others receive rank 0's weights through it.
            return Err(refuse(
                "cpu-ram-efficient-loading",
                "`true` needs `sync-module-states = true`: only rank 0 builds the initial \
                 weights, and the other processes receive theirs through it"
                    .into(),
            ));
        }
        let mixed_precision_policy = match &self.mixed_precision_policy {
            None => None,
            Some(value) => Some(
                MixedPrecisionPolicy::parse(value)
                    .map_err(|m| refuse("mixed-precision-policy", m))?,
            ),
        };
        if mixed_precision_policy.is_some_and(|p| p.casts()) && !strategy.shards_parameters() {
            return Err(refuse(
                "mixed-precision-policy",
                format!(
                    "with {} the whole parameters stay float32 in hearth, so the policy would not \
                     apply; use FULL_SHARD or HYBRID_SHARD, or leave it unset and use `[run] \
                     mixed-precision` (autocast)",
                    strategy.as_str()
                ),
            ));
        }
        let state_dict_type = self.state_dict_type.unwrap_or(StateDictType::FullStateDict);
        if state_dict_type == StateDictType::LocalStateDict {
            return Err(refuse(
                "state-dict-type",
                format!(
                    "LOCAL_STATE_DICT {LATER}; use SHARDED_STATE_DICT (each process saves its \
                     shards, loadable on any number of processes) or FULL_STATE_DICT"
                ),
            ));
        }
        let policy = self
            .auto_wrap_policy
            .clone()
            .unwrap_or_else(|| NO_WRAP.into());
        let mut options = self.policy_options.clone().unwrap_or_default();
        if let Some(names) = &self.transformer_cls_names_to_wrap {
            options.insert("transformer_cls_names_to_wrap".into(), names.clone().into());
        }
        if let Some(min) = self.min_num_params {
            options.insert("min_num_params".into(), min.into());
        }
        Ok(FsdpSettings {
            sharding_strategy: strategy,
            auto_wrap_policy: policy,
            policy_options: options.into(),
            ignored_modules: self.ignored_modules.clone().unwrap_or_default(),
            sync_module_states: self.sync_module_states.unwrap_or(false),
            state_dict_type,
            reshard_after_forward: self.reshard_after_forward.unwrap_or(true),
            activation_checkpointing: self.activation_checkpointing.unwrap_or(false),
            cpu_offload: self.cpu_offload.unwrap_or(false),
            forward_prefetch: self.forward_prefetch.unwrap_or(false),
            backward_prefetch: self
                .backward_prefetch
                .unwrap_or(BackwardPrefetch::NoPrefetch),
            limit_all_gathers: self.limit_all_gathers.unwrap_or(true),
            cpu_ram_efficient_loading,
            mixed_precision_policy,
            policy_limits: self.policy_limits.clone(),
            policy_pin: self.policy_pin.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_parse_by_name_or_accelerates_number() {
        assert_eq!(
            "2".parse::<ShardingStrategy>(),
            Ok(ShardingStrategy::ShardGradOp)
        );
        assert_eq!(
            "no_shard".parse::<ShardingStrategy>(),
            Ok(ShardingStrategy::NoShard)
        );
        assert_eq!(
            "5".parse::<ShardingStrategy>(),
            Ok(ShardingStrategy::HybridShardZero2)
        );
        assert!("6"
            .parse::<ShardingStrategy>()
            .unwrap_err()
            .contains("SHARD_GRAD_OP (2)"));
    }

    #[test]
    fn the_environment_fills_what_code_left_unset() {
        let env = |name: &str| match name {
            "HEARTH_FSDP_SHARDING_STRATEGY" => Some("NO_SHARD".to_string()),
            "HEARTH_FSDP_TRANSFORMER_CLS_TO_WRAP" => Some("Block, Layer".to_string()),
            "HEARTH_FSDP_AUTO_WRAP_POLICY" => Some("TRANSFORMER_BASED_WRAP".to_string()),
            _ => None,
        };
        let code = FsdpPlugin {
            sharding_strategy: Some(ShardingStrategy::ShardGradOp),
            ..Default::default()
        };
        let merged = code.or(FsdpPlugin::from_vars(env).unwrap());
        assert_eq!(
            merged.sharding_strategy,
            Some(ShardingStrategy::ShardGradOp)
        );
        assert_eq!(
            merged.auto_wrap_policy.as_deref(),
            Some("transformer-based")
        );
        assert_eq!(
            merged.transformer_cls_names_to_wrap,
            Some(vec!["Block".to_string(), "Layer".to_string()])
        );
        let settings = merged.resolve("test").unwrap();
        assert_eq!(
            settings.policy_options["transformer_cls_names_to_wrap"][1],
            "Layer"
        );
    }

    #[test]
    fn a_bad_variable_is_named() {
        let env =
            |name: &str| (name == "HEARTH_FSDP_SYNC_MODULE_STATES").then(|| "maybe".to_string());
        let err = FsdpPlugin::from_vars(env).unwrap_err();
        assert_eq!(err.key, "HEARTH_FSDP_SYNC_MODULE_STATES");
        assert!(err.message.contains("not true or false"));
    }

    #[test]
    fn what_hearth_does_not_build_yet_is_refused_not_ignored() {
        let default = FsdpPlugin::default().resolve("[fsdp]").unwrap();
        assert_eq!(default.sharding_strategy, ShardingStrategy::FullShard);
        assert!(default.reshard_after_forward);
        let zero2 = |f: fn(&mut FsdpPlugin)| {
            let mut p = FsdpPlugin {
                sharding_strategy: Some(ShardingStrategy::ShardGradOp),
                ..Default::default()
            };
            f(&mut p);
            p.resolve("[fsdp]")
        };
        assert!(zero2(|_| {}).is_ok());
        // On the CPU everything is in host memory already.
        assert!(zero2(|p| p.cpu_offload = Some(true)).unwrap().cpu_offload);
        let err = zero2(|p| p.state_dict_type = Some(StateDictType::LocalStateDict)).unwrap_err();
        assert_eq!(err.key, "state-dict-type");
        assert!(
            err.message.contains("not implemented in hearth yet"),
            "{err}"
        );
        // RAM-efficient loading needs the broadcast that brings rank 0's weights.
        let err = zero2(|p| p.cpu_ram_efficient_loading = Some(true)).unwrap_err();
        assert_eq!(err.key, "cpu-ram-efficient-loading");
        assert!(err.message.contains("sync-module-states = true"), "{err}");
        assert!(
            zero2(|p| {
                p.cpu_ram_efficient_loading = Some(true);
                p.sync_module_states = Some(true);
            })
            .unwrap()
            .cpu_ram_efficient_loading
        );
        // A policy needs the whole parameters gathered per use.
        let err = zero2(|p| p.mixed_precision_policy = Some("bf16".into())).unwrap_err();
        assert_eq!(err.key, "mixed-precision-policy");
        assert!(err.message.contains("use FULL_SHARD"), "{err}");
        let v2_zero2 = FsdpPlugin {
            fsdp_version: Some(2),
            reshard_after_forward: Some(false),
            ..Default::default()
        };
        assert_eq!(
            v2_zero2.resolve("[fsdp]").unwrap().sharding_strategy,
            ShardingStrategy::ShardGradOp
        );
    }

    #[test]
    fn mixed_precision_policies_parse_accelerates_forms() {
        use super::super::kinds::PolicyDtype::{BFloat16, Float16, Float32};
        let policy = |value: &str| {
            FsdpPlugin {
                mixed_precision_policy: Some(value.into()),
                ..Default::default()
            }
            .resolve("[fsdp]")
            .map(|s| {
                s.mixed_precision_policy
                    .map(|p| (p.param_dtype, p.reduce_dtype))
            })
        };
        assert_eq!(policy("bf16"), Ok(Some((BFloat16, BFloat16))));
        assert_eq!(policy("torch.float16"), Ok(Some((Float16, Float16))));
        assert_eq!(
            policy("param_dtype=bf16, reduce_dtype=fp32"),
            Ok(Some((BFloat16, Float32)))
        );
        assert_eq!(policy("param=fp16"), Ok(Some((Float16, Float16))));
        assert_eq!(policy("fp32"), Ok(Some((Float32, Float32))));
        for (bad, says) in [
            ("bf17", "not a dtype"),
            ("fp8", "FP8"),
            ("reduce_dtype=fp32", "param_dtype is missing"),
            ("param_dtype=bf16,buffer_dtype=bf16", "buffers"),
        ] {
            let err = policy(bad).unwrap_err();
            assert_eq!(err.key, "mixed-precision-policy");
            assert!(err.message.contains(says), "{bad}: {err}");
        }
    }
}
