//! A TorchScript model loaded without reading its weights: they are read
//! from the file, or from an `init-from` plan, when `prepare` asks
//! ([`crate::models::Model::materialize`]), one FSDP unit at a time for a
//! model it shards.

use super::model::{cannot_load, first_line, Fusing, TorchScriptError, TorchScriptModel, Unread};
use crate::checkpoint::pretrained::InitPlan;
use crate::models::{Model, Weights};
use hearth_ops::ScriptModule;
use std::path::Path;
use tch::{Device, Tensor};

impl TorchScriptModel {
    /// [`load_with`](Self::load_with) on the CPU without reading the
    /// weights: every tensor is allocated but takes no memory until
    /// [`Model::materialize`] reads it (from the file, or from the
    /// `init-from` plan given by [`Model::defer_init`]), which `prepare`
    /// does one FSDP unit at a time for a model it shards, so that no
    /// process holds the whole model. Buffers are read at once. With
    /// `weights` unmaterialised the parameters are never read here (rank
    /// 0's arrive when the model is prepared).
    pub fn load_lazily(
        path: &Path,
        fuse: bool,
        weights: Weights,
    ) -> Result<Self, TorchScriptError> {
        let (module, file) = ScriptModule::load_lazy(path).map_err(|e| cannot_load(path, &e))?;
        let unread = Unread {
            file,
            init: Default::default(),
            receives: weights == Weights::Unmaterialised,
            read: Default::default(),
        };
        let fusing = if fuse { Fusing::On } else { Fusing::Off };
        let model = Self::from_module(module, path, Device::Cpu, fusing, Some(unread))?;
        for (_, b) in &model.buffers {
            model.read_unread(b).map_err(|message| TorchScriptError {
                path: path.into(),
                message,
            })?;
        }
        Ok(model)
    }

    /// Reads `t`'s bytes from the file when they are still there.
    pub(super) fn read_unread(&self, t: &Tensor) -> Result<(), String> {
        match &self.unread {
            Some(unread) => unread.file.read(t).map(|_| ()).map_err(|e| first_line(&e)),
            None => Ok(()),
        }
    }

    /// [`Model::materialize`]: reads what was left in the file, or in the
    /// `init-from` plan, of the tensors `names` (all for `None`).
    pub(super) fn read_weights(&self, names: Option<&[String]>) -> Result<(), String> {
        let Some(unread) = &self.unread else {
            return Ok(());
        };
        let done = unread.read.borrow().clone();
        let wanted =
            |n: &str| !done.contains(n) && names.is_none_or(|names| names.iter().any(|w| w == n));
        let state = self.named_state();
        let init = unread.init.borrow();
        if let (Some((plan, _)), false) = (&*init, unread.receives) {
            plan.load_where(&state, wanted).map_err(|e| {
                format!(
                    "{}: reading init-from weights: {}",
                    self.path.display(),
                    hearth_ops::error_chain(&e)
                )
            })?;
        }
        let covered = |n: &str| init.as_ref().is_some_and(|(_, names)| names.contains(n));
        let buffer = |n: &str| self.buffers.iter().any(|(b, _)| b == n);
        for (name, t) in &state {
            // cpu-ram-efficient-loading's receivers read buffers only.
            let read_here = buffer(name) || !unread.receives;
            if read_here && wanted(name) && !covered(name) {
                self.read_unread(t)
                    .map_err(|e| format!("{}: reading {name}: {e}", self.path.display()))?;
            }
        }
        let mut read = unread.read.borrow_mut();
        read.extend(state.iter().map(|(n, _)| n).filter(|n| wanted(n)).cloned());
        Ok(())
    }
    /// [`Model::defer_init`]: a lazily loaded model reads `init` later.
    pub(super) fn read_init_from(&self, init: InitPlan) -> Option<InitPlan> {
        let Some(unread) = &self.unread else {
            return Some(init);
        };
        let covered = init.file_names(&self.named_state()).into_keys().collect();
        *unread.init.borrow_mut() = Some((init, covered));
        None
    }
}
