//! A plugin's options: what its manifest declares under `[options]` (type,
//! default, description), checked against what a run config gives it, and
//! the `[presets]` a manifest fixes for every user.
//!
//! ```toml
//! [options.every]
//! type = "int"              # float, int, boolean or text (the WIT `value`)
//! default = 1
//! description = "Write every n-th logged step."
//! ```
//!
//! A manifest that declares options gets only those: an unknown key or a
//! value of the wrong type is refused at load, naming the plugin and the
//! key, and each declared default is filled in. A manifest that declares
//! none gets what the config gives, unchecked.

use super::{Entries, Manifest, PluginError, Value};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The type of an option, as the WIT `value` variant names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptionType {
    /// A number (an integer given is taken as its float).
    Float,
    /// A whole number.
    Int,
    /// `true` or `false`.
    Boolean,
    /// A string.
    Text,
}

impl std::fmt::Display for OptionType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Float => "float",
            Self::Int => "int",
            Self::Boolean => "boolean",
            Self::Text => "text",
        })
    }
}

/// One option a plugin declares.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OptionSpec {
    /// Its type.
    #[serde(rename = "type")]
    pub ty: OptionType,
    /// Its value when the config gives none (none: then it is not passed).
    pub default: Option<toml::Value>,
    /// One line on what it does.
    #[serde(default)]
    pub description: String,
}

impl OptionType {
    /// `value` as this type (an integer widens to a float), or `None`.
    fn accept(self, value: &toml::Value) -> Option<toml::Value> {
        match (self, value) {
            (Self::Float, toml::Value::Float(_))
            | (Self::Int, toml::Value::Integer(_))
            | (Self::Boolean, toml::Value::Boolean(_))
            | (Self::Text, toml::Value::String(_)) => Some(value.clone()),
            (Self::Float, toml::Value::Integer(i)) => Some(toml::Value::Float(*i as f64)),
            _ => None,
        }
    }
}

/// Parses a manifest's `[options]` table into declarations; the error
/// names the key and says what a declaration looks like.
pub(crate) fn declarations(raw: &toml::Table) -> Result<BTreeMap<String, OptionSpec>, String> {
    let mut specs = BTreeMap::new();
    for (key, value) in raw {
        let spec = match value {
            toml::Value::Table(t) => {
                OptionSpec::deserialize(t.clone()).map_err(|e| format!("`options.{key}`: {e}"))?
            }
            _ => {
                return Err(format!(
                    "`options.{key}` must be a table declaring the option \
                     (`type`, `default`, `description`); values every user gets \
                     are `[presets]` (since WIT 0.3)"
                ))
            }
        };
        if let Some(default) = &spec.default {
            if spec.ty.accept(default).is_none() {
                return Err(format!(
                    "`options.{key}.default` is {} but the option's type is {}",
                    default.type_str(),
                    spec.ty
                ));
            }
        }
        specs.insert(key.clone(), spec);
    }
    Ok(specs)
}

impl Manifest {
    /// `given` checked against the declared options, with their defaults
    /// filled in (or `given` as it is when the manifest declares none).
    pub fn checked_options(&self, given: &toml::Table) -> Result<toml::Table, PluginError> {
        if self.options.is_empty() {
            return Ok(given.clone());
        }
        let mut checked = toml::Table::new();
        for (key, value) in given {
            let Some(spec) = self.options.get(key) else {
                let known: Vec<&str> = self.options.keys().map(String::as_str).collect();
                return Err(self.option_error(
                    key,
                    format!(
                        "is not one of its options ({}); `hearth plugins inspect {}` lists them",
                        known.join(", "),
                        self.name
                    ),
                ));
            };
            let accepted = spec.ty.accept(value).ok_or_else(|| {
                self.option_error(
                    key,
                    format!(
                        "must be {} {}, not {}",
                        article(spec.ty),
                        spec.ty,
                        value.type_str()
                    ),
                )
            })?;
            checked.insert(key.clone(), accepted);
        }
        for (key, spec) in &self.options {
            if let (false, Some(default)) = (checked.contains_key(key), &spec.default) {
                let value = spec.ty.accept(default).expect("checked at parse");
                checked.insert(key.clone(), value);
            }
        }
        Ok(checked)
    }

    /// An error about option `key` of this plugin.
    pub fn option_error(&self, key: &str, message: String) -> PluginError {
        PluginError::Option {
            name: self.name.clone(),
            key: key.into(),
            message,
        }
    }

    /// The user's options (a JSON object) checked against the declared
    /// ones, plus the manifest's `[presets]`: the JSON the scheduler, wrap
    /// policy and checkpoint hook worlds take. A preset is what the
    /// plugin's name stands for (`cosine` presets `schedule = "cosine"`),
    /// so the user may not set it.
    pub fn options_json(&self, user_json: &str) -> Result<String, PluginError> {
        let refuse = |message: String| PluginError::Runtime {
            name: self.name.clone(),
            message,
        };
        let user: toml::Table = serde_json::from_str(user_json)
            .map_err(|e| refuse(format!("its options are not a JSON object: {e}")))?;
        let mut options = self.checked_options(&user)?;
        for (key, value) in &self.presets {
            if options.contains_key(key) {
                return Err(refuse(format!(
                    "option `{key}` is preset by the plugin's manifest ({}) and cannot be set; \
                     remove it, or pick the plugin that means what you want",
                    self.dir.join("plugin.toml").display()
                )));
            }
            options.insert(key.clone(), value.clone());
        }
        Ok(serde_json::to_string(&options).expect("TOML values serialise to JSON"))
    }
}

fn article(ty: OptionType) -> &'static str {
    match ty {
        OptionType::Int => "an",
        _ => "a",
    }
}

/// A TOML scalar as the WIT's `value` (`None` for an array, table or
/// date): how a run config's values reach plugins, as options or as the
/// run's configuration.
pub fn toml_scalar(value: &toml::Value) -> Option<Value> {
    Some(match value {
        toml::Value::Float(f) => Value::Float(*f),
        toml::Value::Integer(i) => Value::Int(*i),
        toml::Value::Boolean(b) => Value::Boolean(*b),
        toml::Value::String(s) => Value::Text(s.clone()),
        _ => return None,
    })
}

/// `options` as the WIT's entries; an array or table is refused with its
/// key (a tracker's options are scalars, as its logged values are).
pub(crate) fn entries(options: &toml::Table) -> Result<Entries, (String, String)> {
    options
        .iter()
        .map(|(key, value)| {
            let v = toml_scalar(value).ok_or_else(|| {
                let kind = value.type_str();
                (
                    key.clone(),
                    format!("is {kind}, but a tracker option is a number, boolean or string"),
                )
            })?;
            Ok((key.clone(), v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn manifest(options: &str) -> Manifest {
        let text = format!(
            "name = \"t\"\nversion = \"0.1.0\"\nkind = \"tracker\"\n\
             world = \"hearth:plugin/tracker-plugin@{}\"\ncomponent = \"t.wasm\"\n{options}",
            crate::WIT_VERSION
        );
        Manifest::parse(&text, Path::new("/p/t")).unwrap()
    }

    fn table(text: &str) -> toml::Table {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn declared_options_are_checked_typed_and_defaulted() {
        let m = manifest(
            "[options.every]\ntype = \"int\"\ndefault = 1\n\
             [options.scale]\ntype = \"float\"\n[options.tag]\ntype = \"text\"\n",
        );
        let got = m.checked_options(&table("scale = 2\ntag = \"a\"")).unwrap();
        assert_eq!(got, table("scale = 2.0\ntag = \"a\"\nevery = 1"));
        let e = m
            .checked_options(&table("evry = 5"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("plugin `t`") && e.contains("`evry`"), "{e}");
        assert!(e.contains("every, scale, tag"), "{e}");
        let e = m
            .checked_options(&table("every = \"5\""))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`every`") && e.contains("must be an int, not string"),
            "{e}"
        );
        // Declaring none: anything passes, as given.
        let free = manifest("");
        assert_eq!(
            free.checked_options(&table("x = [1]")).unwrap(),
            table("x = [1]")
        );
    }

    #[test]
    fn an_undeclared_or_mistyped_declaration_is_refused_at_parse() {
        let text = |options: &str| {
            format!(
                "name = \"t\"\nversion = \"0.1.0\"\nkind = \"tracker\"\n\
                 world = \"hearth:plugin/tracker-plugin@{}\"\ncomponent = \"t.wasm\"\n{options}",
                crate::WIT_VERSION
            )
        };
        let parse = |o: &str| {
            Manifest::parse(&text(o), Path::new("/p/t"))
                .unwrap_err()
                .to_string()
        };
        assert!(parse("[options]\nschedule = \"cosine\"").contains("are `[presets]`"));
        assert!(parse("[options.n]\ntype = \"int\"\ndefault = 0.5")
            .contains("`options.n.default` is float"));
        assert!(parse("[options.n]\ntype = \"integer\"").contains("`options.n`"));
    }
}
