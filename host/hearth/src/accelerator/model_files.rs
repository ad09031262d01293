//! The weights out of training, as Accelerate's `unwrap_model`,
//! `get_state_dict`, `save_model` and `save` give them: gathered whole
//! under FULL_SHARD, written on the processes that write files.

use super::{Accelerator, PreparedModel};
use crate::checkpoint::{CheckpointError, SavedModel};
use crate::models::{Model, StateDict};
use std::path::Path;
use tch::Tensor;

impl Accelerator {
    /// The model without what `prepare` wrapped around it. Under
    /// FULL_SHARD its parameters are gathered whole for good (every
    /// process must call it) and it no longer runs unit by unit.
    pub fn unwrap_model<M: Model>(&self, model: PreparedModel<M>) -> M {
        if let Some(unitwise) = model.unitwise() {
            unitwise
                .gather_all()
                .unwrap_or_else(|e| panic!("unwrap_model: {}", hearth_ops::error_chain(&e)));
            self.data_parallel.forget_unitwise(unitwise);
        }
        model.into_inner()
    }

    /// The model's parameters and buffers by name, on the CPU (what `save_model`
    /// writes; `get_state_dict`). Under FULL_SHARD they are gathered and
    /// copied unit by unit (never more than one unit whole beyond what
    /// training holds): every process must call it.
    pub fn get_state_dict(&self, model: &(impl StateDict + ?Sized)) -> Vec<(String, Tensor)> {
        self.data_parallel
            .whole_copies(&model.state_dict(), true, None)
            .unwrap_or_else(|e| panic!("get_state_dict: {}", hearth_ops::error_chain(&e)))
    }

    /// Writes the model's weights into `dir` on the main process
    /// (Accelerate's `save_model`): `model.safetensors`, or shards of at
    /// most `max_shard_size` bytes with their index (see
    /// [`crate::checkpoint::save_model`]). Other processes write nothing and
    /// get `None` (under FULL_SHARD every process must call it: the
    /// parameters are gathered). `model` is a [`Model`] or a tch
    /// `VarStore` (`acc.save_model(&vs, dir, u64::MAX)`).
    pub fn save_model(
        &self,
        model: &(impl StateDict + ?Sized),
        dir: &Path,
        max_shard_size: u64,
    ) -> Result<Option<SavedModel>, CheckpointError> {
        self.save_model_named(model, dir, max_shard_size, str::to_string)
    }

    /// [`save_model`](Self::save_model) with each tensor saved under
    /// `name(its name in the model)`: a fine-tuned model under the names of
    /// the pretrained weights it started from.
    pub fn save_model_named(
        &self,
        model: &(impl StateDict + ?Sized),
        dir: &Path,
        max_shard_size: u64,
        name: impl Fn(&str) -> String,
    ) -> Result<Option<SavedModel>, CheckpointError> {
        let main = self.is_main_process();
        let state = model.state_dict();
        if !self.data_parallel.full_shards().is_empty() {
            return self.save_model_streamed(&state, dir, max_shard_size, name);
        }
        let tensors = self
            .data_parallel
            .whole_copies(&state, main, None)
            .map_err(|e| super::checkpointing::gather_failed(dir, &e))?;
        if !main {
            return Ok(None);
        }
        let tensors: Vec<(String, Tensor)> =
            tensors.into_iter().map(|(n, t)| (name(&n), t)).collect();
        crate::checkpoint::save_model(dir, &tensors, max_shard_size).map(Some)
    }

    /// [`save_model_named`](Self::save_model_named) of a FULL_SHARD model:
    /// the files are written tensor by tensor, each unit gathered when the
    /// writer gets to its first tensor and released after its last, so no
    /// process holds the whole model (every process takes part in the same
    /// gathers, in the order the writer fetches them).
    fn save_model_streamed(
        &self,
        state: &[(String, Tensor)],
        dir: &Path,
        max_shard_size: u64,
        name: impl Fn(&str) -> String,
    ) -> Result<Option<SavedModel>, CheckpointError> {
        use crate::checkpoint::TensorMeta;
        let gather_failed = |e| super::checkpointing::gather_failed(dir, &e);
        let shapes = self.data_parallel.whole_shapes();
        let metas: Vec<TensorMeta> = state
            .iter()
            .map(|(n, t)| match shapes.get(n) {
                Some((kind, shape)) => TensorMeta {
                    name: name(n),
                    kind: *kind,
                    shape: shape.clone(),
                },
                None => TensorMeta::of(&name(n), t),
            })
            .collect();
        let order = crate::checkpoint::write_order(&metas, max_shard_size)?;
        let mut stream = self.data_parallel.whole_stream(state);
        let saved = match self.is_main_process() {
            true => Some(crate::checkpoint::save_model_from(
                dir,
                &metas,
                max_shard_size,
                &mut |j| stream.get(j).map_err(gather_failed),
            )),
            false => None,
        };
        // Whatever the writer got to, every process ends the same gathers.
        stream.finish(&order).map_err(gather_failed)?;
        saved.transpose()
    }

    /// Writes `tensors` to `path` (safetensors with `{"format": "pt"}`,
    /// atomically) on the main process — with the project's
    /// `save_on_each_node`, on the first process of every machine
    /// (Accelerate's `accelerator.save(obj, f, safe_serialization=True)`);
    /// other processes write nothing and return `false`.
    pub fn save(&self, tensors: &[(String, Tensor)], path: &Path) -> Result<bool, CheckpointError> {
        if !self.saves_files() {
            return Ok(false);
        }
        crate::checkpoint::save_safetensors(path, tensors)?;
        Ok(true)
    }

    /// Writes any serialisable `object` to `path` as JSON, atomically, on
    /// the processes [`save`](Self::save) writes on (Accelerate's
    /// `accelerator.save(obj, f)` for an object that is not tensors, which
    /// it pickles; hearth writes JSON, readable by any language).
    pub fn save_object<T: serde::Serialize + ?Sized>(
        &self,
        object: &T,
        path: &Path,
    ) -> Result<bool, CheckpointError> {
        if !self.saves_files() {
            return Ok(false);
        }
        let json = serde_json::to_vec_pretty(object).map_err(|e| CheckpointError::State {
            path: path.into(),
            message: format!("cannot be written as JSON: {e}"),
        })?;
        hearth_ops::durable::write_atomically(path, |f| std::io::Write::write_all(f, &json))
            .map_err(CheckpointError::io(path))?;
        Ok(true)
    }

    /// Whether this process writes what [`save`](Self::save) is given: the
    /// main process, or the first of each machine with `save_on_each_node`.
    fn saves_files(&self) -> bool {
        self.is_main_process() || (self.project.save_on_each_node && self.is_local_main_process())
    }
}
