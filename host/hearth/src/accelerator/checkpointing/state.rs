//! What a checkpoint holds: the project configuration, registered objects, the trainer's state, and the file names.

use super::pre_hooks::{self, RemovableHandle};
use crate::accelerator::scheduler::SharedScheduler;
use crate::accelerator::Accelerator;
use crate::checkpoint::{CheckpointError, TensorKey};
use crate::data::LoaderHandle;
use hearth_plugins::{CheckpointHookPlugin, Entries, HookCheckpoint};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// Where a run keeps its checkpoints (Accelerate's `ProjectConfiguration`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProjectConfiguration {
    /// The project folder.
    pub project_dir: PathBuf,
    /// Where trackers log (default: `project_dir`).
    pub logging_dir: Option<PathBuf>,
    /// `save_state()` without a folder writes
    /// `project_dir/checkpoints/checkpoint_<iteration>`.
    pub automatic_checkpoint_naming: bool,
    /// The number the next automatic checkpoint gets.
    pub iteration: u64,
    /// After a save, keep only the newest this many numbered checkpoints.
    pub total_limit: Option<usize>,
    /// `save_state` returns once the state is copied; a background thread
    /// writes it. The copy's host buffers are kept for the next save (one
    /// copy of the state held between saves, freed by `end_training`), so
    /// later saves copy into memory already in use.
    pub async_save: bool,
    /// With several machines that share no filesystem: the first process
    /// of every machine writes a whole checkpoint there, holding the
    /// generators of its machine's processes (Accelerate's
    /// `save_on_each_node`). Otherwise rank 0 writes the one checkpoint
    /// and every process puts its generators into it. Machines are told
    /// apart by [`node_name`].
    pub save_on_each_node: bool,
}

pub use hearth_comm::environment::node_name;

impl ProjectConfiguration {
    /// The folder of numbered checkpoints.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.project_dir.join("checkpoints")
    }

    /// Where trackers log: `logging_dir`, else the project folder (as
    /// Accelerate's `ProjectConfiguration.set_directories`).
    pub fn logging_dir(&self) -> &Path {
        self.logging_dir.as_deref().unwrap_or(&self.project_dir)
    }
}

/// An object saved with every checkpoint (Accelerate's
/// `register_for_checkpointing`): its state as bytes, in
/// `custom_checkpoint_<i>.bin` written by the main process, or — for an
/// object whose state differs between processes — in
/// `custom_checkpoint_<i>_<rank>.bin` written by each.
pub trait Checkpointable: Send {
    /// The state to save.
    fn state_dict(&self) -> Vec<u8>;
    /// Restores what [`state_dict`](Self::state_dict) returned.
    fn load_state_dict(&mut self, state: &[u8]) -> Result<(), String>;
    /// True when every process holds its own state (a per-process data
    /// stream, say), saved and restored per rank.
    fn per_process(&self) -> bool {
        false
    }
    /// Restores a process the checkpoint holds no state of (it was saved
    /// by fewer processes) from process 0's `state`. The default refuses,
    /// and the load fails naming the object: only an object that knows
    /// how to start a new process's share (a data stream takes its own
    /// stream at process 0's position) says yes.
    fn load_state_dict_of_process_zero(&mut self, _state: &[u8]) -> Result<(), String> {
        Err("it holds a state per process and cannot start a process that was not saved".into())
    }
}

/// The file of custom object `i` of process `rank`.
pub(super) fn custom_file(i: usize, per_process: bool, rank: usize) -> String {
    if per_process {
        format!("custom_checkpoint_{i}_{rank}.bin")
    } else {
        format!("custom_checkpoint_{i}.bin")
    }
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
    /// The `hearth launch` that started the run (see
    /// [`hearth_comm::launch_id`]), so that a restarted job resumes only
    /// from its own checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch_id: Option<String>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct SchedulerFile {
    pub(super) steps: u64,
}

#[derive(Serialize, Deserialize)]
pub(super) struct ScalerFile {
    pub(super) scale: f64,
    pub(super) growth_tracker: i64,
}

pub(super) fn keyed(models: &[Vec<(String, Tensor)>]) -> Vec<(TensorKey, Tensor)> {
    models
        .iter()
        .enumerate()
        .flat_map(|(i, named)| {
            named
                .iter()
                .map(move |(name, t)| (TensorKey::new(i, name), t.shallow_clone()))
        })
        .collect()
}

pub(super) fn hook_failed(
    path: &Path,
    hook: &CheckpointHookPlugin,
    outcome: &'static str,
    source: hearth_plugins::PluginError,
) -> CheckpointError {
    CheckpointError::Hook {
        path: path.into(),
        hook: hook.name().into(),
        outcome,
        source: Box::new(source),
    }
}

/// What prepare remembered for checkpoints.
#[derive(Default)]
pub(in crate::accelerator) struct Registered {
    pub models: Vec<Vec<(String, Tensor)>>,
    /// The names of each model's buffers (a checkpoint without them, saved
    /// before hearth saved buffers, still loads: they keep their values).
    pub buffers: Vec<std::collections::BTreeSet<String>>,
    /// Each model's sharded units (empty when it is not sharded).
    pub shards: Vec<Vec<crate::parallel::sharded::UnitShard>>,
    pub schedulers: Vec<SharedScheduler>,
    pub loaders: Vec<LoaderHandle>,
    pub custom: Vec<Arc<Mutex<dyn Checkpointable>>>,
    pub hooks: Vec<Arc<CheckpointHookPlugin>>,
    /// The Rust pre-hooks of `save_state` and `load_state`.
    pub pre_hooks: pre_hooks::PreHooks,
    /// The run's configuration (from `init_trackers`), for hooks.
    pub config: Entries,
}

pub(super) fn numbered(stem: &str, i: usize, ext: &str) -> String {
    if i == 0 {
        format!("{stem}.{ext}")
    } else {
        format!("{stem}_{i}.{ext}")
    }
}

/// A save to or load from `path` failed gathering sharded parameters.
pub(in crate::accelerator) fn gather_failed(
    path: &Path,
    e: &crate::parallel::UnitwiseError,
) -> CheckpointError {
    state_err(
        path,
        format!(
            "gathering the sharded parameters failed: {}",
            hearth_ops::error_chain(e)
        ),
    )
}

pub(in crate::accelerator) fn state_err(
    path: &Path,
    message: impl Into<String>,
) -> CheckpointError {
    CheckpointError::State {
        path: path.into(),
        message: message.into(),
    }
}

pub(super) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, CheckpointError> {
    let text = std::fs::read(path).map_err(CheckpointError::io(path))?;
    serde_json::from_slice(&text).map_err(|e| state_err(path, format!("unreadable: {e}")))
}

impl Accelerator {
    /// Saves `object` with every checkpoint, after what `prepare` registered.
    pub fn register_for_checkpointing(&mut self, object: Arc<Mutex<dyn Checkpointable>>) {
        self.registered.custom.push(object);
    }

    /// Runs `hook` around every later `save_state` and `load_state`, after
    /// the hooks registered before it (Accelerate's
    /// `register_save_state_pre_hook` and `register_load_state_pre_hook`,
    /// as one sandboxed plugin).
    pub fn register_checkpoint_hook(&mut self, hook: CheckpointHookPlugin) {
        self.registered.hooks.push(Arc::new(hook));
    }

    /// Runs `hook` in every later `save_state` before the models are
    /// written (Accelerate's `register_save_state_pre_hook`; see
    /// [`SaveStatePreHook`](super::SaveStatePreHook)) until the returned handle is dropped or removed.
    pub fn register_save_state_pre_hook(
        &self,
        hook: impl FnMut(&mut Vec<Vec<(String, Tensor)>>, &Path) + Send + 'static,
    ) -> RemovableHandle {
        self.registered.pre_hooks.add_save(Box::new(hook))
    }

    /// Runs `hook` in every later `load_state` before the models are read
    /// (Accelerate's `register_load_state_pre_hook`; see
    /// [`LoadStatePreHook`](super::LoadStatePreHook)) until the returned handle is dropped or removed.
    pub fn register_load_state_pre_hook(
        &self,
        hook: impl FnMut(&mut Vec<usize>, &Path) + Send + 'static,
    ) -> RemovableHandle {
        self.registered.pre_hooks.add_load(Box::new(hook))
    }

    /// The project configuration.
    pub fn project_configuration(&self) -> &ProjectConfiguration {
        &self.project
    }

    /// What checkpoint hooks are told about the checkpoint in `dir`.
    pub(super) fn hook_context(&self, dir: &Path, iteration: u64) -> HookCheckpoint {
        HookCheckpoint {
            name: dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            iteration,
            step: self.micro_steps.load(std::sync::atomic::Ordering::Relaxed),
            config: self.registered.config.clone(),
        }
    }

    /// [`remember_model`](Self::remember_model) for a model prepared to
    /// train: of its parameters only those that train are checkpointed. A
    /// frozen one is what the model was built from (a LoRA run's
    /// checkpoint is its adapter), and loading a checkpoint leaves it as it
    /// is.
    pub(in crate::accelerator) fn remember_trained_model(
        &mut self,
        mut state: Vec<(String, Tensor)>,
        buffers: std::collections::BTreeSet<String>,
        shards: Vec<crate::parallel::sharded::UnitShard>,
    ) {
        state.retain(|(name, t)| t.requires_grad() || buffers.contains(name));
        self.remember_model(state, buffers, shards);
    }

    /// Remembers a prepared model's `state` (parameters and buffers; the
    /// names of the buffers in `buffers`) and its sharded units.
    pub(in crate::accelerator) fn remember_model(
        &mut self,
        state: Vec<(String, Tensor)>,
        buffers: std::collections::BTreeSet<String>,
        shards: Vec<crate::parallel::sharded::UnitShard>,
    ) {
        self.registered.models.push(state);
        self.registered.buffers.push(buffers);
        self.registered.shards.push(shards);
    }

    pub(in crate::accelerator) fn remember_scheduler(&mut self, scheduler: SharedScheduler) {
        self.registered.schedulers.push(scheduler);
    }

    pub(in crate::accelerator) fn remember_loader(&mut self, loader: LoaderHandle) {
        self.registered.loaders.push(loader);
    }
}
