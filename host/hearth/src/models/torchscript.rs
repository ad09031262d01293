//! Models exported from Python with `torch.jit.script(model).save(path)`,
//! trained by hearth with no Python at run time.

use super::{Model, ModuleTree, Unit};
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
    loaded: Arc<Mutex<Loaded>>,
    fused: Fused,
    output: ModelOutput,
    params: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    tree: ModuleTree,
    path: PathBuf,
    /// The unit paths it was cut at, and its pieces.
    pieces: OnceCell<(Vec<String>, Vec<Piece>)>,
}

/// What the model's lock guards: the module, whether it is in training
/// mode, and its forward pass cut at units (once cut).
struct Loaded {
    module: ScriptModule,
    train: bool,
    cut: Option<CutForward>,
}

impl Loaded {
    /// Switches the module to training or evaluation mode when it is not.
    fn mode(&mut self, train: bool) -> Result<(), TchError> {
        if self.train != train {
            self.module.set_train(train)?;
            self.train = train;
        }
        Ok(())
    }
}

fn lock(loaded: &Mutex<Loaded>) -> MutexGuard<'_, Loaded> {
    loaded.lock().unwrap_or_else(|p| p.into_inner())
}

/// One piece of a cut TorchScript model: a unit's call, or the code
/// between two.
struct Piece {
    loaded: Arc<Mutex<Loaded>>,
    index: usize,
    /// The first piece of a loss model: its one input is the ids stacked
    /// on the labels ([`pack_labels`]), the module takes them apart.
    unpack_labels: bool,
    /// The parameters it computes with (their names in the module tree).
    params: Vec<String>,
    path: PathBuf,
}

impl Unit for Piece {
    fn modules(&self) -> Vec<&str> {
        self.params.iter().map(String::as_str).collect()
    }
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut out = self
            .forward_all(std::slice::from_ref(xs), train)
            .unwrap_or_else(|e| {
                panic!(
                    "TorchScript model {}: piece {} failed: {e}",
                    self.path.display(),
                    self.index
                )
            });
        match out.len() {
            1 => out.remove(0),
            n => panic!(
                "TorchScript model {}: piece {} gives {n} tensors, not one",
                self.path.display(),
                self.index
            ),
        }
    }
    fn forward_all(&self, xs: &[Tensor], train: bool) -> Result<Vec<Tensor>, TchError> {
        let mut loaded = lock(&self.loaded);
        loaded.mode(train)?;
        let inputs: Vec<Tensor> = match (self.unpack_labels, xs) {
            (true, [packed]) => vec![packed.get(0), packed.get(1)],
            (true, _) => {
                return Err(TchError::Torch(
                    "a loss model's first piece takes the stacked ids and labels".into(),
                ))
            }
            (false, _) => xs.iter().map(Tensor::shallow_clone).collect(),
        };
        let cut = loaded.cut.as_ref().expect("pieces exist once cut");
        cut.run(self.index, &inputs)
    }
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
        let mut loaded = lock(&self.loaded);
        loaded.mode(train)?;
        match self.output {
            ModelOutput::Logits => loaded.module.forward(&[tokens]),
            ModelOutput::Loss => loaded.module.forward(&[&tokens.get(0), &tokens.get(1)]),
        }
    }

    /// How many pieces its forward pass runs as (1 until it is cut).
    pub fn piece_count(&self) -> usize {
        self.pieces.get().map_or(1, |(_, p)| p.len())
    }

    /// The names, in the module tree, of the parameters read by a piece
    /// that uses `uses` (module paths and tensor names): a tied parameter
    /// read under its second name counts under its first.
    fn parameters_used(&self, uses: &[String]) -> Vec<String> {
        let own = |name: &str| {
            self.tree
                .ties()
                .iter()
                .find(|group| group.iter().any(|n| n == name))
                .and_then(|group| {
                    group
                        .iter()
                        .find(|n| self.params.iter().any(|(p, _)| p == *n))
                })
                .cloned()
                .unwrap_or_else(|| name.to_string())
        };
        let names = self
            .params
            .iter()
            .map(|(n, _)| n.clone())
            .chain(self.tree.ties().iter().flatten().cloned());
        let mut used: Vec<String> = names
            .filter(|n| uses.iter().any(|u| super::under(n, u)))
            .map(|n| own(&n))
            .collect();
        used.sort();
        used.dedup();
        used
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
    let text = e.to_string();
    let line = text.lines().next().unwrap_or_default();
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
    fn cut_at(&self, units: &[String]) -> Result<(), String> {
        let units: Vec<String> = units.iter().filter(|u| !u.is_empty()).cloned().collect();
        let why = |message: String| {
            format!(
                "TorchScript model {}: hearth cannot run it unit by unit: {message}",
                self.path.display()
            )
        };
        if let Some((done, _)) = self.pieces.get() {
            return match *done == units {
                true => Ok(()),
                false => Err(why(format!(
                    "it was already cut at other units ({})",
                    done.join(", ")
                ))),
            };
        }
        let mut loaded = lock(&self.loaded);
        let cut = loaded.module.cut(&units).map_err(|e| why(first_line(&e)))?;
        let inputs = match self.output {
            ModelOutput::Logits => 1,
            ModelOutput::Loss => 2,
        };
        let found = cut.pieces();
        if found.first().map(|p| p.inputs) != Some(inputs)
            || found.last().map(|p| p.outputs) != Some(1)
        {
            return Err(why(format!(
                "its forward pass takes {} tensors and gives {}; hearth gives it {inputs} and takes one",
                found.first().map_or(0, |p| p.inputs),
                found.last().map_or(0, |p| p.outputs)
            )));
        }
        let pieces = found
            .iter()
            .enumerate()
            .map(|(index, p)| Piece {
                loaded: self.loaded.clone(),
                index,
                unpack_labels: index == 0 && self.output == ModelOutput::Loss,
                params: self.parameters_used(&p.uses),
                path: self.path.clone(),
            })
            .collect();
        loaded.cut = Some(cut);
        drop(loaded);
        let _ = self.pieces.set((units, pieces));
        Ok(())
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
