//! Models exported from Python with `torch.jit.script(model).save(path)`,
//! trained by hearth with no Python at run time.

use super::{Model, ModuleTree, Unit};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tch::{CModule, Device, TchError, Tensor};

/// A TorchScript module that maps `[batch, time]` int64 tokens to
/// `[batch, time, vocab]` logits. Its parameters keep PyTorch's names
/// (`blocks.0.weight`), so saved weights load back with
/// `model.load_state_dict`. It is one opaque unit: a wrap policy sees its
/// module tree but the host cannot step inside it.
pub struct TorchScriptModel {
    module: Mutex<(CModule, bool)>,
    params: Vec<(String, Tensor)>,
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
        let module = CModule::load_on_device(path, device).map_err(|e| {
            err(format!(
                "cannot be loaded ({}); export it with torch.jit.script(model).save(path)",
                first_line(&e)
            ))
        })?;
        let mut params = module
            .named_parameters()
            .map_err(|e| err(format!("its parameters cannot be read: {}", first_line(&e))))?;
        if params.is_empty() {
            return Err(err("has no parameters to train".into()));
        }
        // The tree keeps libtorch's (declaration) order; the model lists
        // its parameters by name.
        let tree = tree_of(path, &params);
        params.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, p) in &params {
            let _ = p.set_requires_grad(true);
        }
        Ok(Self {
            module: Mutex::new((module, true)),
            params,
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
            if train {
                module.f_set_train()?;
            } else {
                module.f_set_eval()?;
            }
            *mode = train;
        }
        module.forward_ts(&[tokens])
    }
}

fn first_line(e: &TchError) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// The module tree: the script's own submodules with their classes (the last
/// part of each qualified name, `Block` for `__torch__.peer.Block`) and
/// buffers; when the file cannot be read for that, modules inferred from the
/// parameter names (`a.b.weight` → `a`, `a.b`) of class `Module`.
fn tree_of(path: &Path, params: &[(String, Tensor)]) -> ModuleTree {
    match crate::ops::jit_structure(path) {
        Ok(structure) => {
            let declared: Vec<(String, &str)> = structure
                .modules
                .iter()
                .map(|(p, c)| (p.clone(), c.as_str()))
                .collect();
            ModuleTree::with_buffers(&declared, params, &structure.buffers)
        }
        Err(e) => {
            tracing::warn!(
                "TorchScript model {}: its submodules cannot be listed ({e}); the module tree is inferred from parameter names",
                path.display()
            );
            ModuleTree::from_variables(params, "Module", &[])
        }
    }
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
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }
}
