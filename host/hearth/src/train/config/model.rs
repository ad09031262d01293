//! `[model]`: a built-in model and its sizes (the vocabulary size and the
//! longest sequence come from the dataset), or a TorchScript file.

use super::{only_for, ConfigError, Invalid};
use serde::Deserialize;

/// Which built-in model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// The GPT of the peer benchmark (`models::Gpt`).
    Gpt,
    /// A context-window MLP language model (`models::Mlp`).
    Mlp,
    /// A model exported from PyTorch with `torch.jit.script(m).save(path)`
    /// that maps `[batch, time]` tokens to `[batch, time, vocab]` logits.
    Torchscript,
}

impl ModelKind {
    /// Every kind.
    pub const ALL: [ModelKind; 3] = [ModelKind::Gpt, ModelKind::Mlp, ModelKind::Torchscript];

    /// The config's spelling (`kind = "gpt"`).
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Gpt => "gpt",
            ModelKind::Mlp => "mlp",
            ModelKind::Torchscript => "torchscript",
        }
    }
}

/// The `[model]` section.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ModelSection {
    /// `gpt`, `mlp` or `torchscript`.
    pub kind: ModelKind,
    /// TorchScript: the saved module, relative to the config file.
    pub path: Option<std::path::PathBuf>,
    /// Embedding / residual width (default 128).
    #[serde(default = "default_d_model")]
    pub d_model: i64,
    /// GPT: number of blocks (default 2).
    #[serde(default = "default_layers")]
    pub layers: i64,
    /// GPT: attention heads, must divide `d-model` (default 4).
    #[serde(default = "default_heads")]
    pub heads: i64,
    /// MLP: tokens each prediction sees (default 3).
    pub context: Option<i64>,
    /// MLP: hidden width (default 4 × d-model).
    pub hidden: Option<i64>,
    /// Pretrained weights to start from, relative to the config file: a
    /// `.safetensors` file, a Hugging Face model folder (`model.safetensors`
    /// or `model.safetensors.index.json`), or a hearth run or checkpoint
    /// folder.
    pub init_from: Option<std::path::PathBuf>,
    /// Put before every name of `init-from`'s tensors (`"m."` for a
    /// TorchScript wrapper holding the model as its attribute `m`).
    pub init_key_prefix: Option<String>,
    /// Name prefixes of `init-from` replaced before `init-key-prefix` is
    /// put on (`{ "lm_head." = "head." }`; `""` strips); the longest
    /// matching prefix applies.
    pub init_rename: Option<std::collections::BTreeMap<String, String>>,
    /// Refuse weights that miss a parameter or hold a tensor the model
    /// lacks (default true); wrong shapes are always refused.
    pub init_strict: Option<bool>,
    /// TorchScript: `forward` returns logits (default) or its own loss.
    pub output: Option<crate::models::ModelOutput>,
    /// Globs over parameter names (as `hearth model plan` prints them, a
    /// wrapper's prefix included: `m.model.embed_tokens.weight`) of
    /// parameters that train, whatever the model was saved with.
    pub trainable: Option<Vec<String>>,
    /// Globs of parameters that stay frozen; wins over `trainable`. The
    /// others train as the model was saved (a TorchScript file keeps each
    /// parameter's `requires_grad`: PEFT's frozen base stays frozen).
    pub frozen: Option<Vec<String>>,
    /// A PEFT adapter folder (`PeftModel.save_pretrained`'s
    /// `adapter_config.json` and `adapter_model.safetensors`), relative to
    /// the config file, loaded into the model's LoRA parameters after
    /// `init-from`; the run writes the trained one to `adapter/`.
    pub adapter_from: Option<std::path::PathBuf>,
    /// TorchScript: fuse the graph's recognised op chains (transformers'
    /// tanh-GELU, a traced empty cache, attention, and Llama-family RMSNorm,
    /// SiLU-gated MLP and rotary embeddings) into fewer operators computing
    /// the same (default true); false runs the graph as exported.
    pub fuse_graph: Option<bool>,
}

/// A key that only applies with `init-from` or `adapter-from`.
fn only_init(set: bool, key: &str, invalid: &Invalid) -> Result<(), ConfigError> {
    match set {
        true => Err(invalid(
            key,
            "only applies with model.init-from or model.adapter-from".into(),
        )),
        false => Ok(()),
    }
}

fn default_d_model() -> i64 {
    128
}
fn default_layers() -> i64 {
    2
}
fn default_heads() -> i64 {
    4
}

impl ModelSection {
    /// MLP context (default 3).
    pub fn context(&self) -> i64 {
        self.context.unwrap_or(3)
    }

    /// MLP hidden width (default 4 × d-model).
    pub fn hidden(&self) -> i64 {
        self.hidden.unwrap_or(self.d_model.saturating_mul(4))
    }

    /// What the model's forward returns.
    pub fn output(&self) -> crate::models::ModelOutput {
        self.output.unwrap_or_default()
    }

    /// How `init-from`'s names become the model's.
    pub fn init_names(&self) -> crate::checkpoint::pretrained::NameMap {
        crate::checkpoint::pretrained::NameMap {
            rename: self
                .init_rename
                .iter()
                .flatten()
                .map(|(a, b)| (a.clone(), b.clone()))
                .collect(),
            prefix: self.init_key_prefix.clone().unwrap_or_default(),
        }
    }

    /// The `trainable` globs (none when unset).
    pub fn trainable_globs(&self) -> &[String] {
        self.trainable.as_deref().unwrap_or_default()
    }

    /// The `frozen` globs (none when unset).
    pub fn frozen_globs(&self) -> &[String] {
        self.frozen.as_deref().unwrap_or_default()
    }

    pub(super) fn validate(&self, invalid: &Invalid) -> Result<(), ConfigError> {
        if self.init_from.is_none() && self.adapter_from.is_none() {
            only_init(
                self.init_key_prefix.is_some(),
                "model.init-key-prefix",
                invalid,
            )?;
        }
        if self.init_from.is_none() {
            let needs = |set: bool, key: &str| {
                if set {
                    Err(invalid(key, "only applies with model.init-from".into()))
                } else {
                    Ok(())
                }
            };
            needs(self.init_rename.is_some(), "model.init-rename")?;
            needs(self.init_strict.is_some(), "model.init-strict")?;
        }
        let positive = |key: &str, v: i64| {
            if v < 1 {
                Err(invalid(key, format!("must be at least 1, got {v}")))
            } else {
                Ok(())
            }
        };
        positive("model.d-model", self.d_model)?;
        if self.kind != ModelKind::Torchscript {
            only_for(&self.path, "model.path", "\"torchscript\"", invalid)?;
            only_for(&self.output, "model.output", "\"torchscript\"", invalid)?;
            only_for(
                &self.fuse_graph,
                "model.fuse-graph",
                "\"torchscript\"",
                invalid,
            )?;
        }
        match self.kind {
            ModelKind::Torchscript => {
                if self.path.is_none() {
                    return Err(invalid(
                        "model.path",
                        "is required for kind = \"torchscript\": the file torch.jit.script(model).save(path) wrote".into(),
                    ));
                }
                only_for(&self.context, "model.context", "\"mlp\"", invalid)?;
                only_for(&self.hidden, "model.hidden", "\"mlp\"", invalid)?;
            }
            ModelKind::Gpt => {
                only_for(&self.context, "model.context", "\"mlp\"", invalid)?;
                only_for(&self.hidden, "model.hidden", "\"mlp\"", invalid)?;
                positive("model.layers", self.layers)?;
                positive("model.heads", self.heads)?;
                if self.d_model % self.heads != 0 {
                    return Err(invalid(
                        "model.heads",
                        format!(
                            "({}) must divide model.d-model ({})",
                            self.heads, self.d_model
                        ),
                    ));
                }
            }
            ModelKind::Mlp => {
                positive("model.context", self.context())?;
                positive("model.hidden", self.hidden())?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::ModelKind;

    #[test]
    fn each_kind_is_spelled_as_the_config_reads_it() {
        for kind in ModelKind::ALL {
            let read: ModelKind = serde_json::from_value(serde_json::json!(kind.as_str())).unwrap();
            assert_eq!(read, kind);
        }
    }
}
