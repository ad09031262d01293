//! What a checkpoint holds, as owned data: the files of `save_state`
//! built from the prepared objects (a snapshot, copied off the training
//! tensors when saves are asynchronous), before `save.rs` writes them.

use super::super::{lock, Accelerator};
use super::SnapshotCopies;
use super::{
    custom_file, gather_failed, keyed, numbered, state_err, ScalerFile, SchedulerFile, TrainerState,
};
use crate::checkpoint::{CheckpointError, TensorKey};
use crate::optim::OptimizerState;
use std::path::Path;
use tch::{Device, Tensor};

/// One file of a checkpoint, owned, ready to be written (on a background
/// thread when saves are asynchronous).
pub(super) enum Part {
    Tensors(String, Vec<(String, Tensor)>),
    Bytes(String, Vec<u8>),
    Json(String, serde_json::Value),
    /// Pieces of tensors (a sharded save's file of one process).
    Pieces(String, Vec<crate::checkpoint::Piece>),
}

impl Part {
    /// The file's name.
    pub(super) fn name(&self) -> &str {
        match self {
            Part::Tensors(name, _)
            | Part::Bytes(name, _)
            | Part::Json(name, _)
            | Part::Pieces(name, _) => name,
        }
    }
}

impl Part {
    /// Bytes it takes on disk, about (tensor data and bytes exactly; headers
    /// and JSON as their text).
    pub(super) fn bytes(&self) -> u64 {
        match self {
            Part::Tensors(_, tensors) => tensors_bytes(tensors),
            Part::Bytes(_, bytes) => bytes.len() as u64,
            Part::Json(_, value) => value.to_string().len() as u64,
            Part::Pieces(_, pieces) => pieces.iter().map(|p| data_bytes(&p.name, &p.values)).sum(),
        }
    }
}

/// Bytes of the tensors' data and, about, their header entries.
fn tensors_bytes(tensors: &[(String, Tensor)]) -> u64 {
    tensors.iter().map(|(name, t)| data_bytes(name, t)).sum()
}

/// Bytes one tensor named `name` takes in a safetensors file, about.
fn data_bytes(name: &str, t: &Tensor) -> u64 {
    let header = name.len() as u64 + 64;
    header + t.numel() as u64 * t.kind().elt_size_in_bytes() as u64
}

/// Everything one checkpoint holds, owned (see [`Accelerator::snapshot`]).
pub(super) struct Snapshot {
    /// Each prepared model's tensors, by name.
    pub(super) models: Vec<Vec<(String, Tensor)>>,
    /// Every other file.
    pub(super) parts: Vec<Part>,
}

impl Snapshot {
    /// The models' tensors keyed for checkpoint hooks.
    pub(super) fn keyed(&self) -> Vec<(TensorKey, Tensor)> {
        keyed(&self.models)
    }

    /// Bytes the checkpoint's files take, about (what hooks add aside).
    pub(super) fn bytes(&self) -> u64 {
        let models: u64 = self.models.iter().map(|m| tensors_bytes(m)).sum();
        models + self.parts.iter().map(Part::bytes).sum::<u64>()
    }
}

impl Accelerator {
    /// The files process `rank` writes itself.
    pub(super) fn process_part_names(&self, rank: usize) -> Vec<String> {
        let customs = self.registered.custom.iter().enumerate();
        std::iter::once(format!("random_states_{rank}.safetensors"))
            .chain(
                customs
                    .filter(|(_, o)| lock(o).per_process())
                    .map(|(i, _)| custom_file(i, true, rank)),
            )
            .chain(self.shard_file_names(rank))
            .collect()
    }

    /// This process's own parts: its generators, per-process objects and,
    /// saving sharded, its shards.
    pub(super) fn process_parts(&self, dest: &Path) -> Result<Vec<Part>, CheckpointError> {
        let rank = self.process_index();
        let rng = self
            .rng_state()
            .map_err(|e| state_err(dest, format!("cannot read the random generators: {e}")))?;
        let mut rng_tensors = vec![("cpu".to_string(), rng.cpu)];
        rng_tensors.extend(
            rng.cuda
                .into_iter()
                .enumerate()
                .map(|(i, t)| (format!("cuda.{i}"), t)),
        );
        let mut parts = vec![Part::Tensors(
            format!("random_states_{rank}.safetensors"),
            rng_tensors,
        )];
        for (i, object) in self.registered.custom.iter().enumerate() {
            let object = lock(object);
            if object.per_process() {
                parts.push(Part::Bytes(custom_file(i, true, rank), object.state_dict()));
            }
        }
        for (name, pieces) in self.shard_pieces() {
            parts.push(Part::Pieces(name, pieces));
        }
        Ok(parts)
    }

    /// Every optimizer's whole state (a sharded one's gathered: every
    /// process takes part, the writers `keep` it).
    pub(super) fn full_optimizer_states(
        &self,
        dest: &Path,
        keep: bool,
    ) -> Result<Vec<OptimizerState>, CheckpointError> {
        self.optimizers
            .iter()
            .map(|o| {
                lock(o)
                    .inner
                    .full_state_dict(keep)
                    .map_err(|m| state_err(dest, format!("the optimizer state: {m}")))
            })
            .collect()
    }

    /// Every prepared model's parameters on the CPU (FULL_SHARD ones
    /// gathered unit by unit: every process takes part, the writers `keep`
    /// them), copied when saves are asynchronous.
    pub(super) fn whole_models(
        &self,
        dest: &Path,
        keep: bool,
        mut copies: Option<&mut SnapshotCopies<'_>>,
    ) -> Result<Vec<Vec<(String, Tensor)>>, CheckpointError> {
        let mut models = Vec::with_capacity(self.registered.models.len());
        for params in &self.registered.models {
            let mut copy_into = copies.as_deref_mut().map(|c| move |t: &Tensor| c.copy(t));
            let copy = copy_into
                .as_mut()
                .map(|f| f as &mut dyn FnMut(&Tensor) -> Tensor);
            models.push(
                self.data_parallel
                    .whole_copies(params, keep, copy)
                    .map_err(|e| gather_failed(dest, &e))?,
            );
        }
        Ok(models)
    }

    /// Everything a checkpoint holds, as owned data: the `models` given,
    /// and the rest copied (when saves are asynchronous, even tensors
    /// already on the CPU, so training can go on changing them while a
    /// background thread writes).
    pub(super) fn snapshot(
        &self,
        dest: &Path,
        models: Vec<Vec<(String, Tensor)>>,
        optimizer_states: Vec<OptimizerState>,
        mut copies: Option<&mut SnapshotCopies<'_>>,
    ) -> Result<Snapshot, CheckpointError> {
        let mut owned = |named: &[(String, Tensor)]| -> Vec<(String, Tensor)> {
            let mut own = |t: &Tensor| match copies.as_deref_mut() {
                Some(copies) => copies.copy(t),
                None => t.detach().to_device(Device::Cpu),
            };
            named.iter().map(|(n, t)| (n.clone(), own(t))).collect()
        };
        let json =
            |v: serde_json::Result<serde_json::Value>| v.expect("checkpoint JSON serialises");
        // Saving sharded, the models and the optimizer state are in the
        // processes' shard parts.
        let sharded = self.saves_sharded();
        let mut parts = Vec::new();
        for (i, state) in optimizer_states.into_iter().enumerate() {
            if !sharded {
                parts.push(Part::Tensors(
                    numbered("optimizer", i, "safetensors"),
                    owned(&state.tensors),
                ));
            }
            parts.push(Part::Json(
                numbered("optimizer", i, "json"),
                json(serde_json::to_value(&state.groups)),
            ));
        }
        for (i, sched) in self.registered.schedulers.iter().enumerate() {
            let (steps, bytes) = lock(sched).state().map_err(|e| {
                state_err(dest, format!("the scheduler could not save its state: {e}"))
            })?;
            parts.push(Part::Bytes(numbered("scheduler", i, "bin"), bytes));
            parts.push(Part::Json(
                numbered("scheduler", i, "json"),
                json(serde_json::to_value(SchedulerFile { steps })),
            ));
        }
        if let Some(scaler) = &self.scaler {
            if let Some((scale, growth_tracker)) = lock(scaler).state() {
                let file = ScalerFile {
                    scale,
                    growth_tracker,
                };
                parts.push(Part::Json(
                    "scaler.json".into(),
                    json(serde_json::to_value(file)),
                ));
            }
        }
        for (i, loader) in self.registered.loaders.iter().enumerate() {
            parts.push(Part::Json(
                numbered("dataloader", i, "json"),
                json(serde_json::to_value(loader.state())),
            ));
        }
        parts.extend(self.process_parts(dest)?);
        for (i, object) in self.registered.custom.iter().enumerate() {
            let object = lock(object);
            if !object.per_process() {
                parts.push(Part::Bytes(custom_file(i, false, 0), object.state_dict()));
            }
        }
        let trainer = TrainerState {
            iteration: self.project.iteration,
            step: self.micro_steps.load(std::sync::atomic::Ordering::Relaxed),
            accumulation_position: self.state.accumulation_position(),
            epoch: self
                .registered
                .loaders
                .first()
                .map_or(0, |l| l.state().epoch),
            launch_id: hearth_comm::launch_id(),
            hearth_version: env!("CARGO_PKG_VERSION").into(),
        };
        parts.push(Part::Json(
            "trainer_state.json".into(),
            json(serde_json::to_value(trainer)),
        ));
        Ok(Snapshot { models, parts })
    }
}
