//! `[fsdp]`: sharded data parallelism (Accelerate's
//! `FullyShardedDataParallelPlugin`), every field under its kebab-case
//! name; see [`crate::parallel::FsdpPlugin`] for what each does. A section
//! present turns FSDP on; `HEARTH_FSDP_*` variables win over its keys.
//!
//! ```toml
//! [fsdp]
//! sharding-strategy = "SHARD_GRAD_OP"   # or Accelerate's number, 2
//! auto-wrap-policy = "transformer-based"
//! transformer-cls-names-to-wrap = ["Block"]
//! ```
//!
//! The section is typed once, here; [`resolve`] merges it with the
//! environment and fills in the defaults, once per run
//! ([`TrainConfig::fsdp_settings`](super::TrainConfig::fsdp_settings)
//! holds the result).

use super::{ConfigError, Invalid};
use crate::parallel::{
    BackwardPrefetch, FsdpPlugin, FsdpSettings, ShardingStrategy, StateDictType, FSDP_FIELDS,
};
use serde::Deserialize;

/// hearth's own `[fsdp]` key beside Accelerate's fields: the sha256 the
/// wrap-policy plugin's component must have (see the plugins chapter).
pub const POLICY_PIN_KEY: &str = "auto-wrap-policy-sha256";

/// A choice Accelerate spells by name or by number (`"FULL_SHARD"` or `1`).
#[derive(Debug, Clone, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(
    untagged,
    expecting = "expected a name (\"FULL_SHARD\") or Accelerate's number (1)"
)]
pub enum NameOrNumber {
    /// The name, in any case.
    Name(String),
    /// Accelerate's number.
    Number(i64),
}

impl NameOrNumber {
    fn parse<T: std::str::FromStr<Err = String>>(&self) -> Result<T, String> {
        match self {
            Self::Name(name) => name.parse(),
            Self::Number(n) => n.to_string().parse(),
        }
    }
}

/// A boolean, or one of its spellings as text (`"yes"`, `"off"`), as
/// Accelerate's config files and environment variables write them.
#[derive(Debug, Clone, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(
    untagged,
    expecting = "expected true or false (or \"yes\", \"no\", \"on\", \"off\")"
)]
pub enum Flag {
    /// `true` or `false`.
    Bool(bool),
    /// `"yes"`, `"no"`, `"on"`, `"off"`, `"1"`, `"0"`, ….
    Text(String),
}

impl Flag {
    fn value(&self) -> Result<bool, String> {
        match self {
            Self::Bool(b) => Ok(*b),
            Self::Text(text) => crate::parallel::fsdp_flag(text),
        }
    }
}

/// Names: a list, or one comma-separated string (as in Accelerate's
/// environment variables).
#[derive(Debug, Clone, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(
    untagged,
    expecting = "expected a list of names ([\"Block\"]) or one comma-separated string"
)]
pub enum Names {
    /// `["Block", "Layer"]`.
    List(Vec<String>),
    /// `"Block, Layer"`.
    Text(String),
}

impl Names {
    fn list(&self) -> Vec<String> {
        match self {
            Self::List(names) => names.iter().map(|n| n.trim().to_string()).collect(),
            Self::Text(text) => crate::parallel::fsdp_list(text),
        }
    }
}

/// The `[fsdp]` section: Accelerate's plugin fields under their kebab-case
/// names, and the wrap policy's pin.
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[schemars(deny_unknown_fields)]
pub struct FsdpSection {
    /// What is sharded: FULL_SHARD (1, the default), SHARD_GRAD_OP (2),
    /// NO_SHARD (3), HYBRID_SHARD (4), HYBRID_SHARD_ZERO2 (5).
    pub sharding_strategy: Option<NameOrNumber>,
    /// 1 (default) or 2; FSDP2 takes its strategy from
    /// `reshard-after-forward` unless `sharding-strategy` is set.
    pub fsdp_version: Option<i64>,
    /// FSDP2: true is FULL_SHARD, false SHARD_GRAD_OP; with FULL_SHARD
    /// named, false keeps a unit's gathered parameters until backward.
    pub reshard_after_forward: Option<Flag>,
    /// The wrap-policy plugin that picks the units: `transformer-based`,
    /// `size-based`, `no-wrap` (default) or a third party's (Accelerate's
    /// `TRANSFORMER_BASED_WRAP` spellings are accepted).
    pub auto_wrap_policy: Option<String>,
    /// The classes `transformer-based` wraps.
    pub transformer_cls_names_to_wrap: Option<Names>,
    /// `size-based`'s threshold (default 0: the root alone).
    pub min_num_params: Option<i64>,
    /// BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH (default, as
    /// Accelerate's `None`).
    pub backward_prefetch: Option<NameOrNumber>,
    /// FULL_SHARD gathers the next unit before the current one runs
    /// forward (default false).
    pub forward_prefetch: Option<Flag>,
    /// Default true; hearth never has more than two units gathered.
    pub limit_all_gathers: Option<Flag>,
    /// `"bf16"`, or `"param_dtype=bf16,reduce_dtype=fp32"`.
    pub mixed_precision_policy: Option<String>,
    /// Shards, gradients and optimizer state in host memory (default false).
    pub cpu_offload: Option<Flag>,
    /// Module paths neither sharded nor averaged.
    pub ignored_modules: Option<Names>,
    /// FULL_STATE_DICT (1, default) or SHARDED_STATE_DICT (3).
    pub state_dict_type: Option<NameOrNumber>,
    /// Every process starts from rank 0's parameters (default false).
    pub sync_module_states: Option<Flag>,
    /// Default true; hearth always keeps the original parameters.
    pub use_orig_params: Option<Flag>,
    /// Units recompute their forward in backward (default false).
    pub activation_checkpointing: Option<Flag>,
    /// Only rank 0 builds the weights (default false; needs
    /// `sync-module-states`).
    pub cpu_ram_efficient_loading: Option<Flag>,
    /// Options for a third-party wrap policy, as a table.
    pub policy_options: Option<serde_json::Map<String, serde_json::Value>>,
    /// The sha256 of the wrap-policy plugin's component, pinned: a
    /// component that hashes otherwise is refused before it is compiled
    /// (hearth's; `hearth plugins lock` writes hearth.lock instead).
    #[serde(rename = "auto-wrap-policy-sha256")]
    pub policy_pin: Option<String>,
    /// Keys no field takes, refused by name when the section is resolved.
    #[serde(flatten)]
    #[schemars(skip)]
    pub unknown: std::collections::BTreeMap<String, toml::Value>,
}

impl FsdpSection {
    /// The fields the section sets; an unknown key or a bad value is an
    /// error naming `fsdp.<key>`.
    pub fn plugin(&self, invalid: &Invalid) -> Result<FsdpPlugin, ConfigError> {
        if let Some(key) = self.unknown.keys().next() {
            let keys: Vec<&str> = FSDP_FIELDS.iter().map(|(k, _)| *k).collect();
            return Err(invalid(
                &format!("fsdp.{key}"),
                format!(
                    "unknown key; the keys are {}, {POLICY_PIN_KEY}",
                    keys.join(", ")
                ),
            ));
        }
        let at = |key: &str| {
            let key = format!("fsdp.{key}");
            move |message: String| invalid(&key, message)
        };
        let flag = |key: &str, value: &Option<Flag>| {
            value.as_ref().map(Flag::value).transpose().map_err(at(key))
        };
        fn choice<T: std::str::FromStr<Err = String>>(
            key: &str,
            value: &Option<NameOrNumber>,
            invalid: &Invalid,
        ) -> Result<Option<T>, ConfigError> {
            let parsed = value.as_ref().map(NameOrNumber::parse).transpose();
            parsed.map_err(|m| invalid(&format!("fsdp.{key}"), m))
        }
        let version = |v: i64| match v {
            1 | 2 => Ok(v as u8),
            _ => Err(format!("`{v}` is not an FSDP version; use 1 or 2")),
        };
        let whole = |n: i64| {
            u64::try_from(n).map_err(|_| format!("`{n}` is not a whole number of parameters"))
        };
        Ok(FsdpPlugin {
            sharding_strategy: choice::<ShardingStrategy>(
                "sharding-strategy",
                &self.sharding_strategy,
                invalid,
            )?,
            fsdp_version: self
                .fsdp_version
                .map(version)
                .transpose()
                .map_err(at("fsdp-version"))?,
            reshard_after_forward: flag("reshard-after-forward", &self.reshard_after_forward)?,
            auto_wrap_policy: self
                .auto_wrap_policy
                .as_deref()
                .map(crate::parallel::policy_name),
            transformer_cls_names_to_wrap: self
                .transformer_cls_names_to_wrap
                .as_ref()
                .map(Names::list),
            min_num_params: self
                .min_num_params
                .map(whole)
                .transpose()
                .map_err(at("min-num-params"))?,
            backward_prefetch: choice::<BackwardPrefetch>(
                "backward-prefetch",
                &self.backward_prefetch,
                invalid,
            )?,
            forward_prefetch: flag("forward-prefetch", &self.forward_prefetch)?,
            limit_all_gathers: flag("limit-all-gathers", &self.limit_all_gathers)?,
            mixed_precision_policy: self.mixed_precision_policy.clone(),
            cpu_offload: flag("cpu-offload", &self.cpu_offload)?,
            ignored_modules: self.ignored_modules.as_ref().map(Names::list),
            state_dict_type: choice::<StateDictType>(
                "state-dict-type",
                &self.state_dict_type,
                invalid,
            )?,
            sync_module_states: flag("sync-module-states", &self.sync_module_states)?,
            use_orig_params: flag("use-orig-params", &self.use_orig_params)?,
            activation_checkpointing: flag(
                "activation-checkpointing",
                &self.activation_checkpointing,
            )?,
            cpu_ram_efficient_loading: flag(
                "cpu-ram-efficient-loading",
                &self.cpu_ram_efficient_loading,
            )?,
            policy_options: self.policy_options.clone(),
            policy_limits: None,
            policy_pin: None,
        })
    }
}

/// The FSDP settings of a run: the `[fsdp]` section (if any) under the
/// `HEARTH_FSDP_*` variables (read here, once each), or the variables
/// alone when `HEARTH_USE_FSDP` turns FSDP on without a section; `None`
/// without either. An error names the key, and the variable when one set
/// the field. The policy's limits and pin are left to the caller.
pub fn resolve(
    section: Option<&FsdpSection>,
    invalid: &Invalid,
) -> Result<Option<FsdpSettings>, ConfigError> {
    let from_env = |e: crate::parallel::FsdpError| {
        invalid("fsdp", format!("cannot take {}: {}", e.key, e.message))
    };
    let fields = match section {
        Some(section) => Some((section.plugin(invalid)?, "[fsdp]")),
        None if FsdpPlugin::wanted_by_env().map_err(from_env)? => {
            Some((FsdpPlugin::default(), "the FSDP environment"))
        }
        None => None,
    };
    let Some((fields, source)) = fields else {
        return Ok(None);
    };
    let env = FsdpPlugin::from_env().map_err(from_env)?;
    let settings = env.clone().or(fields).resolve(source).map_err(|e| {
        let key = format!("fsdp.{}", e.key);
        match FsdpPlugin::env_var(&e.key).filter(|_| env.is_set(&e.key)) {
            Some(var) => invalid(&key, format!("(set by {var}) {}", e.message)),
            None => invalid(&key, e.message),
        }
    })?;
    tracing::debug!(
        "resolved {source}: {} with the wrap policy {}",
        settings.sharding_strategy,
        settings.auto_wrap_policy
    );
    Ok(Some(settings))
}

/// Checks the section's pin against the settings it resolved to.
pub(super) fn validate_pin(
    section: &FsdpSection,
    settings: &FsdpSettings,
    invalid: &Invalid,
) -> Result<(), ConfigError> {
    let key = format!("fsdp.{POLICY_PIN_KEY}");
    match section.policy_pin {
        Some(_) if settings.auto_wrap_policy == crate::parallel::NO_WRAP => Err(invalid(
            &key,
            "pins nothing: no auto-wrap-policy is set, and the default, no-wrap, is built in"
                .into(),
        )),
        _ => Ok(()),
    }
}
