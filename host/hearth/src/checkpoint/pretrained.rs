//! Pretrained weights into a freshly built model (`[model] init-from`): a
//! `.safetensors` file, a Hugging Face model folder (`model.safetensors`, or
//! `model.safetensors.index.json` and its shards) or a hearth run or
//! checkpoint folder holding a whole `model.safetensors`.
//!
//! Two passes. [`plan`] reads only the files' headers and matches every
//! name, shape and dtype against the model, so every process can check
//! the same files and refuse together — one error lists every missing,
//! unexpected and wrongly shaped tensor. [`InitPlan::load`] then reads one
//! file at a time and copies each tensor into the model's own (cast to its
//! dtype): the model's tensors are written in place, so weights the model
//! ties (GPT-2's `lm_head` and `wte`) stay tied.

use super::{open_mapped, tensor_from_view, weight_files, CheckpointError};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use tch::Tensor;

/// How a file's names become the model's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NameMap {
    /// Name prefixes replaced (`"lm_head." → "head."`; an empty
    /// replacement strips a prefix). The longest that matches applies.
    pub rename: Vec<(String, String)>,
    /// Put before every (renamed) name: `"m."` for a TorchScript wrapper
    /// whose wrapped model is its attribute `m`.
    pub prefix: String,
}

impl NameMap {
    /// The model's name for the file's `name`.
    pub fn apply(&self, name: &str) -> String {
        let renamed = self
            .rename
            .iter()
            .filter(|(from, _)| name.starts_with(from.as_str()))
            .max_by_key(|(from, _)| from.len())
            .map(|(from, to)| format!("{to}{}", &name[from.len()..]))
            .unwrap_or_else(|| name.to_string());
        format!("{}{renamed}", self.prefix)
    }

    /// The model names the file's `name` may have: [`apply`](Self::apply)'s,
    /// then those of a model traced from a PEFT `PeftModel` (its base under
    /// `base_model.model.`, and a layer LoRA wraps holding its weights as
    /// `….base_layer.weight`, under `init-key-prefix` when that holds the
    /// wrapper already), as PEFT itself loads a base's weights.
    pub fn candidates(&self, name: &str) -> [String; 4] {
        let mapped = self.apply(name);
        let inner = &mapped[self.prefix.len()..];
        let wrapped = format!("{}base_model.model.{inner}", self.prefix);
        let layer = |name: &str| match name.rsplit_once('.') {
            Some((module, leaf)) => format!("{module}.base_layer.{leaf}"),
            None => name.to_string(),
        };
        // The last: a prefix that holds PEFT's wrapper already.
        let (in_wrapper, in_prefix) = (layer(&wrapped), layer(&mapped));
        [mapped, wrapped, in_wrapper, in_prefix]
    }

    /// A model name the file did not give (a parameter left as initialised)
    /// without the prefix, the best guess at the file's convention.
    pub fn unprefix<'a>(&self, name: &'a str) -> &'a str {
        name.strip_prefix(self.prefix.as_str()).unwrap_or(name)
    }
}

/// The files of a Hugging Face model folder besides its weights that a
/// fine-tuned copy keeps, so `from_pretrained` loads it: its
/// configuration and its tokenizer.
pub const COMPANION_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
];

/// Copies `source`'s [`COMPANION_FILES`] into `dir` (those present);
/// returns their names. Nothing when `source` is not a folder.
pub fn copy_companions(source: &Path, dir: &Path) -> std::io::Result<Vec<String>> {
    let mut copied = Vec::new();
    if !source.is_dir() {
        return Ok(copied);
    }
    for name in COMPANION_FILES {
        let from = source.join(name);
        if from.is_file() {
            std::fs::create_dir_all(dir)?;
            std::fs::copy(&from, dir.join(name))?;
            copied.push(name.to_string());
        }
    }
    Ok(copied)
}

/// Why pretrained weights cannot initialise the model.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A file could not be read or is not safetensors.
    #[error(transparent)]
    Read(#[from] CheckpointError),
    /// The weights and the model disagree; everything that does is listed.
    #[error("{path} does not fit the model:{}\nmatch the names with init-key-prefix or init-rename, or set init-strict = false to load what fits", list(.missing, .unexpected, .shapes))]
    Mismatch {
        /// The file or folder given.
        path: PathBuf,
        /// Model parameters the weights lack.
        missing: Vec<String>,
        /// Tensors of the weights the model lacks (after renaming).
        unexpected: Vec<String>,
        /// `name: shape [..] in FILE, [..] in the model`.
        shapes: Vec<String>,
    },
    /// A sharded hearth checkpoint: merged first, it can be loaded.
    #[error("{0} is a sharded checkpoint (SHARDED_STATE_DICT); merge it with `hearth checkpoint merge {0} OUT` and point init-from at OUT")]
    Sharded(PathBuf),
}

fn list(missing: &[String], unexpected: &[String], shapes: &[String]) -> String {
    let mut text = String::new();
    let mut section = |title: &str, items: &[String]| {
        if !items.is_empty() {
            text.push_str(&format!(
                "\n  {title} ({}): {}",
                items.len(),
                items.join(", ")
            ));
        }
    };
    section("missing from the weights", missing);
    section("not in the model", unexpected);
    section("wrong shape", shapes);
    text
}

/// What [`plan`] found besides the tensors it will load.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InitReport {
    /// Tensors that will be loaded.
    pub loaded: usize,
    /// The file's second copies of a tied weight (the same bytes under a
    /// second name the model does not list), skipped.
    pub tied_copies: Vec<String>,
    /// Model buffers the file lacks (a non-persistent buffer, say): they
    /// keep their values.
    pub absent_buffers: Vec<String>,
    /// Without strict: parameters left as initialised.
    pub missing: Vec<String>,
    /// Without strict: file tensors not loaded.
    pub unexpected: Vec<String>,
}

/// Every file's tensors to copy, checked against the model.
#[derive(Debug)]
pub struct InitPlan {
    /// Each file with `(name in the file, index into the model's list)`.
    files: Vec<(PathBuf, Vec<(String, usize)>)>,
    /// What else was found.
    pub report: InitReport,
}

impl InitPlan {
    /// Each loaded model tensor's name in the file (the names to save a
    /// fine-tuned model under).
    pub fn file_names(&self, model: &[(String, Tensor)]) -> HashMap<String, String> {
        self.files
            .iter()
            .flat_map(|(_, tensors)| tensors.iter())
            .map(|(file_name, i)| (model[*i].0.clone(), file_name.clone()))
            .collect()
    }
}

/// Where a hearth run or checkpoint folder keeps a whole model.
fn source_files(source: &Path) -> Result<Vec<super::WeightFile>, InitError> {
    if source.is_dir()
        && !source.join("model.safetensors").exists()
        && !source.join("model.safetensors.index.json").exists()
        && source.join("pytorch_model_fsdp_0").is_dir()
    {
        return Err(InitError::Sharded(source.into()));
    }
    if !source.exists() {
        return Err(CheckpointError::Format {
            path: source.into(),
            message: "does not exist: init-from wants a .safetensors file or a folder holding model.safetensors (or its index)".into(),
        }
        .into());
    }
    Ok(weight_files(source)?)
}

/// Matches the weights at `source` against `model` (names as `names`
/// maps them; `buffers` are the names of `model`'s entries that are
/// buffers), reading only headers.
pub fn plan(
    model: &[(String, Tensor)],
    buffers: &HashSet<String>,
    source: &Path,
    names: &NameMap,
    strict: bool,
) -> Result<InitPlan, InitError> {
    let index: HashMap<&str, usize> = model
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.as_str(), i))
        .collect();
    let mut files = Vec::new();
    let (mut seen, mut wrong) = (HashSet::new(), HashSet::new());
    let (mut unexpected, mut shapes, mut tied_copies) = (Vec::new(), Vec::new(), Vec::new());
    for (file, _) in source_files(source)? {
        let map = open_mapped(&file)?;
        let st = map.tensors(&file)?;
        let mut mine: Vec<(String, usize)> = Vec::new();
        let mut names_in_file: Vec<String> = st.names().into_iter().map(str::to_string).collect();
        names_in_file.sort();
        let mut strays = Vec::new();
        for name in names_in_file {
            let view = st.tensor(&name).map_err(|e| CheckpointError::Format {
                path: file.clone(),
                message: e.to_string(),
            })?;
            let found = names
                .candidates(&name)
                .iter()
                .find_map(|n| index.get(n.as_str()).copied());
            let Some(i) = found else {
                strays.push(name);
                continue;
            };
            if let Some(first) = (files
                .iter()
                .flat_map(|(_, m): &(PathBuf, Vec<(String, usize)>)| m.iter()))
            .chain(mine.iter())
            .find(|(_, j)| *j == i)
            {
                shapes.push(format!(
                    "{} is given twice, by {} and {name} (check init-rename)",
                    model[i].0, first.0
                ));
                wrong.insert(i);
                continue;
            }
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            if shape != model[i].1.size() {
                shapes.push(format!(
                    "{} is {shape:?} in {}, {:?} in the model",
                    model[i].0,
                    file.display(),
                    model[i].1.size()
                ));
                wrong.insert(i);
                continue;
            }
            seen.insert(i);
            mine.push((name, i));
        }
        // A tensor the model does not list that holds the same bytes as
        // one it loads from this file is a tied weight's second copy.
        for stray in strays {
            let view = st.tensor(&stray).expect("listed by the file");
            let twin = mine.iter().find(|(n, _)| {
                let other = st.tensor(n).expect("listed by the file");
                other.dtype() == view.dtype()
                    && other.shape() == view.shape()
                    && other.data() == view.data()
            });
            match twin {
                Some(_) => tied_copies.push(stray),
                None => unexpected.push(stray),
            }
        }
        files.push((file, mine));
    }
    let (mut missing, mut absent_buffers) = (Vec::new(), Vec::new());
    for (i, (name, _)) in model.iter().enumerate() {
        if !seen.contains(&i) && !wrong.contains(&i) {
            if buffers.contains(name) {
                absent_buffers.push(name.clone());
            } else {
                missing.push(name.clone());
            }
        }
    }
    if !shapes.is_empty()
        || (strict && (!missing.is_empty() || !unexpected.is_empty()))
        || seen.is_empty()
    {
        return Err(InitError::Mismatch {
            path: source.into(),
            missing,
            unexpected,
            shapes,
        });
    }
    Ok(InitPlan {
        files,
        report: InitReport {
            loaded: seen.len(),
            tied_copies,
            absent_buffers,
            missing: if strict { Vec::new() } else { missing },
            unexpected: if strict { Vec::new() } else { unexpected },
        },
    })
}

impl InitPlan {
    /// Copies every planned tensor into `model`'s own (the list [`plan`]
    /// was given), cast to its dtype, one file mapped at a time.
    pub fn load(&self, model: &[(String, Tensor)]) -> Result<(), InitError> {
        self.load_where(model, |_| true)
    }

    /// [`load`](Self::load) of the model tensors whose names `wanted`
    /// picks (one unit's, when a model is sharded as it is loaded).
    pub fn load_where(
        &self,
        model: &[(String, Tensor)],
        wanted: impl Fn(&str) -> bool,
    ) -> Result<(), InitError> {
        let _no_grad = tch::no_grad_guard();
        for (file, tensors) in &self.files {
            if !tensors.iter().any(|(_, i)| wanted(&model[*i].0)) {
                continue;
            }
            let map = open_mapped(file)?;
            let st = map.tensors(file)?;
            for (name, i) in tensors.iter().filter(|(_, i)| wanted(&model[*i].0)) {
                let view = st.tensor(name).map_err(|e| CheckpointError::Format {
                    path: file.clone(),
                    message: e.to_string(),
                })?;
                let source = tensor_from_view(file, name, &view)?;
                let mut target = model[*i].1.shallow_clone();
                target.copy_(&source.to_kind(target.kind()));
            }
        }
        Ok(())
    }

    /// The files read, each with how many tensors it gives.
    pub fn files(&self) -> BTreeMap<PathBuf, usize> {
        self.files
            .iter()
            .map(|(f, t)| (f.clone(), t.len()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_through_the_longest_rename_and_the_prefix_and_back() {
        let names = NameMap {
            rename: vec![
                ("model.".into(), "".into()),
                ("model.head.".into(), "lm_head.".into()),
            ],
            prefix: "m.".into(),
        };
        assert_eq!(names.apply("model.layers.0.w"), "m.layers.0.w");
        assert_eq!(names.apply("model.head.weight"), "m.lm_head.weight");
        assert_eq!(names.apply("other.bias"), "m.other.bias");
    }

    #[test]
    fn a_peft_model_takes_its_base_under_the_wrapper_and_base_layer() {
        let names = NameMap {
            rename: Vec::new(),
            prefix: "m.".into(),
        };
        assert_eq!(
            names.candidates("model.layers.0.self_attn.q_proj.weight"),
            [
                "m.model.layers.0.self_attn.q_proj.weight",
                "m.base_model.model.model.layers.0.self_attn.q_proj.weight",
                "m.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
                "m.model.layers.0.self_attn.q_proj.base_layer.weight",
            ]
        );
    }
}
