//! `save_state` / `load_state`: everything a run needs to continue exactly
//! where it stopped, in Accelerate's layout with safetensors and JSON in
//! place of pickle, written as a complete folder or not at all.
//!
//! A checkpoint folder holds `model.safetensors` (`model_1.safetensors`, …
//! per prepared model), `optimizer.safetensors` + `optimizer.json`
//! (`optimizer_1…`), `scheduler.bin` + `scheduler.json` (the plugin's own
//! state and the step count), `scaler.json` (fp16), `dataloader.json`
//! (`dataloader_1…`: epoch, batches taken, seed), `random_states_0.safetensors`
//! (CPU and CUDA generators), `custom_checkpoint_<i>.bin` for objects given
//! to `register_for_checkpointing`, `trainer_state.json` and, written last,
//! `hearth_checkpoint.json` (the manifest that marks it complete).

use super::scheduler::SharedScheduler;
use super::{Accelerator, RngState};
use crate::checkpoint::{
    load_checkpoint_in_model, load_safetensors, newest_complete, rotate, verify_complete,
    CheckpointError, StagedCheckpoint,
};
use crate::data::{LoaderHandle, LoaderState};
use crate::optim::{GroupState, OptimizerState};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::{Device, Tensor};

/// Where a run keeps its checkpoints (Accelerate's `ProjectConfiguration`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProjectConfiguration {
    /// The project folder.
    pub project_dir: PathBuf,
    /// `save_state()` without a folder writes
    /// `project_dir/checkpoints/checkpoint_<iteration>`.
    pub automatic_checkpoint_naming: bool,
    /// The number the next automatic checkpoint gets.
    pub iteration: u64,
    /// After a save, keep only the newest this many numbered checkpoints.
    pub total_limit: Option<usize>,
}

impl ProjectConfiguration {
    /// The folder of numbered checkpoints.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.project_dir.join("checkpoints")
    }
}

/// An object saved with every checkpoint (Accelerate's
/// `register_for_checkpointing`): its state as bytes, in
/// `custom_checkpoint_<i>.bin`.
pub trait Checkpointable: Send {
    /// The state to save.
    fn state_dict(&self) -> Vec<u8>;
    /// Restores what [`state_dict`](Self::state_dict) returned.
    fn load_state_dict(&mut self, state: &[u8]) -> Result<(), String>;
}

/// What the accelerator saves besides the objects it prepared.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// The checkpoint's number (automatic naming) or the save count.
    pub iteration: u64,
    /// Micro-batches run through `accumulate`.
    pub step: u64,
    /// The position inside the accumulation group.
    pub accumulation_position: usize,
    /// The first prepared loader's epoch, for people reading the file.
    pub epoch: u64,
    /// The hearth version that wrote it.
    pub hearth_version: String,
}

#[derive(Serialize, Deserialize)]
struct SchedulerFile {
    steps: u64,
}

#[derive(Serialize, Deserialize)]
struct ScalerFile {
    scale: f64,
    growth_tracker: i64,
}

/// What prepare remembered for checkpoints.
#[derive(Default)]
pub(super) struct Registered {
    pub models: Vec<Vec<(String, Tensor)>>,
    pub schedulers: Vec<SharedScheduler>,
    pub loaders: Vec<LoaderHandle>,
    pub custom: Vec<Arc<Mutex<dyn Checkpointable>>>,
}

fn numbered(stem: &str, i: usize, ext: &str) -> String {
    if i == 0 {
        format!("{stem}.{ext}")
    } else {
        format!("{stem}_{i}.{ext}")
    }
}

fn state_err(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::State {
        path: path.into(),
        message: message.into(),
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, CheckpointError> {
    let text = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.into(),
        source,
    })?;
    serde_json::from_slice(&text).map_err(|e| state_err(path, format!("unreadable: {e}")))
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Accelerator {
    /// Saves `object` with every checkpoint, after what `prepare` registered.
    pub fn register_for_checkpointing(&mut self, object: Arc<Mutex<dyn Checkpointable>>) {
        self.registered.custom.push(object);
    }

    /// The project configuration.
    pub fn project_configuration(&self) -> &ProjectConfiguration {
        &self.project
    }

    /// Saves the state of everything prepared (models, optimizers,
    /// schedulers, the fp16 scaler, data loaders), the random generators and
    /// registered objects into `dir`, or — with `None` and automatic naming —
    /// into `checkpoints/checkpoint_<iteration>` of the project, then keeps
    /// the newest `total_limit` of those. The folder appears complete or not
    /// at all; an existing folder is never overwritten. Save after a
    /// synchronising micro-batch: gradients are not saved.
    pub fn save_state(&mut self, dir: Option<&Path>) -> Result<PathBuf, CheckpointError> {
        let automatic = dir.is_none();
        let dest = match dir {
            Some(d) => d.to_path_buf(),
            None if self.project.automatic_checkpoint_naming => self
                .project
                .checkpoints_dir()
                .join(format!("checkpoint_{}", self.project.iteration)),
            None => {
                return Err(state_err(
                    &self.project.project_dir,
                    "save_state() without a folder needs automatic_checkpoint_naming in the project configuration",
                ))
            }
        };
        let mut staged = StagedCheckpoint::begin(&dest)?;
        for (i, model) in self.registered.models.iter().enumerate() {
            let cpu: Vec<(String, Tensor)> = model
                .iter()
                .map(|(n, t)| (n.clone(), t.detach().to_device(Device::Cpu)))
                .collect();
            staged.tensors(&numbered("model", i, "safetensors"), &cpu)?;
        }
        for (i, opt) in self.optimizers.iter().enumerate() {
            let state = lock(opt).inner.state_dict();
            staged.tensors(&numbered("optimizer", i, "safetensors"), &state.tensors)?;
            staged.json(&numbered("optimizer", i, "json"), &state.groups)?;
        }
        for (i, sched) in self.registered.schedulers.iter().enumerate() {
            let (steps, bytes) = lock(sched).state().map_err(|e| {
                state_err(
                    &dest,
                    format!("the scheduler could not save its state: {e}"),
                )
            })?;
            staged.bytes(&numbered("scheduler", i, "bin"), &bytes)?;
            staged.json(&numbered("scheduler", i, "json"), &SchedulerFile { steps })?;
        }
        if let Some(scaler) = &self.scaler {
            if let Some((scale, growth_tracker)) = lock(scaler).state() {
                staged.json(
                    "scaler.json",
                    &ScalerFile {
                        scale,
                        growth_tracker,
                    },
                )?;
            }
        }
        for (i, loader) in self.registered.loaders.iter().enumerate() {
            staged.json(&numbered("dataloader", i, "json"), &loader.state())?;
        }
        let rng = self
            .rng_state()
            .map_err(|e| state_err(&dest, format!("cannot read the random generators: {e}")))?;
        let mut rng_tensors = vec![("cpu".to_string(), rng.cpu)];
        rng_tensors.extend(
            rng.cuda
                .into_iter()
                .enumerate()
                .map(|(i, t)| (format!("cuda.{i}"), t)),
        );
        staged.tensors(
            &format!("random_states_{}.safetensors", self.process_index()),
            &rng_tensors,
        )?;
        for (i, object) in self.registered.custom.iter().enumerate() {
            staged.bytes(
                &format!("custom_checkpoint_{i}.bin"),
                &lock(object).state_dict(),
            )?;
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
            hearth_version: env!("CARGO_PKG_VERSION").into(),
        };
        staged.json("trainer_state.json", &trainer)?;
        let saved = staged.commit()?;
        self.project.iteration += 1;
        if automatic {
            if let Some(limit) = self.project.total_limit {
                rotate(&self.project.checkpoints_dir(), limit)?;
            }
        }
        Ok(saved)
    }

    /// Restores a checkpoint written by [`save_state`](Self::save_state)
    /// from `dir`, or — with `None` — the newest complete one of the
    /// project (incomplete ones are skipped with a warning), and continues
    /// the iteration count after it. Every prepared object must have its
    /// counterpart in the checkpoint; nothing is restored when the
    /// checkpoint is incomplete or a model's tensors do not fit.
    pub fn load_state(&mut self, dir: Option<&Path>) -> Result<PathBuf, CheckpointError> {
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None => {
                let folder = self.project.checkpoints_dir();
                newest_complete(&folder)
                    .map(|(_, d)| d)
                    .ok_or(CheckpointError::NotFound(folder))?
            }
        };
        verify_complete(&dir)?;
        let trainer: TrainerState = read_json(&dir.join("trainer_state.json"))?;
        // Models first: their load checks everything before writing.
        for (i, model) in self.registered.models.iter().enumerate() {
            load_checkpoint_in_model(model, &dir.join(numbered("model", i, "safetensors")), true)?;
        }
        for (i, opt) in self.optimizers.iter().enumerate() {
            let path = dir.join(numbered("optimizer", i, "safetensors"));
            let groups: Vec<GroupState> = read_json(&dir.join(numbered("optimizer", i, "json")))?;
            let state = OptimizerState {
                tensors: load_safetensors(&path, Device::Cpu)?,
                groups,
            };
            lock(opt)
                .inner
                .load_state_dict(&state)
                .map_err(|m| state_err(&path, m))?;
        }
        for (i, sched) in self.registered.schedulers.iter().enumerate() {
            let path = dir.join(numbered("scheduler", i, "bin"));
            let bytes = std::fs::read(&path).map_err(|source| CheckpointError::Io {
                path: path.clone(),
                source,
            })?;
            let file: SchedulerFile = read_json(&dir.join(numbered("scheduler", i, "json")))?;
            lock(sched)
                .load_state(file.steps, &bytes)
                .map_err(|e| state_err(&path, format!("the scheduler refused its state: {e}")))?;
        }
        if let Some(scaler) = &self.scaler {
            let path = dir.join("scaler.json");
            if path.exists() {
                let s: ScalerFile = read_json(&path)?;
                lock(scaler).load_state(s.scale, s.growth_tracker, self.device);
            }
        }
        for (i, loader) in self.registered.loaders.iter().enumerate() {
            let state: LoaderState = read_json(&dir.join(numbered("dataloader", i, "json")))?;
            loader.load_state(state);
        }
        let path = dir.join(format!(
            "random_states_{}.safetensors",
            self.process_index()
        ));
        let tensors = load_safetensors(&path, Device::Cpu)?;
        let find = |name: &str| {
            tensors
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t.shallow_clone())
        };
        let rng = RngState {
            cpu: find("cpu").ok_or_else(|| state_err(&path, "holds no `cpu` generator state"))?,
            cuda: (0..).map_while(|i| find(&format!("cuda.{i}"))).collect(),
        };
        self.set_rng_state(&rng)
            .map_err(|e| state_err(&path, format!("cannot restore the generators: {e}")))?;
        for (i, object) in self.registered.custom.iter().enumerate() {
            let path = dir.join(format!("custom_checkpoint_{i}.bin"));
            let bytes = std::fs::read(&path).map_err(|source| CheckpointError::Io {
                path: path.clone(),
                source,
            })?;
            lock(object)
                .load_state_dict(&bytes)
                .map_err(|m| state_err(&path, m))?;
        }
        self.micro_steps
            .store(trainer.step, std::sync::atomic::Ordering::Relaxed);
        self.state
            .set_accumulation_position(trainer.accumulation_position);
        self.project.iteration = trainer.iteration + 1;
        Ok(dir)
    }

    pub(super) fn remember_model(&mut self, params: Vec<(String, Tensor)>) {
        self.registered.models.push(params);
    }

    pub(super) fn remember_scheduler(&mut self, scheduler: SharedScheduler) {
        self.registered.schedulers.push(scheduler);
    }

    pub(super) fn remember_loader(&mut self, loader: LoaderHandle) {
        self.registered.loaders.push(loader);
    }
}
