//! The TorchScript model: loading it, running its whole forward pass, and
//! what it is to the rest of hearth ([`Model`]).

use crate::checkpoint::pretrained::InitPlan;
use crate::models::{Model, ModuleTree, Unit};
use hearth_ops::{CutForward, Fused, ScriptModule};
use std::cell::OnceCell;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::{Device, TchError, Tensor};

/// A TorchScript module that maps `[batch, time]` int64 tokens to
/// `[batch, time, vocab]` logits. Its parameters keep PyTorch's names
/// (`blocks.0.weight`), so saved weights load back with
/// `model.load_state_dict`. Its buffers (BatchNorm's running statistics)
/// are the module's own. Until [`cut_at`](Model::cut_at) it is one unit;
/// cut at a wrap policy's units, its forward pass runs as pieces, one per
/// unit call and one per stretch of code between them
/// ([`hearth_ops::CutForward`]), each passing its tensors to the next.
pub struct TorchScriptModel {
    pub(super) loaded: Arc<Mutex<Loaded>>,
    pub(super) fused: Fused,
    pub(super) output: ModelOutput,
    pub(super) params: Vec<(String, Tensor)>,
    pub(super) buffers: Vec<(String, Tensor)>,
    pub(super) tree: ModuleTree,
    pub(super) path: PathBuf,
    /// The unit paths it was cut at, and its pieces.
    pub(super) pieces: OnceCell<(Vec<String>, Vec<Piece>)>,
    /// Its weights still in the file (loaded lazily), and what reads them.
    pub(super) unread: Option<Unread>,
}

/// What the model's lock guards: the module, whether it is in training
/// mode, and its forward pass cut at units (once cut).
pub(super) struct Loaded {
    pub(super) module: ScriptModule,
    pub(super) train: bool,
    pub(super) cut: Option<CutForward>,
}

impl Loaded {
    /// Switches the module to training or evaluation mode when it is not.
    pub(super) fn mode(&mut self, train: bool) -> Result<(), TchError> {
        if self.train != train {
            self.module.set_train(train)?;
            self.train = train;
        }
        Ok(())
    }
}

pub(super) fn lock(loaded: &Mutex<Loaded>) -> MutexGuard<'_, Loaded> {
    loaded.lock().unwrap_or_else(|p| p.into_inner())
}

/// A lazily loaded model's weights not read yet: in the file, or in an
/// `init-from` plan that covers some of them.
pub(super) struct Unread {
    pub(super) file: hearth_ops::LazyWeights,
    /// The `init-from` plan over `named_state`, and the names it covers.
    pub(super) init: std::cell::RefCell<Option<(InitPlan, std::collections::HashSet<String>)>>,
    /// The parameters are never read here: rank 0's arrive when the model
    /// is prepared (cpu-ram-efficient-loading's other processes).
    pub(super) receives: bool,
    /// The tensors read already (each is read once: a sharded one is
    /// released once it is sharded).
    pub(super) read: std::cell::RefCell<std::collections::HashSet<String>>,
}

/// One piece of a cut TorchScript model: a unit's call, or the code
/// between two.
pub(super) struct Piece {
    pub(super) loaded: Arc<Mutex<Loaded>>,
    pub(super) index: usize,
    /// The first piece of a loss model: its one input is the ids stacked
    /// on the labels ([`pack_labels`]), the module takes them apart.
    pub(super) unpack_labels: bool,
    /// The parameters and buffers it computes with (their names in the
    /// module tree).
    pub(super) tensors: Vec<String>,
    /// Handles to those parameters (their kind tells a mixed-precision
    /// policy's 16-bit gather).
    pub(super) weights: Vec<Tensor>,
    pub(super) path: PathBuf,
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

/// Whether loading fuses a module's graph, and with which kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fusing {
    /// Run as exported (`[model] fuse-graph = false`).
    Off,
    /// With this process's kernel path.
    On,
    /// With the pattern kernels' deliberate error (tests only).
    Mutated,
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
        let module = ScriptModule::load(path, device).map_err(|e| cannot_load(path, &e))?;
        let fusing = if fuse { Fusing::On } else { Fusing::Off };
        Self::from_module(module, path, device, fusing, None)
    }

    /// [`load`](Self::load) with the pattern kernels' deliberate error
    /// (`kPatternOff`): for the tests that must see it.
    #[doc(hidden)]
    pub fn load_with_mutated_kernels(
        path: &Path,
        device: Device,
    ) -> Result<Self, TorchScriptError> {
        let module = ScriptModule::load(path, device).map_err(|e| cannot_load(path, &e))?;
        Self::from_module(module, path, device, Fusing::Mutated, None)
    }

    /// The model around a loaded `module`.
    pub(super) fn from_module(
        mut module: ScriptModule,
        path: &Path,
        device: Device,
        fuse: Fusing,
        unread: Option<Unread>,
    ) -> Result<Self, TorchScriptError> {
        let err = |message: String| TorchScriptError {
            path: path.into(),
            message,
        };
        let fused = match fuse {
            Fusing::Off => Ok(Fused::default()),
            Fusing::On => module.fuse(device),
            Fusing::Mutated => module.fuse_with(device, hearth_ops::pattern_kernels_mutated()),
        };
        let fused = {
            fused.map_err(|e| {
                err(format!(
                    "its graph could not be fused ({}); set `[model] fuse-graph = false` to run it as exported",
                    first_line(&e)
                ))
            })?
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
        // Each parameter trains as the file says (`requires_grad`, which
        // torch.jit.save keeps: PEFT's frozen base stays frozen); `[model]
        // trainable` and `frozen` override it (`models::trainability`).
        Ok(Self {
            loaded: Arc::new(Mutex::new(Loaded {
                module,
                train: true,
                cut: None,
            })),
            fused,
            output: ModelOutput::Logits,
            params,
            buffers,
            tree,
            path: path.into(),
            pieces: OnceCell::new(),
            unread,
        })
    }

    /// The model with `forward` returning `output`.
    pub fn with_output(mut self, output: ModelOutput) -> Self {
        self.output = output;
        self
    }

    /// What loading fused in its graph.
    pub fn fused(&self) -> &Fused {
        &self.fused
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
        let mut loaded = lock(&self.loaded);
        loaded.mode(train)?;
        match self.output {
            ModelOutput::Logits => loaded.module.forward(&[tokens]),
            ModelOutput::Loss => loaded.module.forward(&[&tokens.get(0), &tokens.get(1)]),
        }
    }
}

/// Why `path` could not be loaded.
pub(super) fn cannot_load(path: &Path, e: &TchError) -> TorchScriptError {
    TorchScriptError {
        path: path.into(),
        message: format!(
            "cannot be loaded ({}); export it with torch.jit.script(model).save(path)",
            first_line(e)
        ),
    }
}

/// The last line of a TorchScript interpreter error: the exception raised.
pub(super) fn last_line(e: &TchError) -> String {
    let text = e.to_string();
    let line = text.lines().rev().find(|l| !l.trim().is_empty());
    line.unwrap_or_default().trim().to_string()
}

pub(super) fn first_line(e: &TchError) -> String {
    let text = e.to_string();
    let line = text
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    line.strip_prefix("Internal torch error: ")
        .unwrap_or(line)
        .to_string()
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
        match self.pieces.get() {
            Some((_, pieces)) => pieces.iter().map(|p| p as &dyn Unit).collect(),
            None => vec![self],
        }
    }
    /// The whole module's forward pass, cut or not.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        Unit::forward_t(self, xs, train)
    }
    fn try_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor, TchError> {
        self.try_forward(xs, train)
    }
    fn materialize(&self, names: Option<&[String]>) -> Result<(), String> {
        self.read_weights(names)
    }
    fn defer_init(&self, init: InitPlan) -> Option<InitPlan> {
        self.read_init_from(init)
    }
    fn cut_at(&self, units: &[String]) -> Result<(), String> {
        self.cut_into_pieces(units)
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
