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

use super::{ConfigError, Invalid};
use crate::parallel::FsdpPlugin;
use serde::Deserialize;

/// hearth's own `[fsdp]` key beside Accelerate's fields: the sha256 the
/// wrap-policy plugin's component must have (see the plugins chapter).
pub const POLICY_PIN_KEY: &str = "auto-wrap-policy-sha256";

/// The `[fsdp]` section, as written (values are checked by [`Self::plugin`]).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct FsdpSection(pub toml::Table);

/// The section's schema: every field of [`FsdpPlugin`] under its key, and
/// no other key (a value is checked by [`FsdpSection::plugin`], which
/// takes a field's spellings, Accelerate's numbers among them).
impl schemars::JsonSchema for FsdpSection {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "FsdpSection".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let mut properties: serde_json::Map<String, serde_json::Value> =
            crate::parallel::FSDP_FIELDS
                .iter()
                .map(|(key, var)| {
                    let field = key.replace('-', "_");
                    let description = format!(
                        "Accelerate's FSDP plugin field `{field}`; the variable {var} wins over it"
                    );
                    (
                        key.to_string(),
                        serde_json::json!({ "description": description }),
                    )
                })
                .collect();
        properties.insert(
            POLICY_PIN_KEY.into(),
            serde_json::json!({
                "description": "The sha256 of the wrap-policy plugin's component, pinned: a component that hashes otherwise is refused before it is compiled (hearth's; `hearth plugins lock` writes hearth.lock instead)",
                "type": "string",
            }),
        );
        schemars::json_schema!({
            "description": "Sharded data parallelism (Accelerate's FullyShardedDataParallelPlugin); a section present turns FSDP on",
            "type": "object",
            "properties": properties,
            "additionalProperties": false,
        })
    }
}

impl FsdpSection {
    /// The fields the section sets; an unknown key or a bad value is an
    /// error naming `fsdp.<key>`.
    pub fn plugin(&self, invalid: &Invalid) -> Result<FsdpPlugin, ConfigError> {
        let mut plugin = FsdpPlugin::default();
        for (key, value) in self.0.iter().filter(|(k, _)| *k != POLICY_PIN_KEY) {
            let text = match value {
                toml::Value::String(s) => s.clone(),
                toml::Value::Array(items) => items
                    .iter()
                    .map(|v| match v {
                        toml::Value::String(s) => Ok(s.clone()),
                        other => Err(invalid(
                            &format!("fsdp.{key}"),
                            format!("holds strings, not {other}"),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join(","),
                toml::Value::Table(table) => {
                    serde_json::to_string(table).expect("a TOML table converts to JSON")
                }
                other => other.to_string(),
            };
            plugin
                .set(key, &text)
                .map_err(|message| invalid(&format!("fsdp.{key}"), message))?;
        }
        Ok(plugin)
    }

    /// The fields of `HEARTH_FSDP_*` variables, then the section's.
    pub fn with_env(&self, invalid: &Invalid) -> Result<FsdpPlugin, ConfigError> {
        let env = FsdpPlugin::from_env()
            .map_err(|e| invalid("fsdp", format!("cannot take {}: {}", e.key, e.message)))?;
        Ok(env.or(self.plugin(invalid)?))
    }

    pub(super) fn validate(&self, invalid: &Invalid) -> Result<(), ConfigError> {
        let settings = self.resolve(invalid)?;
        let key = format!("fsdp.{POLICY_PIN_KEY}");
        match self.0.get(POLICY_PIN_KEY) {
            Some(v) if !v.is_str() => {
                Err(invalid(&key, format!("must be a sha256 string, not {v}")))
            }
            Some(_) if settings.auto_wrap_policy == crate::parallel::NO_WRAP => Err(invalid(
                &key,
                "pins nothing: no auto-wrap-policy is set, and the default, no-wrap, is built in"
                    .into(),
            )),
            _ => Ok(()),
        }
    }

    /// The wrap policy's pin, `auto-wrap-policy-sha256`.
    pub fn policy_pin(&self) -> Option<&str> {
        self.0.get(POLICY_PIN_KEY).and_then(toml::Value::as_str)
    }

    /// The settings the section and the `HEARTH_FSDP_*` variables give; an
    /// error names the key, and the variable when one set the field.
    pub fn resolve(&self, invalid: &Invalid) -> Result<crate::parallel::FsdpSettings, ConfigError> {
        let env = FsdpPlugin::from_env()
            .map_err(|e| invalid("fsdp", format!("cannot take {}: {}", e.key, e.message)))?;
        env.clone()
            .or(self.plugin(invalid)?)
            .resolve("[fsdp]")
            .map_err(|e| {
                let key = format!("fsdp.{}", e.key);
                match FsdpPlugin::env_var(&e.key).filter(|_| env.is_set(&e.key)) {
                    Some(var) => invalid(&key, format!("(set by {var}) {}", e.message)),
                    None => invalid(&key, e.message),
                }
            })
    }
}
