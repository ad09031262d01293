//! A model's tensors by every name they have, and moving one of them:
//! Accelerate's `set_module_tensor_to_device` and `retie_parameters`.
//!
//! A tensor "on the disk" (Accelerate's meta device) keeps its handle in
//! the model with no data: an empty tensor of its dtype, which
//! [`dispatch_model`](super::dispatch_model) fills just before the unit
//! using it runs.

use super::sizes::is_integral;
use super::{BigModelError, MapDevice};
use crate::checkpoint::CheckpointError;
use crate::models::{Model, ModuleTree, TensorEntry};
use std::collections::HashMap;
use std::path::PathBuf;
use tch::{Device, Kind, Tensor};

/// The empty tensor a tensor "on the disk" holds: its dtype, no data.
pub(crate) fn placeholder(kind: Kind, device: Device) -> Tensor {
    Tensor::empty([0], (kind, device))
}

/// True when the handle holds no values though the tree says it has some.
pub(crate) fn is_placeholder(handle: &Tensor, shape: &[i64]) -> bool {
    handle.numel() == 0 && shape.iter().product::<i64>() != 0
}

/// A libtorch failure, its first line (libtorch appends a C++ backtrace).
pub(crate) fn torch_err(what: String) -> impl FnOnce(tch::TchError) -> BigModelError {
    move |e| BigModelError::Torch {
        what,
        message: e.to_string().lines().next().unwrap_or_default().to_string(),
    }
}

/// A model's tensors by name — parameters and buffers, a tied parameter
/// under every one of its names — and what the tree records of each.
pub(crate) struct Handles<'m> {
    tree: &'m ModuleTree,
    tensors: HashMap<String, Tensor>,
    entries: HashMap<&'m str, &'m TensorEntry>,
    /// Tied name → the name the tree lists it under.
    canonical: HashMap<&'m str, &'m str>,
}

impl<'m> Handles<'m> {
    /// The handles of `model` (built once per load: every lookup after is
    /// a hash).
    pub(crate) fn of(model: &'m dyn Model) -> Self {
        let tree = model.module_tree();
        let mut tensors: HashMap<String, Tensor> = model
            .named_parameters()
            .into_iter()
            .chain(model.named_buffers())
            .collect();
        let entries: HashMap<&str, &TensorEntry> = tree
            .tensors()
            .iter()
            .map(|t| (t.name.as_str(), t))
            .collect();
        let mut canonical = HashMap::new();
        for group in tree.ties() {
            let Some(own) = group.iter().find(|n| entries.contains_key(n.as_str())) else {
                continue;
            };
            let handle = group
                .iter()
                .find_map(|n| tensors.get(n))
                .map(Tensor::shallow_clone);
            for n in group {
                canonical.insert(n.as_str(), own.as_str());
                if let Some(h) = &handle {
                    tensors
                        .entry(n.clone())
                        .or_insert_with(|| h.shallow_clone());
                }
            }
        }
        Self {
            tree,
            tensors,
            entries,
            canonical,
        }
    }

    /// The model's tree.
    pub(crate) fn tree(&self) -> &'m ModuleTree {
        self.tree
    }

    /// True when the model has a tensor named `name`.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The name the tree lists `name` under (itself unless tied).
    pub(crate) fn canonical<'a>(&'a self, name: &'a str) -> &'a str {
        self.canonical.get(name).copied().unwrap_or(name)
    }

    /// What the tree records of `name` (a tied name gets its group's).
    pub(crate) fn entry(&self, name: &str) -> Option<&'m TensorEntry> {
        self.entries.get(self.canonical(name)).copied()
    }

    /// The tie group of `name` (just `name` when untied).
    pub(crate) fn group(&self, name: &str) -> Vec<String> {
        self.tree
            .ties()
            .iter()
            .find(|g| g.iter().any(|n| n == name))
            .cloned()
            .unwrap_or_else(|| vec![name.to_string()])
    }

    /// The handle of `name`.
    pub(crate) fn handle(&self, name: &str) -> Result<Tensor, BigModelError> {
        self.tensors
            .get(name)
            .map(Tensor::shallow_clone)
            .ok_or_else(|| BigModelError::NoSuchTensor { name: name.into() })
    }

    /// [`set_module_tensor_to_device`] on these handles.
    pub(crate) fn set(
        &self,
        name: &str,
        device: MapDevice,
        value: Option<&Tensor>,
        dtype: Option<Kind>,
    ) -> Result<(), BigModelError> {
        let mut handle = self.handle(name)?;
        let shape = self
            .entry(name)
            .map_or_else(|| handle.size(), |e| e.shape.clone());
        let cast = |kind: Kind| match dtype {
            Some(d) if !is_integral(kind) => d,
            _ => kind,
        };
        let Some(target) = device.torch_device() else {
            let kind = cast(handle.kind());
            tch::no_grad(|| handle.set_data(&placeholder(kind, Device::Cpu)));
            return Ok(());
        };
        let moving = || format!("moving `{name}` to {device}");
        let new = match value {
            Some(v) => {
                if v.size() != shape {
                    return Err(BigModelError::Checkpoint(CheckpointError::Mismatch {
                        path: PathBuf::from("(value)"),
                        name: name.into(),
                        message: format!("shape {:?} given, {:?} in the model", v.size(), shape),
                    }));
                }
                // Without a dtype, the value takes the tensor's own (as
                // PyTorch's load_state_dict converts).
                let kind = if dtype.is_some() { cast(v.kind()) } else { handle.kind() };
                v.detach()
                    .f_to_device(target)
                    .and_then(|t| t.f_to_kind(kind))
                    .map_err(torch_err(moving()))?
            }
            None if is_placeholder(&handle, &shape) => {
                return Err(BigModelError::Checkpoint(CheckpointError::State {
                    path: PathBuf::from(name),
                    message: format!(
                        "tensor `{name}` is offloaded (it holds no values here): give a value to put on {device}"
                    ),
                }))
            }
            // A move keeps the dtype (Accelerate casts only to the meta device).
            None => handle.detach().f_to_device(target).map_err(torch_err(moving()))?,
        };
        tch::no_grad(|| handle.set_data(&new));
        Ok(())
    }
}

/// Accelerate's `set_module_tensor_to_device`: the model's tensor `name`
/// (its own handle, so every module using it sees the change) moves to
/// `device`, taking `value` when given (cast to `dtype`, else to the
/// tensor's own dtype; integer tensors keep theirs). To the disk it keeps
/// no data (Accelerate's meta device), in `dtype` when given.
pub fn set_module_tensor_to_device(
    model: &dyn Model,
    name: &str,
    device: MapDevice,
    value: Option<&Tensor>,
    dtype: Option<Kind>,
) -> Result<(), BigModelError> {
    Handles::of(model).set(name, device, value, dtype)
}

/// Accelerate's `retie_parameters`: each group of tied names shares the
/// values of its first name that holds any.
pub fn retie_parameters(model: &dyn Model, ties: &[Vec<String>]) {
    let tensors = Handles::of(model).tensors;
    for group in ties {
        let handles: Vec<&Tensor> = group.iter().filter_map(|n| tensors.get(n)).collect();
        let Some(source) = handles.iter().find(|t| t.numel() > 0) else {
            continue;
        };
        let source = source.detach();
        for h in handles {
            if !h.is_set_to(&source) {
                let mut h = h.shallow_clone();
                tch::no_grad(|| h.set_data(&source));
            }
        }
    }
}
