//! The whole run configuration (`TrainConfig`): reading, checking and the JSON Schema of a job's TOML.

// Every section type of the config, as the parent re-exports them.
use super::*;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// A whole training config.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TrainConfig {
    /// `[run]`: name, steps, seed, device, logging.
    pub run: RunSection,
    /// `[model]`: which built-in model and its sizes.
    pub model: ModelSection,
    /// `[data]`: which dataset and the batch size.
    pub data: DataSection,
    /// `[optimizer]`: AdamW (default) or SGD.
    #[serde(default)]
    pub optimizer: OptimizerSection,
    /// `[eval]`: held-out evaluation.
    #[serde(default)]
    pub eval: EvalSection,
    /// `[scheduler]`: a learning-rate schedule plugin (default: constant rate).
    #[serde(default)]
    pub scheduler: Option<SchedulerSection>,
    /// `[[trackers]]`: experiment tracker plugins.
    #[serde(default)]
    pub trackers: Vec<TrackerSection>,
    /// `[distributed]`: backend, timeout and gradient averaging of a
    /// multi-process run.
    #[serde(default)]
    pub distributed: DistributedSection,
    /// `[fsdp]`: sharded data parallelism (FSDP); absent, DDP. The
    /// variable `HEARTH_FSDP_<KEY>` wins over each key (cpu-offload's is
    /// HEARTH_FSDP_OFFLOAD_PARAMS, transformer-cls-names-to-wrap's
    /// HEARTH_FSDP_TRANSFORMER_CLS_TO_WRAP, fsdp-version's
    /// HEARTH_FSDP_VERSION), and HEARTH_USE_FSDP=true shards without the
    /// section.
    #[serde(default)]
    pub fsdp: Option<FsdpSection>,
    /// `[profile]`: record some steps with libtorch's profiler.
    #[serde(default)]
    pub profile: Option<ProfileSection>,
    /// `[[checkpoint-hooks]]`: checkpoint hook plugins, in the order they run.
    #[serde(default)]
    pub checkpoint_hooks: Vec<CheckpointHookSection>,
    /// `[plugin-limits.<name>]`: a plugin's folder quota and output budget,
    /// raised (or lowered) for a plugin the user trusts.
    #[serde(default)]
    pub plugin_limits: std::collections::BTreeMap<String, hearth_plugins::LimitOverrides>,
    /// `[plugin-permissions.<name>]`: the hosts a plugin may reach and the
    /// environment variables it gets, of those its manifest asks for.
    #[serde(default)]
    pub plugin_permissions: std::collections::BTreeMap<String, hearth_plugins::PermissionGrant>,
    /// The file this config was read from (paths in it are relative to its folder).
    #[serde(skip)]
    pub source: PathBuf,
    /// The plugins pinned in `hearth.lock` beside it (empty without one).
    #[serde(skip)]
    pub lock: super::PluginLock,
    /// `[fsdp]` and the `HEARTH_FSDP_*` variables, resolved once when the
    /// file is read (see [`Self::fsdp_settings`]).
    #[serde(skip)]
    sharding: Option<crate::parallel::FsdpSettings>,
}

/// The JSON Schema of a training config (`hearth config schema`), from
/// these types' serde attributes and doc comments: editors that read JSON
/// Schema (Even Better TOML, taplo) validate and complete `hearth` configs
/// with it. A value the schema passes may still be refused by
/// [`TrainConfig::from_file`]'s checks (a path that is missing, a key that
/// only one `kind` takes).
pub fn json_schema() -> serde_json::Value {
    let mut schema =
        serde_json::to_value(schemars::schema_for!(TrainConfig)).expect("a JSON Schema serialises");
    schema["title"] = "hearth training config (hearth run CONFIG.toml)".into();
    schema
}

impl TrainConfig {
    /// Reads and validates a config file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses and validates config text that came from `path`.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let mut config: Self = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.into(),
            message: e.to_string(),
        })?;
        config.source = path.into();
        config.lock = super::PluginLock::read_for(path)?;
        config.resolve_sharding()?;
        config.validate()?;
        Ok(config)
    }

    /// The run's FSDP settings: `[fsdp]` under the `HEARTH_FSDP_*`
    /// variables (or those alone under `HEARTH_USE_FSDP`), defaults filled
    /// in, with the wrap policy's limits and pin; `None` runs DDP. Resolved
    /// once, when the file was read.
    pub fn fsdp_settings(&self) -> Option<&crate::parallel::FsdpSettings> {
        self.sharding.as_ref()
    }

    /// The run's parallelism as one value: `[distributed]`'s DDP options
    /// and [`Self::fsdp_settings`].
    pub fn strategy(&self) -> crate::parallel::Strategy {
        crate::parallel::Strategy {
            ddp: self.distributed.ddp(),
            fsdp: self.sharding.clone(),
        }
    }

    /// Merges `[fsdp]` with the environment, once (see [`Self::fsdp_settings`]).
    fn resolve_sharding(&mut self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| self.invalid(key, message);
        let Some(mut settings) = super::fsdp::resolve(self.fsdp.as_ref(), &invalid)? else {
            return Ok(());
        };
        settings.policy_limits = self.policy_limits(Some(&settings.auto_wrap_policy));
        let policy = settings.auto_wrap_policy.clone();
        self.sharding = Some(settings);
        // The pin comes from this section's key (which needs the policy's
        // name, just resolved) or from hearth.lock; the default policy,
        // no-wrap, is built in and never pinned.
        let pin = (policy != crate::parallel::NO_WRAP)
            .then(|| self.pin(&policy))
            .flatten();
        if let Some(s) = &mut self.sharding {
            s.policy_pin = pin;
        }
        Ok(())
    }

    /// An error about `key` of this config file.
    pub fn invalid(&self, key: &str, message: String) -> ConfigError {
        ConfigError::Invalid {
            path: self.source.clone(),
            key: key.to_string(),
            message,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| self.invalid(key, message);
        self.run.validate(&invalid)?;
        self.model.validate(&invalid)?;
        self.data.validate(&invalid)?;
        if self.model.output() == crate::models::ModelOutput::Loss
            && self.data.kind == DataKind::SortDigits
        {
            return Err(invalid(
                "model.output",
                "is \"loss\", but sort-digits scores exact matches by generating, which needs \
                 logits; use output = \"logits\" or a text dataset"
                    .into(),
            ));
        }
        self.optimizer.validate(&invalid)?;
        self.eval.validate(&invalid)?;
        self.distributed.validate(&invalid)?;
        if let Some(s) = &self.scheduler {
            s.validate(&invalid)?;
        }
        if let (Some(f), Some(s)) = (&self.fsdp, &self.sharding) {
            super::fsdp::validate_pin(f, s, &invalid)?;
        }
        if let Some(p) = &self.profile {
            p.validate(&invalid, self.run.steps)?;
        }
        let trackers = self.trackers.iter().map(|t| t.name.as_str());
        plugin_names("trackers", "tracker", trackers, &invalid)?;
        let hooks = self.checkpoint_hooks.iter().map(|h| h.name.as_str());
        plugin_names("checkpoint-hooks", "checkpoint hook", hooks, &invalid)?;
        let used = self.used_plugins()?;
        let used: Vec<&str> = used.iter().map(String::as_str).collect();
        self.check_pins()?;
        let unused = |section: &str, name: &str| {
            invalid(
                &format!("{section}.{name}"),
                format!(
                    "names no tracker, checkpoint hook, scheduler or wrap policy of this run \
                     (they are: {})",
                    used.join(", ")
                ),
            )
        };
        for (name, grant) in &self.plugin_permissions {
            if !used.contains(&name.as_str()) {
                return Err(unused("plugin-permissions", name));
            }
            for host in &grant.network {
                hearth_plugins::network::HostRule::parse(host)
                    .map_err(|e| invalid(&format!("plugin-permissions.{name}.network"), e))?;
            }
            hearth_plugins::Manifest::check_env_grant(&grant.env)
                .map_err(|e| invalid(&format!("plugin-permissions.{name}.env"), e))?;
        }
        for (name, o) in &self.plugin_limits {
            if !used.contains(&name.as_str()) {
                return Err(unused("plugin-limits", name));
            }
            let keys = o.keys();
            if let Some((key, _)) = keys.iter().find(|(_, v)| *v == Some(0)) {
                return Err(invalid(
                    &format!("plugin-limits.{name}.{key}"),
                    "must be at least 1".into(),
                ));
            }
        }
        Ok(())
    }

    /// The plugins this run uses: its trackers, checkpoint hooks,
    /// scheduler and (sharded) wrap policy.
    pub fn used_plugins(&self) -> Result<Vec<String>, ConfigError> {
        let policy = self.sharding.as_ref().map(|s| s.auto_wrap_policy.clone());
        Ok((self.trackers.iter().map(|t| t.name.clone()))
            .chain(self.checkpoint_hooks.iter().map(|h| h.name.clone()))
            .chain(self.scheduler.iter().map(|s| s.name.clone()))
            .chain(policy)
            .collect())
    }

    /// The `sha256` keys of the plugin tables: (the key, the plugin, the pin).
    fn table_pins(&self) -> Vec<(String, String, &str)> {
        let mut pins = Vec::new();
        for (i, t) in self.trackers.iter().enumerate() {
            if let Some(pin) = &t.sha256 {
                pins.push((
                    format!("trackers[{i}].sha256"),
                    t.name.clone(),
                    pin.as_str(),
                ));
            }
        }
        for (i, h) in self.checkpoint_hooks.iter().enumerate() {
            if let Some(pin) = &h.sha256 {
                let key = format!("checkpoint-hooks[{i}].sha256");
                pins.push((key, h.name.clone(), pin.as_str()));
            }
        }
        if let Some(s) = &self.scheduler {
            if let Some(pin) = &s.sha256 {
                pins.push(("scheduler.sha256".into(), s.name.clone(), pin.as_str()));
            }
        }
        if let (Some(f), Some(s)) = (&self.fsdp, &self.sharding) {
            if let Some(pin) = &f.policy_pin {
                let key = format!("fsdp.{}", super::fsdp::POLICY_PIN_KEY);
                pins.push((key, s.auto_wrap_policy.clone(), pin.as_str()));
            }
        }
        pins
    }

    /// Each table's pin is a sha256 and agrees with `hearth.lock`.
    fn check_pins(&self) -> Result<(), ConfigError> {
        // One table per plugin: a config names a plugin once (checked above).
        for (key, name, pin) in self.table_pins() {
            let pin = hearth_plugins::parse_pin(pin).map_err(|e| self.invalid(&key, e))?;
            if let Some(locked) = self.lock.plugins.get(&name).filter(|l| **l != pin) {
                return Err(self.invalid(
                    &key,
                    format!(
                        "pins `{name}` to {pin}, but {} pins it to {locked}: keep one",
                        super::PluginLock::path_for(&self.source).display()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The sha256 the plugin `name` is pinned to: its table's, else
    /// `hearth.lock`'s.
    pub fn pin(&self, name: &str) -> Option<String> {
        self.table_pin(name)
            .or_else(|| self.lock.plugins.get(name).cloned())
    }

    /// The sha256 a table of this config (`sha256 = "…"`) pins `name` to.
    pub fn table_pin(&self, name: &str) -> Option<String> {
        self.table_pins()
            .into_iter()
            .find(|(_, n, _)| *n == name)
            .map(|(_, _, pin)| pin.to_ascii_lowercase())
    }

    /// `manifest` with the limits `[plugin-limits.<its name>]` sets, what
    /// `[plugin-permissions.<its name>]` grants of its asks, and its pin.
    pub fn plugin_manifest(&self, manifest: &hearth_plugins::Manifest) -> hearth_plugins::Manifest {
        let limited = manifest.with_limits(self.plugin_limits.get(&manifest.name));
        limited
            .with_grant(self.plugin_permissions.get(&manifest.name))
            .expect("grants are checked when the config is read")
            .with_pin(self.pin(&manifest.name).as_deref())
    }

    /// What `[plugin-limits.<name>]` raises for the wrap policy `policy`
    /// (FSDP's default, `no-wrap`, when `None`).
    pub fn policy_limits(&self, policy: Option<&str>) -> Option<hearth_plugins::LimitOverrides> {
        let name = policy.unwrap_or(crate::parallel::NO_WRAP);
        self.plugin_limits.get(name).cloned()
    }

    /// The config as flat tracker entries (`optimizer.lr = 0.002`), the run's
    /// hyper-parameters for `store_init_configuration`.
    pub fn entries(&self) -> hearth_plugins::Entries {
        let text = std::fs::read_to_string(&self.source).unwrap_or_default();
        flatten_toml(&text)
            .into_iter()
            .map(|(k, v)| {
                let v = hearth_plugins::toml_scalar(&v)
                    .unwrap_or_else(|| hearth_plugins::Value::Text(v.to_string()));
                (k, v)
            })
            .collect()
    }

    /// Resolves a path written in the config against the config's folder.
    pub fn resolve(&self, path: &Path) -> PathBuf {
        match self.source.parent() {
            Some(dir) if path.is_relative() => dir.join(path),
            _ => path.to_path_buf(),
        }
    }
}

/// The `name` of each `[[table]]` entry: a plugin name, each listed once.
pub(super) fn plugin_names<'a>(
    table: &str,
    kind: &str,
    names: impl Iterator<Item = &'a str>,
    invalid: &Invalid,
) -> Result<(), ConfigError> {
    let mut seen = Vec::new();
    for (i, name) in names.enumerate() {
        let key = format!("{table}[{i}].name");
        if name.is_empty() {
            return Err(invalid(&key, format!("must name a {kind} plugin")));
        }
        if seen.contains(&name) {
            return Err(invalid(&key, format!("lists {kind} `{name}` twice")));
        }
        seen.push(name);
    }
    Ok(())
}

/// A config file's text as flat `(key, value)` pairs in file order
/// (`optimizer.lr` → `0.002`; tables in arrays as `trackers.0.name`); text
/// that is not TOML gives none.
pub fn flatten_toml(text: &str) -> Vec<(String, toml::Value)> {
    fn walk(prefix: &str, value: &toml::Value, out: &mut Vec<(String, toml::Value)>) {
        match value {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            toml::Value::Array(items) if items.iter().any(|i| i.is_table()) => {
                for (i, item) in items.iter().enumerate() {
                    walk(&format!("{prefix}.{i}"), item, out);
                }
            }
            leaf => out.push((prefix.to_string(), leaf.clone())),
        }
    }
    let table: toml::Table = toml::from_str(text).unwrap_or_default();
    let mut out = Vec::new();
    walk("", &toml::Value::Table(table), &mut out);
    out
}

/// Builds the error for `key` (used by each section's `validate`).
pub type Invalid<'a> = dyn Fn(&str, String) -> ConfigError + 'a;

/// Fails when `value` is set for a kind that does not use `key`.
pub(crate) fn only_for<T>(
    value: &Option<T>,
    key: &str,
    kinds: &str,
    invalid: &Invalid,
) -> Result<(), ConfigError> {
    match value {
        Some(_) => Err(invalid(
            key,
            format!("only applies to kind = {kinds}; remove it or change `kind`"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[run]
name = "t"
steps = 10
[model]
kind = "gpt"
d-model = 32
[data]
kind = "sort-digits"
[optimizer]
lr = 0.01
"#;

    fn parse(text: &str) -> Result<TrainConfig, ConfigError> {
        TrainConfig::from_toml(text, Path::new("job.toml"))
    }

    #[test]
    fn defaults_fill_what_is_not_given() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.model.d_model, 32);
        assert_eq!(c.model.layers, 2);
        assert_eq!(c.optimizer.kind, OptimizerKind::Adamw);
        assert_eq!(c.optimizer.weight_decay(), 0.01);
        assert_eq!(c.run.output_dir, PathBuf::from("runs"));
    }

    #[test]
    fn the_strategy_is_the_ddp_options_and_the_resolved_fsdp_settings() {
        let ddp = parse(&format!("{GOOD}[distributed]\nbucket-cap-mb = 4\n")).unwrap();
        let strategy = ddp.strategy();
        assert_eq!((strategy.shards(), strategy.name()), (false, "DDP".into()));
        assert_eq!(strategy.ddp.bucket_cap_mb, 4.0);
        let sharded = parse(&format!(
            "{GOOD}[distributed]\nbucket-cap-mb = 4\n[fsdp]\nsharding-strategy = 2\n"
        ))
        .unwrap();
        let strategy = sharded.strategy();
        assert_eq!(strategy.name(), "FSDP (SHARD_GRAD_OP)");
        assert_eq!(strategy.ddp.bucket_cap_mb, 4.0);
        assert_eq!(strategy.fsdp.as_ref(), sharded.fsdp_settings());
    }

    #[test]
    fn an_fsdp_value_of_the_wrong_type_says_what_the_key_takes() {
        for (line, says) in [
            ("ignored-modules = 5", "expected a list of names"),
            ("cpu-offload = 3", "expected true or false"),
            (
                "sharding-strategy = true",
                "expected a name (\"FULL_SHARD\") or Accelerate's number",
            ),
        ] {
            let err = parse(&format!("{GOOD}[fsdp]\n{line}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("job.toml") && err.contains(line) && err.contains(says),
                "{line}: {err}"
            );
        }
    }

    #[test]
    fn the_distributed_section_sets_backend_timeout_and_ddp() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.distributed.ddp(), crate::parallel::DdpOptions::default());
        assert_eq!(c.distributed.timeout(), None);
        let c = parse(&format!(
            "{GOOD}[distributed]\nbackend = \"nccl\"\ntimeout = 90\nbucket-cap-mb = 4\ncomm-hook = \"fp16\"\nsave-on-each-node = true\n"
        ))
        .unwrap();
        assert_eq!(c.distributed.backend, Some(hearth_comm::Backend::Nccl));
        assert_eq!(
            c.distributed.timeout(),
            Some(std::time::Duration::from_secs(90))
        );
        assert_eq!(c.distributed.ddp().bucket_cap_mb, 4.0);
        assert_eq!(
            c.distributed.ddp().comm_hook,
            crate::parallel::CommHook::Fp16
        );
        assert!(c.distributed.save_on_each_node);
        for (bad, key) in [
            ("timeout = 0", "distributed.timeout"),
            ("bucket-cap-mb = -1", "distributed.bucket-cap-mb"),
            ("backend = \"gloo\"", "backend"),
            ("comm-hook = \"int8\"", "comm-hook"),
        ] {
            let err = parse(&format!("{GOOD}[distributed]\n{bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("job.toml") && err.contains(key),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_misspelled_key_is_named_with_the_file() {
        let err = parse(&GOOD.replace("lr = 0.01", "lerning-rate = 0.01"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("job.toml") && err.contains("lerning-rate"),
            "{err}"
        );
    }

    #[test]
    fn plugin_lists_name_each_plugin_once() {
        let twice =
            format!("{GOOD}[[trackers]]\nname = \"jsonl\"\n[[trackers]]\nname = \"jsonl\"\n");
        let err = parse(&twice).unwrap_err().to_string();
        assert!(
            err.contains("trackers[1].name") && err.contains("tracker `jsonl` twice"),
            "{err}"
        );
        let empty = format!("{GOOD}[[checkpoint-hooks]]\nname = \"\"\n");
        let err = parse(&empty).unwrap_err().to_string();
        assert!(
            err.contains("checkpoint-hooks[0].name") && err.contains("checkpoint hook plugin"),
            "{err}"
        );
        let hooks =
            format!("{GOOD}[[checkpoint-hooks]]\nname = \"reduced-precision\"\ndtype = \"f16\"\n");
        let c = parse(&hooks).unwrap();
        assert_eq!(c.checkpoint_hooks[0].options_json(), r#"{"dtype":"f16"}"#);
    }

    #[test]
    fn a_wrong_type_is_named() {
        let err = parse(&GOOD.replace("steps = 10", "steps = \"ten\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("steps") && err.contains("job.toml"), "{err}");
    }

    /// A key that belongs to another kind is refused, naming it and the
    /// kind it is for: a text file's path under sort-digits, and
    /// fuse-graph (TorchScript only) under a built-in model.
    #[test]
    fn a_key_for_another_kind_is_refused() {
        for (at, key, kind) in [
            (
                "kind = \"sort-digits\"",
                "path = \"a.txt\"",
                ("data.path", "text-file"),
            ),
            (
                "d-model = 32",
                "fuse-graph = false",
                ("model.fuse-graph", "torchscript"),
            ),
        ] {
            let err = parse(&GOOD.replace(at, &format!("{at}\n{key}")))
                .unwrap_err()
                .to_string();
            assert!(err.contains(kind.0) && err.contains(kind.1), "{err}");
        }
    }

    #[test]
    fn heads_must_divide_the_width() {
        let err = parse(&GOOD.replace("d-model = 32", "d-model = 30"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("model.heads"), "{err}");
    }

    #[test]
    fn paths_resolve_against_the_config_folder() {
        let c = TrainConfig::from_toml(GOOD, Path::new("/x/y/job.toml")).unwrap();
        assert_eq!(
            c.resolve(Path::new("data.txt")),
            PathBuf::from("/x/y/data.txt")
        );
        assert_eq!(c.resolve(Path::new("/abs.txt")), PathBuf::from("/abs.txt"));
    }
}
