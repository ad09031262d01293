//! Models exported from Python with `torch.jit.script(model).save(path)`,
//! trained by hearth with no Python at run time.

use super::{Model, ModuleTree, Unit};
use crate::ops::ScriptModule;
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
    params: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    tree: ModuleTree,
    path: PathBuf,
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
    /// require gradients.
    pub fn load(path: &Path, device: Device) -> Result<Self, TorchScriptError> {
        let err = |message: String| TorchScriptError {
            path: path.into(),
            message,
        };
        let module = ScriptModule::load(path, device).map_err(|e| {
            err(format!(
                "cannot be loaded ({}); export it with torch.jit.script(model).save(path)",
                first_line(&e)
            ))
        })?;
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
            params,
            buffers,
            tree,
            path: path.into(),
        })
    }

    /// The file the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs the module's `forward`, switching it to training or evaluation
    /// mode first when needed.
    pub fn try_forward(&self, tokens: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let mut guard = self.module.lock().unwrap_or_else(|p| p.into_inner());
        let (module, mode) = &mut *guard;
        if *mode != train {
            module.set_train(train)?;
            *mode = train;
        }
        module.forward(tokens)
    }
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
