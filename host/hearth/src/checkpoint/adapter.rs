//! PEFT's LoRA adapters: the folder `PeftModel.save_pretrained` writes
//! (`adapter_config.json`, `adapter_model.safetensors`) read into a model's
//! LoRA parameters, written back from them, and merged into the base
//! model's weights (`W + scale · B·A`) for a plain `from_pretrained`.
//!
//! A model traced from a `PeftModel` holds its LoRA parameters as
//! `<prefix>base_model.model.….q_proj.lora_A.<adapter>.weight`; PEFT's file
//! holds `base_model.model.….q_proj.lora_A.weight`. A name maps to the
//! file's by stripping the prefix (`init-key-prefix`) and the adapter's
//! name, the segment after `lora_A` / `lora_B` / `lora_embedding_A` /
//! `lora_embedding_B`.

use super::{open_mapped, tensor_from_view, weight_files, CheckpointError};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// The adapter's configuration file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's weights.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// The segments after which PEFT puts the adapter's name.
const LORA_SEGMENTS: [&str; 4] = ["lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"];

/// Why an adapter cannot be read, checked or merged.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// A file could not be read or is malformed.
    #[error(transparent)]
    Read(#[from] CheckpointError),
    /// The adapter is not one hearth takes.
    #[error("{path}: {message}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What it holds and what to do.
        message: String,
    },
    /// The adapter and the module disagree; every disagreement is listed.
    #[error("{path} does not match the model's LoRA parameters:{}\nsave the adapter from the PeftModel the model was traced from (the same r and target_modules)", bullets(.problems))]
    Mismatch {
        /// The adapter folder.
        path: PathBuf,
        /// Each disagreement.
        problems: Vec<String>,
    },
}

fn bullets(items: &[String]) -> String {
    items.iter().map(|p| format!("\n  - {p}")).collect()
}

/// The LoRA parameters of a model: each model tensor's index and its
/// name in PEFT's file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraNames {
    /// `(index into the model's list, name in adapter_model.safetensors)`.
    pub tensors: Vec<(usize, String)>,
}

impl LoraNames {
    /// The LoRA tensors of `model` (names as the model gives them),
    /// `prefix` stripped from their names.
    pub fn of(model: &[(String, Tensor)], prefix: &str) -> Self {
        let tensors = model
            .iter()
            .enumerate()
            .filter_map(|(i, (name, _))| peft_name(name, prefix).map(|p| (i, p)))
            .collect();
        Self { tensors }
    }

    /// True when the model has no LoRA parameter.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The model's names of its LoRA tensors.
    pub fn model_names(&self, model: &[(String, Tensor)]) -> Vec<String> {
        self.tensors
            .iter()
            .map(|(i, _)| model[*i].0.clone())
            .collect()
    }
}

/// PEFT's file name of the model tensor `name`, when it is a LoRA tensor:
/// `prefix` stripped, and the adapter's name after its LoRA segment.
pub fn peft_name(name: &str, prefix: &str) -> Option<String> {
    let name = name.strip_prefix(prefix).unwrap_or(name);
    let parts: Vec<&str> = name.split('.').collect();
    let at = parts.iter().position(|p| LORA_SEGMENTS.contains(p))?;
    // `lora_A.default.weight` (a Linear) or `lora_embedding_A.default` (a
    // parameter of its own): the adapter's name follows the segment.
    parts.get(at + 1)?;
    let kept: Vec<&str> = parts
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != at + 1)
        .map(|(_, p)| *p)
        .collect();
    Some(kept.join("."))
}

/// An adapter folder, its configuration read.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// The folder.
    pub dir: PathBuf,
    /// `adapter_config.json` as saved (written back unchanged).
    pub config: serde_json::Value,
}

impl Adapter {
    /// Reads `dir`'s `adapter_config.json`, refusing an adapter that is
    /// not plain LoRA.
    pub fn open(dir: &Path) -> Result<Self, AdapterError> {
        let path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&path).map_err(|e| AdapterError::Unsupported {
            path: path.clone(),
            message: format!(
                "cannot be read ({e}); adapter-from names the folder PeftModel.save_pretrained wrote"
            ),
        })?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| AdapterError::Unsupported {
                path: path.clone(),
                message: format!("is not JSON: {e}"),
            })?;
        let unsupported = |message: String| AdapterError::Unsupported {
            path: path.clone(),
            message,
        };
        match config.get("peft_type").and_then(|v| v.as_str()) {
            Some("LORA") => {}
            other => {
                return Err(unsupported(format!(
                    "peft_type is {}; hearth reads LoRA adapters (peft_type \"LORA\")",
                    other.map_or("missing".into(), |t| format!("\"{t}\""))
                )))
            }
        }
        for flag in ["use_dora", "fan_in_fan_out"] {
            if config.get(flag).and_then(|v| v.as_bool()) == Some(true) {
                return Err(unsupported(format!(
                    "{flag} = true is not supported; train a plain LoRA adapter"
                )));
            }
        }
        if config.get("r").and_then(|v| v.as_i64()).is_none() {
            return Err(unsupported("has no integer `r`".into()));
        }
        // PEFT matches these keys as regular expressions; hearth matches a
        // module's name or a suffix of whole segments, so a key that is
        // a pattern is refused rather than silently ignored.
        for key in ["rank_pattern", "alpha_pattern"] {
            let patterns = config.get(key).and_then(|v| v.as_object());
            if let Some(k) = patterns
                .into_iter()
                .flat_map(|o| o.keys())
                .find(|k| k.contains(|c: char| "^$*+?()[]{}|\\".contains(c)))
            {
                return Err(unsupported(format!(
                    "{key} key `{k}` is a regular expression; name the modules (`layers.0.self_attn.q_proj`) instead"
                )));
            }
        }
        Ok(Self {
            dir: dir.into(),
            config,
        })
    }

    /// The rank the configuration gives the module at `module` (PEFT's
    /// `rank_pattern`, else `r`).
    fn rank_of(&self, module: &str) -> i64 {
        pattern_value(&self.config, "rank_pattern", module)
            .unwrap_or_else(|| self.config["r"].as_f64().unwrap_or(0.0)) as i64
    }

    /// The merge scale of the module at `module` with rank `r`:
    /// `lora_alpha / r` (`/ sqrt(r)` with `use_rslora`), PEFT's
    /// `alpha_pattern` first.
    fn scale_of(&self, module: &str, r: i64) -> f64 {
        let alpha = pattern_value(&self.config, "alpha_pattern", module)
            .or_else(|| self.config.get("lora_alpha").and_then(|v| v.as_f64()))
            .unwrap_or(8.0);
        match self.config.get("use_rslora").and_then(|v| v.as_bool()) {
            Some(true) => alpha / (r as f64).sqrt(),
            _ => alpha / r as f64,
        }
    }

    fn weights_path(&self) -> PathBuf {
        self.dir.join(ADAPTER_WEIGHTS)
    }

    /// Checks the adapter's tensors against the model's LoRA parameters
    /// (`lora` of `model`, whose names lose `prefix`): every one present,
    /// with the model's shape, and of the rank the configuration says; one
    /// error lists every problem. A tensor of the adapter that is no LoRA
    /// tensor but a weight of the model under the same name (the embedding
    /// layers PEFT saves beside a LoRA on `lm_head` or `embed_tokens`) is
    /// taken too. Returns what [`load`](Self::load) is to read, as
    /// `(model index, name in the file)`.
    pub fn check(
        &self,
        model: &[(String, Tensor)],
        lora: &LoraNames,
        prefix: &str,
    ) -> Result<Vec<(usize, String)>, AdapterError> {
        let path = self.weights_path();
        let map = open_mapped(&path)?;
        let st = map.tensors(&path)?;
        let in_file: HashMap<String, Vec<i64>> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().iter().map(|&d| d as i64).collect()))
            .collect();
        let mut problems = Vec::new();
        if lora.is_empty() {
            problems.push(
                "the model has no LoRA parameter (`….lora_A.<adapter>.weight`): trace the PeftModel, not its base"
                    .to_string(),
            );
        }
        let wanted: HashMap<&str, usize> =
            lora.tensors.iter().map(|(i, n)| (n.as_str(), *i)).collect();
        for (i, name) in &lora.tensors {
            let shape = model[*i].1.size();
            match in_file.get(name) {
                None => problems.push(format!(
                    "the model has {name} ({}), the adapter does not (a target the adapter was not trained for?)",
                    model[*i].0
                )),
                Some(s) if *s != shape => problems.push(format!(
                    "{name} is {s:?} in the adapter, {shape:?} in the model"
                )),
                Some(_) => {}
            }
            if let Some(r) = lora_rank(name, &shape) {
                let module = module_of(name);
                let said = self.rank_of(&module);
                if said != r {
                    problems.push(format!(
                        "{ADAPTER_CONFIG} gives {module} rank {said}, the model's {name} has rank {r}"
                    ));
                }
            }
        }
        let by_name: HashMap<&str, usize> = model
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.as_str(), i))
            .collect();
        let mut strays: Vec<&String> = in_file
            .keys()
            .filter(|n| !wanted.contains_key(n.as_str()))
            .collect();
        strays.sort();
        let mut loaded = lora.tensors.clone();
        for stray in strays {
            match by_name.get(format!("{prefix}{stray}").as_str()) {
                Some(&i) if model[i].1.size() == in_file[stray] => {
                    loaded.push((i, stray.clone()))
                }
                _ => problems.push(format!(
                    "the adapter has {stray}, the model does not (a target_modules entry the model was not traced with?)"
                )),
            }
        }
        if !problems.is_empty() {
            return Err(AdapterError::Mismatch {
                path: self.dir.clone(),
                problems,
            });
        }
        Ok(loaded)
    }

    /// Copies the adapter's tensors `checked` ([`check`](Self::check)'s)
    /// into `model`'s (cast to their kind).
    pub fn load(
        &self,
        model: &[(String, Tensor)],
        checked: &[(usize, String)],
    ) -> Result<(), AdapterError> {
        let path = self.weights_path();
        let map = open_mapped(&path)?;
        let st = map.tensors(&path)?;
        let _no_grad = tch::no_grad_guard();
        for (i, name) in checked {
            let view = st.tensor(name).map_err(|e| CheckpointError::Format {
                path: path.clone(),
                message: e.to_string(),
            })?;
            let value = tensor_from_view(&path, name, &view)?;
            let mut target = model[*i].1.shallow_clone();
            target.copy_(&value.to_kind(target.kind()));
        }
        Ok(())
    }
}

/// The rank of a LoRA tensor of shape `shape`: the rows of `lora_A`
/// (`[r, in]`) and `lora_embedding_A` (`[r, num_embeddings]`), the columns
/// of `lora_B` (`[out, r]`) and `lora_embedding_B` (`[dim, r]`).
fn lora_rank(name: &str, shape: &[i64]) -> Option<i64> {
    let parts: Vec<&str> = name.split('.').collect();
    match parts.iter().find(|p| LORA_SEGMENTS.contains(p)).copied()? {
        "lora_A" | "lora_embedding_A" => shape.first().copied(),
        _ => shape.get(1).copied(),
    }
}

/// The module a LoRA tensor belongs to, without PEFT's wrapper prefix
/// (`model.layers.0.self_attn.q_proj`: what `rank_pattern` keys match).
fn module_of(name: &str) -> String {
    let name = name.strip_prefix("base_model.model.").unwrap_or(name);
    let parts: Vec<&str> = name.split('.').collect();
    let at = parts
        .iter()
        .position(|p| LORA_SEGMENTS.contains(p))
        .unwrap_or(parts.len());
    parts[..at].join(".")
}

/// A `rank_pattern` / `alpha_pattern` value for `module`: PEFT matches a
/// key as the module's whole name or a suffix of whole segments.
fn pattern_value(config: &serde_json::Value, key: &str, module: &str) -> Option<f64> {
    let patterns = config.get(key)?.as_object()?;
    patterns
        .iter()
        .filter(|(k, _)| module == k.as_str() || module.ends_with(&format!(".{k}")))
        .max_by_key(|(k, _)| k.len())
        .and_then(|(_, v)| v.as_f64())
}

/// Writes `tensors` (under PEFT's names) and `config` as an adapter
/// folder at `dir`, which `PeftModel.from_pretrained(base, dir)` loads.
pub fn write(
    dir: &Path,
    config: &serde_json::Value,
    tensors: &[(String, Tensor)],
) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dir).map_err(CheckpointError::io(dir))?;
    super::save_safetensors(&dir.join(ADAPTER_WEIGHTS), tensors)?;
    let path = dir.join(ADAPTER_CONFIG);
    let text = serde_json::to_string_pretty(config).expect("a JSON value serialises");
    hearth_ops::durable::write_atomically(&path, |f| std::io::Write::write_all(f, text.as_bytes()))
        .map_err(CheckpointError::io(&path))
}

/// The tensors `names` (`saved name → PEFT name`) of the model saved at
/// `saved` (a file or a folder with an index), under their PEFT names.
pub fn read_saved(
    saved: &Path,
    names: &BTreeMap<String, String>,
) -> Result<Vec<(String, Tensor)>, CheckpointError> {
    let mut out = Vec::new();
    for (file, _) in weight_files(saved)? {
        let map = open_mapped(&file)?;
        let st = map.tensors(&file)?;
        for (name, view) in st.tensors() {
            if let Some(peft) = names.get(&name) {
                out.push((peft.clone(), tensor_from_view(&file, &name, &view)?));
            }
        }
    }
    if out.len() != names.len() {
        return Err(CheckpointError::Format {
            path: saved.into(),
            message: format!(
                "holds {} of the {} LoRA tensors the adapter needs",
                out.len(),
                names.len()
            ),
        });
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The adapter's whole copy of the base weight `name`, with its key:
/// `base_model.model.<module>.base_layer.<leaf>` or `base_model.model.<name>`.
fn saved_base_weight(lora: &HashMap<String, Tensor>, name: &str) -> Option<(String, Tensor)> {
    let layer = match name.rsplit_once('.') {
        Some((module, leaf)) => format!("base_model.model.{module}.base_layer.{leaf}"),
        None => format!("base_model.model.base_layer.{name}"),
    };
    [layer, format!("base_model.model.{name}")]
        .into_iter()
        .find_map(|key| lora.get(&key).map(|t| (key, t.shallow_clone())))
}

/// What [`merge`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merged {
    /// The merged weights file.
    pub path: PathBuf,
    /// The base weights the adapter changed.
    pub merged: usize,
}

/// Merges the adapter at `adapter` into the base model at `base` (a
/// Hugging Face folder or a `.safetensors` file) and writes `out`
/// (`model.safetensors` and the base folder's configuration and tokenizer):
/// each adapted `X.weight` becomes `W + scale · B·A`, computed in float32
/// and stored in `W`'s dtype. Every adapter tensor must find its base weight.
pub fn merge(adapter: &Path, base: &Path, out: &Path) -> Result<Merged, AdapterError> {
    let adapter = Adapter::open(adapter)?;
    let lora = super::load_safetensors(&adapter.weights_path(), tch::Device::Cpu)?;
    let lora: HashMap<String, Tensor> = lora.into_iter().collect();
    let mut used = 0;
    let mut merged = Vec::new();
    let mut merged_keys = std::collections::HashSet::new();
    let mut tensors = Vec::new();
    for (file, _) in weight_files(base)? {
        for (name, w) in super::load_safetensors(&file, tch::Device::Cpu)? {
            // A base weight the adapter holds whole (the embedding layers
            // PEFT saves beside a LoRA on them) replaces the base's.
            let w = match saved_base_weight(&lora, &name) {
                Some(saved) => {
                    used += 1;
                    merged_keys.insert(saved.0);
                    saved.1.to_kind(w.kind())
                }
                None => w,
            };
            let stem = name.strip_suffix(".weight").unwrap_or(&name);
            let key = |ab: &str| format!("base_model.model.{stem}.{ab}.weight");
            let value = match (lora.get(&key("lora_A")), lora.get(&key("lora_B"))) {
                (Some(a), Some(b)) => {
                    used += 2;
                    let (sa, sb) = (a.size(), b.size());
                    if sa.len() != 2 || sb.len() != 2 || sb[1] != sa[0] {
                        return Err(AdapterError::Unsupported {
                            path: adapter.weights_path(),
                            message: format!(
                                "the LoRA of {stem} is A {sa:?}, B {sb:?}: hearth merges a Linear's 2-d A [r, in] and B [out, r]"
                            ),
                        });
                    }
                    let r = sa[0];
                    let scale = adapter.scale_of(stem, r);
                    let delta = b.to_kind(Kind::Float).matmul(&a.to_kind(Kind::Float)) * scale;
                    if delta.size() != w.size() {
                        return Err(AdapterError::Mismatch {
                            path: adapter.dir.clone(),
                            problems: vec![format!(
                                "B·A of {stem} is {:?}, the base's {name} {:?}",
                                delta.size(),
                                w.size()
                            )],
                        });
                    }
                    merged.push(name.clone());
                    (w.to_kind(Kind::Float) + delta).to_kind(w.kind())
                }
                _ => w,
            };
            tensors.push((name, value));
        }
    }
    if used != lora.len() {
        merged_keys.extend(merged.iter().flat_map(|n: &String| {
            let stem = n.strip_suffix(".weight").unwrap_or(n);
            ["lora_A", "lora_B"].map(|ab| format!("base_model.model.{stem}.{ab}.weight"))
        }));
        let mut left: Vec<String> = lora
            .keys()
            .filter(|k| !merged_keys.contains(*k))
            .cloned()
            .collect();
        left.sort();
        return Err(AdapterError::Mismatch {
            path: adapter.dir.clone(),
            problems: left
                .into_iter()
                .map(|k| match k.contains("lora_embedding_") {
                    true => format!("{k}: merging an Embedding's LoRA is not supported"),
                    false => format!("{k} has no base weight in {} to merge into", base.display()),
                })
                .collect(),
        });
    }
    std::fs::create_dir_all(out).map_err(CheckpointError::io(out))?;
    let path = out.join(super::SAFE_WEIGHTS_NAME);
    super::save_safetensors(&path, &tensors)?;
    super::pretrained::copy_companions(base, out).map_err(CheckpointError::io(out))?;
    Ok(Merged {
        path,
        merged: merged.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_lose_the_prefix_and_the_adapter_name() {
        assert_eq!(
            peft_name(
                "m.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
                "m."
            )
            .as_deref(),
            Some("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        );
        assert_eq!(
            peft_name(
                "m.base_model.model.model.embed_tokens.lora_embedding_B.default",
                "m."
            )
            .as_deref(),
            Some("base_model.model.model.embed_tokens.lora_embedding_B")
        );
        assert_eq!(
            peft_name(
                "m.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
                "m."
            ),
            None
        );
    }

    #[test]
    fn ranks_and_patterns_are_read_as_peft_writes_them() {
        let config = serde_json::json!({
            "peft_type": "LORA", "r": 8, "lora_alpha": 16,
            "rank_pattern": {"v_proj": 4}, "alpha_pattern": {"layers.1.self_attn.q_proj": 4}
        });
        let adapter = Adapter {
            dir: "a".into(),
            config,
        };
        assert_eq!(adapter.rank_of("model.layers.0.self_attn.q_proj"), 8);
        assert_eq!(adapter.rank_of("model.layers.0.self_attn.v_proj"), 4);
        assert_eq!(adapter.scale_of("model.layers.0.self_attn.q_proj", 8), 2.0);
        assert_eq!(adapter.scale_of("model.layers.1.self_attn.q_proj", 8), 0.5);
        assert_eq!(
            module_of("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
            "model.layers.0.self_attn.q_proj"
        );
        assert_eq!(lora_rank("x.lora_A.weight", &[8, 64]), Some(8));
        assert_eq!(lora_rank("x.lora_B.weight", &[64, 8]), Some(8));
        // PEFT's Embedding LoRA: A is [r, num_embeddings], B [dim, r].
        assert_eq!(lora_rank("x.lora_embedding_A", &[8, 256]), Some(8));
        assert_eq!(lora_rank("x.lora_embedding_B", &[64, 8]), Some(8));
    }
}
