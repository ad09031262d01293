//! Models exported from Python with `torch.jit.script(model).save(path)`,
//! trained by hearth with no Python at run time.

use super::{Model, ModuleTree, Unit};
use hearth_ops::{Fused, ScriptModule};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tch::{Device, TchError, Tensor};

/// A TorchScript module that maps `[batch, time]` int64 tokens to
/// `[batch, time, vocab]` logits. Its parameters keep PyTorch's names
/// (`blocks.0.weight`), so saved weights load back with
/// `model.load_state_dict`. Its buffers (BatchNorm's running statistics)
/// are the module's own. It is one opaque unit: a wrap policy sees its
/// module tree but the host cannot step inside it.
pub struct TorchScriptModel {
    module: Mutex<(ScriptModule, bool)>,
    fused: Fused,
    output: ModelOutput,
    params: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    tree: ModuleTree,
    path: PathBuf,
}

/// What a TorchScript model's `forward` returns (`[model] output`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ModelOutput {
    /// `forward(input_ids)` → `[batch, time, vocab]` logits; hearth takes
    /// the next-token loss, ignoring targets of -100.
    #[default]
    Logits,
    /// `forward(input_ids, labels)` → the loss (or a tuple whose first
    /// element is the loss: transformers' `model(input_ids, labels=labels)`
    /// with `torchscript=True`). The labels are transformers' causal-LM
    /// labels: the inputs themselves, -100 where no loss is taken; the
    /// model shifts them.
    Loss,
}

/// The one tensor a loss model's unit receives: `[2, batch, time]`, the
/// input ids stacked on the labels (a unit passes one tensor along).
pub fn pack_labels(input_ids: &Tensor, labels: &Tensor) -> Tensor {
    Tensor::stack(&[input_ids, labels], 0)
}

/// Why a TorchScript file could not be used.
#[derive(Debug, thiserror::Error)]
#[error("TorchScript model {path}: {message}")]
pub struct TorchScriptError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong, and what to do.
    pub message: String,
}

impl TorchScriptModel {
    /// Loads the module saved at `path` onto `device`, its parameters set to
    /// require gradients, and its graphs' recognised op chains fused
    /// ([`ScriptModule::fuse`]: the same arithmetic in fewer operators).
    pub fn load(path: &Path, device: Device) -> Result<Self, TorchScriptError> {
        Self::load_with(path, device, true)
    }

    /// [`load`](Self::load), fusing only when `fuse` is true (`[model]
    /// fuse-graph`): false runs the graph exactly as it was exported.
    pub fn load_with(path: &Path, device: Device, fuse: bool) -> Result<Self, TorchScriptError> {
        let err = |message: String| TorchScriptError {
            path: path.into(),
            message,
        };
        let mut module = ScriptModule::load(path, device).map_err(|e| {
            err(format!(
                "cannot be loaded ({}); export it with torch.jit.script(model).save(path)",
                first_line(&e)
            ))
        })?;
        let fused = if fuse {
            module.fuse(device).map_err(|e| {
                err(format!(
                    "its graph could not be fused ({}); set `[model] fuse-graph = false` to run it as exported",
                    first_line(&e)
                ))
            })?
        } else {
            Fused::default()
        };
        let structure = module.structure().map_err(|e| {
            err(format!(
                "its modules and tensors cannot be listed: {}",
                first_line(&e)
            ))
        })?;
        if structure.parameters.is_empty() {
            return Err(err("has no parameters to train".into()));
        }
        // The tree keeps libtorch's (declaration) order; the model lists
        // its tensors by name.
        let declared: Vec<(String, &str)> = structure
            .modules
            .iter()
            .map(|(p, c)| (p.clone(), c.as_str()))
            .collect();
        let tree = ModuleTree::with_buffers(&declared, &structure.parameters, &structure.buffers);
        // A tied parameter once, under its first name (as PyTorch's
        // named_parameters gives it), so that it is stepped once.
        let listed: std::collections::HashSet<&str> =
            tree.tensors().iter().map(|t| t.name.as_str()).collect();
        let (mut params, mut buffers) = (structure.parameters, structure.buffers);
        params.retain(|(n, _)| listed.contains(n.as_str()));
        buffers.retain(|(n, _)| listed.contains(n.as_str()));
        params.sort_by(|a, b| a.0.cmp(&b.0));
        buffers.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, p) in &params {
            let _ = p.set_requires_grad(true);
        }
        Ok(Self {
            module: Mutex::new((module, true)),
            fused,
            output: ModelOutput::Logits,
            params,
            buffers,
            tree,
            path: path.into(),
        })
    }

    /// The model with `forward` returning `output`.
    pub fn with_output(mut self, output: ModelOutput) -> Self {
        self.output = output;
        self
    }

    /// What loading fused in its graph.
    pub fn fused(&self) -> Fused {
        self.fused
    }

    /// What `forward` returns.
    pub fn output(&self) -> ModelOutput {
        self.output
    }

    /// The file the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs the module's `forward`, switching it to training or evaluation
    /// mode first when needed: on `tokens`, or for a loss model on the
    /// input ids and labels [`pack_labels`] stacked.
    pub fn try_forward(&self, tokens: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let mut guard = self.module.lock().unwrap_or_else(|p| p.into_inner());
        let (module, mode) = &mut *guard;
        if *mode != train {
            module.set_train(train)?;
            *mode = train;
        }
        match self.output {
            ModelOutput::Logits => module.forward(&[tokens]),
            ModelOutput::Loss => module.forward(&[&tokens.get(0), &tokens.get(1)]),
        }
    }
}

impl TorchScriptModel {
    /// Runs `forward` once (evaluation mode, no gradients) on a `batch` ×
    /// `seq_len` batch of tokens below `vocab`, as the data gives them: an
    /// error, or an output that is not `[batch, seq_len, ≥ vocab]` logits,
    /// names the file and what the model did, before training starts.
    pub fn probe(&self, batch: i64, seq_len: i64, vocab: i64) -> Result<(), TorchScriptError> {
        let err = |message: String| TorchScriptError {
            path: self.path.clone(),
            message,
        };
        let device = self.params[0].1.device();
        let tokens = Tensor::arange(batch * seq_len, (tch::Kind::Int64, device))
            .remainder(vocab)
            .view([batch, seq_len]);
        let shape = [batch, seq_len];
        let (input, needs) = match self.output {
            ModelOutput::Logits => (tokens, "forward must take [batch, time] token ids"),
            ModelOutput::Loss => (
                pack_labels(&tokens, &tokens),
                "with output = \"loss\", forward must take (input_ids, labels), each [batch, time]",
            ),
        };
        let out = tch::no_grad(|| self.try_forward(&input, false)).map_err(|e| {
            err(format!(
                "its forward pass fails on a {shape:?} batch of int64 tokens below {vocab} (what the \
                 data gives): {}; {needs}",
                last_line(&e)
            ))
        })?;
        let size = out.size();
        if self.output == ModelOutput::Loss {
            if !size.is_empty() || !out.is_floating_point() {
                return Err(err(format!(
                    "its forward pass returns {:?} {size:?} for a {shape:?} batch; with output = \"loss\" hearth needs the loss, a floating-point scalar (or a tuple that starts with it)",
                    out.kind()
                )));
            }
            return Ok(());
        }
        let fits = size.len() == 3 && size[..2] == shape && size[2] >= vocab;
        if !fits || !out.is_floating_point() {
            return Err(err(format!(
                "its forward pass returns {:?} {size:?} for a {shape:?} batch of tokens; hearth needs \
                 [batch, time, vocab] floating-point logits with vocab at least {vocab} (the data's), \
                 or set model.output = \"loss\" for a model that returns its loss",
                out.kind()
            )));
        }
        Ok(())
    }
}

/// The last line of a TorchScript interpreter error: the exception raised.
fn last_line(e: &TchError) -> String {
    let text = e.to_string();
    let line = text.lines().rev().find(|l| !l.trim().is_empty());
    line.unwrap_or_default().trim().to_string()
}

fn first_line(e: &TchError) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

impl Unit for TorchScriptModel {
    fn modules(&self) -> Vec<&str> {
        vec![""]
    }
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.try_forward(xs, train).unwrap_or_else(|e| {
            panic!(
                "TorchScript model {}: forward failed: {e}",
                self.path.display()
            )
        })
    }
}

impl Model for TorchScriptModel {
    fn module_tree(&self) -> &ModuleTree {
        &self.tree
    }
    fn units(&self) -> Vec<&dyn Unit> {
        vec![self]
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.buffers
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }
}
