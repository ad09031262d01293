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
//!
//! Checkpoint hooks (Wasm plugins, [`Accelerator::register_checkpoint_hook`])
//! run inside that transaction: `save` before the host writes (a hook may
//! write files and claim model tensors it saved itself), `seal` after every
//! file is written and before the commit, `load` before anything is
//! restored. A hook that fails abandons the save or the load.

use super::scheduler::SharedScheduler;
use super::{lock, Accelerator, RngState};
use crate::checkpoint::{
    load_checkpoint_in_model, load_safetensors, model_shards_dir, newest_complete,
    optimizer_shards_dir, rotate, verify_complete, CheckpointError, StagedCheckpoint, TensorKey,
};
use crate::data::{LoaderHandle, LoaderState};
use crate::optim::{GroupState, OptimizerState};
use crate::plugins::{CheckpointHookPlugin, Entries, HookCheckpoint};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::{Device, Tensor};

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
    /// writes it.
    pub async_save: bool,
    /// With several machines that share no filesystem: the first process
    /// of every machine writes a whole checkpoint there, holding the
    /// generators of its machine's processes (Accelerate's
    /// `save_on_each_node`). Otherwise rank 0 writes the one checkpoint
    /// and every process puts its generators into it. Machines are told
    /// apart by [`node_name`].
    pub save_on_each_node: bool,
}

/// The name that tells this process's machine from the others for
/// `save_on_each_node`: `HEARTH_NODE_NAME` when set, else the host name.
pub fn node_name() -> String {
    if let Some(name) = std::env::var("HEARTH_NODE_NAME")
        .ok()
        .filter(|n| !n.is_empty())
    {
        return name;
    }
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "localhost".into()
    }
}

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
}

/// The file of custom object `i` of process `rank`.
fn custom_file(i: usize, per_process: bool, rank: usize) -> String {
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

/// One file of a checkpoint, owned, ready to be written (on a background
/// thread when saves are asynchronous).
enum Part {
    Tensors(String, Vec<(String, Tensor)>),
    Bytes(String, Vec<u8>),
    Json(String, serde_json::Value),
    /// Pieces of tensors (a sharded save's file of one process).
    Pieces(String, Vec<crate::checkpoint::Piece>),
}

impl Part {
    /// The file's name.
    fn name(&self) -> &str {
        match self {
            Part::Tensors(name, _)
            | Part::Bytes(name, _)
            | Part::Json(name, _)
            | Part::Pieces(name, _) => name,
        }
    }
}

/// Everything one checkpoint holds, owned (see [`Accelerator::snapshot`]).
struct Snapshot {
    /// Each prepared model's tensors, by name.
    models: Vec<Vec<(String, Tensor)>>,
    /// Every other file.
    parts: Vec<Part>,
}

impl Snapshot {
    /// The models' tensors keyed for checkpoint hooks.
    fn keyed(&self) -> Vec<(TensorKey, Tensor)> {
        keyed(&self.models)
    }
}

fn keyed(models: &[Vec<(String, Tensor)>]) -> Vec<(TensorKey, Tensor)> {
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

fn hook_failed(
    path: &Path,
    hook: &CheckpointHookPlugin,
    outcome: &'static str,
    source: crate::plugins::PluginError,
) -> CheckpointError {
    CheckpointError::Hook {
        path: path.into(),
        hook: hook.name().into(),
        outcome,
        source: Box::new(source),
    }
}

/// Runs the hooks' `save`, writes what they did not claim, runs their
/// `seal` and commits. Any failure drops `staged`, which removes it.
fn write_checkpoint(
    mut staged: StagedCheckpoint,
    snapshot: Snapshot,
    hooks: &[Arc<CheckpointHookPlugin>],
    context: &HookCheckpoint,
) -> Result<PathBuf, CheckpointError> {
    const NOT_SAVED: &str = "saved (the previous checkpoint is untouched)";
    let dest = staged.destination().to_path_buf();
    let keyed = snapshot.keyed();
    // What hearth will write: no hook may leave anything under these names.
    let reserved: Vec<String> = (0..snapshot.models.len())
        .map(|i| numbered("model", i, "safetensors"))
        .chain(snapshot.parts.iter().map(|p| p.name().to_string()))
        .collect();
    let misbehaved = |hook: &CheckpointHookPlugin, what: &str, message: String| {
        let source = crate::plugins::PluginError::Runtime {
            name: hook.name().into(),
            message: format!("{what} {message}"),
        };
        hook_failed(&dest, hook, NOT_SAVED, source)
    };
    let mut claimed_by: BTreeMap<TensorKey, &str> = BTreeMap::new();
    let mut active = Vec::with_capacity(hooks.len());
    for hook in hooks {
        let save = hook
            .save(staged.folder(), context, &keyed)
            .map_err(|e| hook_failed(&dest, hook, NOT_SAVED, e))?;
        staged
            .check_foreign(&reserved)
            .map_err(|m| misbehaved(hook, "save", m))?;
        for key in save.claimed() {
            if let Some(first) = claimed_by.insert(key.clone(), hook.name()) {
                return Err(state_err(
                    &dest,
                    format!(
                        "checkpoint hooks `{first}` and `{}` both claimed tensor {key}; configure them to save different tensors",
                        hook.name()
                    ),
                ));
            }
        }
        staged.record_hook(hook.name(), save.claimed().to_vec());
        active.push((hook, save));
    }
    for (i, model) in snapshot.models.into_iter().enumerate() {
        let kept: Vec<(String, Tensor)> = model
            .into_iter()
            .filter(|(name, _)| !claimed_by.contains_key(&TensorKey::new(i, name)))
            .collect();
        staged.tensors(&numbered("model", i, "safetensors"), &kept)?;
    }
    for part in snapshot.parts {
        match part {
            Part::Tensors(name, tensors) => staged.tensors(&name, &tensors)?,
            Part::Bytes(name, bytes) => staged.bytes(&name, &bytes)?,
            Part::Json(name, value) => staged.json(&name, &value)?,
            Part::Pieces(name, pieces) => {
                write_pieces(staged.folder(), &name, &pieces)?;
                staged.adopt(&name)?;
            }
        }
    }
    for (hook, save) in active {
        save.seal()
            .map_err(|e| hook_failed(&dest, hook, NOT_SAVED, e))?;
        staged
            .check_foreign(&[])
            .map_err(|m| misbehaved(hook, "seal", m))?;
    }
    staged.commit()
}

/// Writes `pieces` as `name` (a path inside `folder`, whose folders are
/// created).
fn write_pieces(
    folder: &Path,
    name: &str,
    pieces: &[crate::checkpoint::Piece],
) -> Result<(), CheckpointError> {
    let path = folder.join(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(CheckpointError::io(parent))?;
    }
    crate::checkpoint::save_pieces(&path, pieces)
}

/// What prepare remembered for checkpoints.
#[derive(Default)]
pub(super) struct Registered {
    pub models: Vec<Vec<(String, Tensor)>>,
    /// Each model's sharded units (empty when it is not sharded).
    pub shards: Vec<Vec<crate::parallel::sharded::UnitShard>>,
    pub schedulers: Vec<SharedScheduler>,
    pub loaders: Vec<LoaderHandle>,
    pub custom: Vec<Arc<Mutex<dyn Checkpointable>>>,
    pub hooks: Vec<Arc<CheckpointHookPlugin>>,
    /// The run's configuration (from `init_trackers`), for hooks.
    pub config: Entries,
}

fn numbered(stem: &str, i: usize, ext: &str) -> String {
    if i == 0 {
        format!("{stem}.{ext}")
    } else {
        format!("{stem}_{i}.{ext}")
    }
}

pub(super) fn state_err(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::State {
        path: path.into(),
        message: message.into(),
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, CheckpointError> {
    let text = std::fs::read(path).map_err(CheckpointError::io(path))?;
    serde_json::from_slice(&text).map_err(|e| state_err(path, format!("unreadable: {e}")))
}

impl Accelerator {
    /// FULL_SHARD models' whole parameters, gathered for a save to or a
    /// load from `dir` (a failure names it).
    fn summon_for(&self, dir: &Path) -> Result<super::ddp::Summoned, CheckpointError> {
        self.ddp.summon().map_err(|e| {
            state_err(
                dir,
                format!(
                    "gathering the sharded parameters failed: {}",
                    crate::error_chain(&e)
                ),
            )
        })
    }

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
    ///
    /// With `async_save` in the project configuration it returns once the
    /// state is copied off the training tensors; a background thread writes
    /// and commits. A second save, `load_state`, `wait_for_checkpoint`,
    /// `end_training` and dropping the accelerator wait for it first, and a
    /// failure of the background write is returned by the next of those
    /// calls (the previous checkpoint is untouched either way).
    pub fn save_state(&mut self, dir: Option<&Path>) -> Result<PathBuf, CheckpointError> {
        let waited = self.wait_for_checkpoint();
        if (self.sharded_optimizers() || self.saves_sharded()) && self.num_processes() > 1 {
            // The gathers below are collectives: every process goes on, or none.
            let mine = waited.as_ref().map(|_| ()).map_err(|e| format!("{e:#}"));
            let all = self.gather_object(&mine).map_err(|e| {
                state_err(
                    &self.project.project_dir,
                    format!("the processes could not agree: {e}"),
                )
            })?;
            if let Some((rank, Err(m))) = all.iter().enumerate().find(|(_, r)| r.is_err()) {
                waited?;
                return Err(state_err(
                    &self.project.project_dir,
                    format!("rank {rank}'s previous checkpoint failed: {m}"),
                ));
            }
        }
        waited?;
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
        self.check_sharded_save(&dest)?;
        // SHARDED_STATE_DICT: each process writes its own shards.
        // Otherwise the state is whole: a sharded optimizer's gathered, and
        // FULL_SHARD's parameters too (by every process; released once the
        // snapshot holds them).
        let (optimizer_states, models) = if self.saves_sharded() {
            (self.optimizer_groups(), Vec::new())
        } else {
            let me = self.process_index();
            let writes = self
                .checkpoint_writers()
                .map_err(|e| state_err(&dest, format!("the processes could not agree: {e}")))?[me]
                == me;
            let optimizers = self.full_optimizer_states(&dest, writes)?;
            (optimizers, self.whole_models(&dest, writes)?)
        };
        let Some(staged) = self.stage(&dest)? else {
            // A process that writes no checkpoint: its part is written.
            self.project.iteration += 1;
            return Ok(dest);
        };
        let snapshot = self.snapshot(&dest, models, optimizer_states)?;
        let context = self.hook_context(&dest, self.project.iteration);
        let hooks = self.registered.hooks.clone();
        self.project.iteration += 1;
        let rotation = (automatic && self.project.total_limit.is_some()).then(|| {
            (
                self.project.checkpoints_dir(),
                self.project.total_limit.unwrap_or(0),
            )
        });
        let write = move || -> Result<PathBuf, CheckpointError> {
            let saved = write_checkpoint(staged, snapshot, &hooks, &context)?;
            if let Some((folder, limit)) = rotation {
                rotate(&folder, limit)?;
            }
            Ok(saved)
        };
        if self.project.async_save {
            let handle = std::thread::Builder::new()
                .name("hearth-checkpoint".into())
                .spawn(write)
                .map_err(CheckpointError::io(&dest))?;
            self.pending_save = Some(handle);
            Ok(dest)
        } else {
            write()
        }
    }

    /// Starts the checkpoint `dest`. In a world of one that is all; with
    /// several processes, the writers (rank 0, or the first process of
    /// each machine with `save_on_each_node`) stage a folder, every other
    /// process writes its own parts (its generators, per-process objects)
    /// into its writer's, and all learn whether every process succeeded.
    /// Returns the staged checkpoint, holding its processes' parts, on a
    /// writer, `None` on the others.
    fn stage(&self, dest: &Path) -> Result<Option<StagedCheckpoint>, CheckpointError> {
        if self.num_processes() == 1 {
            return StagedCheckpoint::begin(dest).map(Some);
        }
        let disagree = |e: crate::dist::DistError| {
            state_err(dest, format!("the processes could not agree: {e}"))
        };
        let me = self.process_index();
        let writers = self.checkpoint_writers().map_err(disagree)?;
        let staged = (writers[me] == me).then(|| StagedCheckpoint::begin(dest));
        let folder: Result<PathBuf, String> = match &staged {
            Some(Ok(s)) => Ok(s.folder().to_path_buf()),
            Some(Err(e)) => Err(e.to_string()),
            None => Ok(PathBuf::new()),
        };
        let folders = self.gather_object(&folder).map_err(disagree)?;
        let written: Result<(), String> = match &folders[writers[me]] {
            Ok(folder) if staged.is_none() => self
                .write_process_parts(folder, dest)
                .map_err(|e| format!("{e:#}")),
            _ => Ok(()),
        };
        let all = self.gather_object(&written).map_err(disagree)?;
        if let Some((writer, Err(m))) = folders.iter().enumerate().find(|(_, f)| f.is_err()) {
            return match staged {
                Some(Err(e)) if writer == me => Err(e),
                _ => Err(state_err(
                    dest,
                    format!("rank {writer} could not start it: {m}"),
                )),
            };
        }
        if let Some((rank, Err(m))) = all.iter().enumerate().find(|(_, w)| w.is_err()) {
            return Err(state_err(
                dest,
                format!("rank {rank} could not write its part, so nothing was saved (the previous checkpoint is untouched): {m}"),
            ));
        }
        let Some(mut staged) = staged.transpose()? else {
            return Ok(None);
        };
        let mine = (0..self.num_processes()).filter(|&r| r != me && writers[r] == me);
        for rank in mine {
            for name in self.process_part_names(rank) {
                staged.adopt(&name)?;
            }
        }
        Ok(Some(staged))
    }

    /// For each rank, the rank that writes the checkpoint its parts go
    /// into: rank 0, or with `save_on_each_node` the first rank on the
    /// same machine.
    fn checkpoint_writers(&self) -> Result<Vec<usize>, crate::dist::DistError> {
        if !self.project.save_on_each_node {
            return Ok(vec![0; self.num_processes()]);
        }
        let names = self.gather_object(&node_name())?;
        Ok(names
            .iter()
            .map(|n| names.iter().position(|m| m == n).unwrap_or(0))
            .collect())
    }

    /// The files process `rank` writes itself.
    fn process_part_names(&self, rank: usize) -> Vec<String> {
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
    fn process_parts(&self, dest: &Path) -> Result<Vec<Part>, CheckpointError> {
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

    /// Writes this process's own parts into the main process's staging
    /// `folder` (each file atomically and durably).
    fn write_process_parts(&self, folder: &Path, dest: &Path) -> Result<(), CheckpointError> {
        for part in self.process_parts(dest)? {
            match part {
                Part::Tensors(name, tensors) => {
                    crate::checkpoint::save_safetensors(&folder.join(name), &tensors)?
                }
                Part::Bytes(name, bytes) => {
                    let path = folder.join(name);
                    crate::durable::write_atomically(&path, |f| {
                        std::io::Write::write_all(f, &bytes)
                    })
                    .map_err(CheckpointError::io(&path))?
                }
                Part::Pieces(name, pieces) => write_pieces(folder, &name, &pieces)?,
                Part::Json(..) => unreachable!("a process's own parts are tensors and bytes"),
            }
        }
        Ok(())
    }

    /// Waits for a background save (see [`save_state`](Self::save_state))
    /// and returns its error, if it failed.
    pub fn wait_for_checkpoint(&mut self) -> Result<(), CheckpointError> {
        match self.pending_save.take() {
            None => Ok(()),
            Some(handle) => match handle.join() {
                Ok(result) => result.map(|_| ()),
                Err(_) => Err(CheckpointError::State {
                    path: self.project.project_dir.clone(),
                    message: "the background checkpoint writer panicked".into(),
                }),
            },
        }
    }

    /// What checkpoint hooks are told about the checkpoint in `dir`.
    fn hook_context(&self, dir: &Path, iteration: u64) -> HookCheckpoint {
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

    /// True when a prepared optimizer steps shards (its state must be
    /// gathered to be saved).
    fn sharded_optimizers(&self) -> bool {
        self.optimizers
            .iter()
            .any(|o| lock(o).inner.process_group().is_some())
    }

    /// Every optimizer's whole state (a sharded one's gathered: every
    /// process takes part, the writers `keep` it).
    fn full_optimizer_states(
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
    fn whole_models(
        &self,
        dest: &Path,
        keep: bool,
    ) -> Result<Vec<Vec<(String, Tensor)>>, CheckpointError> {
        let copy = self.project.async_save;
        self.registered
            .models
            .iter()
            .map(|params| {
                self.ddp.whole_copies(params, keep, copy).map_err(|e| {
                    state_err(
                        dest,
                        format!(
                            "gathering the sharded parameters failed: {}",
                            crate::error_chain(&e)
                        ),
                    )
                })
            })
            .collect()
    }

    /// Everything a checkpoint holds, as owned data: the `models` given,
    /// and the rest copied (when saves are asynchronous, even tensors
    /// already on the CPU, so training can go on changing them while a
    /// background thread writes).
    fn snapshot(
        &self,
        dest: &Path,
        models: Vec<Vec<(String, Tensor)>>,
        optimizer_states: Vec<OptimizerState>,
    ) -> Result<Snapshot, CheckpointError> {
        let copy = self.project.async_save;
        let own = |t: &Tensor| {
            let cpu = t.detach().to_device(Device::Cpu);
            if copy && t.device() == Device::Cpu {
                cpu.copy()
            } else {
                cpu
            }
        };
        let owned = |named: &[(String, Tensor)]| -> Vec<(String, Tensor)> {
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
            hearth_version: env!("CARGO_PKG_VERSION").into(),
        };
        parts.push(Part::Json(
            "trainer_state.json".into(),
            json(serde_json::to_value(trainer)),
        ));
        Ok(Snapshot { models, parts })
    }

    /// Restores a checkpoint written by [`save_state`](Self::save_state)
    /// from `dir`, or — with `None` — the newest complete one of the
    /// project (incomplete ones are skipped with a warning), and continues
    /// the iteration count after it. Every prepared object must have its
    /// counterpart in the checkpoint; nothing is restored when the
    /// checkpoint is incomplete or a model's tensors do not fit.
    pub fn load_state(&mut self, dir: Option<&Path>) -> Result<PathBuf, CheckpointError> {
        self.wait_for_checkpoint()?;
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None => {
                let folder = self.project.checkpoints_dir();
                newest_complete(&folder)
                    .map(|(_, d)| d)
                    .ok_or(CheckpointError::NotFound(folder))?
            }
        };
        let manifest = verify_complete(&dir)?;
        let trainer: TrainerState = read_json(&dir.join("trainer_state.json"))?;
        // Hooks first: they may refuse the checkpoint before anything is restored.
        let restored = self.run_load_hooks(&dir, &manifest, &trainer)?;
        // Then models: their load checks everything before writing. From
        // a sharded save, each process reads the rows it holds; from a
        // whole one, into the whole parameters (FULL_SHARD: gathered, their
        // rows then written back into the shards).
        let sharded_model = |i: usize| dir.join(model_shards_dir(i)).is_dir();
        let models = self.registered.models.len();
        let summoned = match (0..models).all(sharded_model) {
            true => None,
            false => Some(self.summon_for(&dir)?),
        };
        for i in (0..models).filter(|&i| sharded_model(i)) {
            self.load_sharded_model(i, &dir.join(model_shards_dir(i)))?;
        }
        for (i, model) in self.registered.models.iter().enumerate() {
            if sharded_model(i) {
                continue;
            }
            let from_file: Vec<(String, Tensor)> = model
                .iter()
                .filter(|(name, _)| !restored.contains_key(&TensorKey::new(i, name)))
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect();
            let path = dir.join(numbered("model", i, "safetensors"));
            load_checkpoint_in_model(&from_file, &path, true)?;
        }
        for (key, source) in &restored {
            let (_, target) = self.registered.models[key.model as usize]
                .iter()
                .find(|(name, _)| *name == key.name)
                .expect("hooks restore only tensors the model has");
            let mut target = target.shallow_clone();
            tch::no_grad(|| target.copy_(source));
        }
        if let Some(summoned) = summoned {
            summoned.write_back();
        }
        for (i, opt) in self.optimizers.iter().enumerate() {
            let path = dir.join(numbered("optimizer", i, "safetensors"));
            let groups: Vec<GroupState> = read_json(&dir.join(numbered("optimizer", i, "json")))?;
            let shards = dir.join(optimizer_shards_dir(i));
            if shards.is_dir() {
                self.load_sharded_optimizer(i, &shards, groups)?;
                continue;
            }
            let state = OptimizerState {
                tensors: load_safetensors(&path, Device::Cpu)?,
                groups,
            };
            lock(opt)
                .inner
                .load_full_state_dict(state)
                .map_err(|m| state_err(&path, m))?;
        }
        for (i, sched) in self.registered.schedulers.iter().enumerate() {
            let path = dir.join(numbered("scheduler", i, "bin"));
            let bytes = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
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
            let per_process = lock(object).per_process();
            let path = dir.join(custom_file(i, per_process, self.process_index()));
            let bytes = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
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

    /// Calls every registered hook's `load` on `dir`; returns the tensors
    /// they restored. A tensor a hook saved at save time needs that hook now.
    fn run_load_hooks(
        &self,
        dir: &Path,
        manifest: &crate::checkpoint::Manifest,
        trainer: &TrainerState,
    ) -> Result<HashMap<TensorKey, Tensor>, CheckpointError> {
        const NOT_LOADED: &str = "loaded (nothing was restored)";
        let hooks = &self.registered.hooks;
        for record in &manifest.hooks {
            let registered = hooks.iter().any(|h| h.name() == record.name);
            if let (false, Some(first)) = (registered, record.claimed.first()) {
                return Err(state_err(
                    dir,
                    format!(
                        "checkpoint hook `{}` saved {} tensor(s) itself (e.g. {first}); register that hook to load this checkpoint",
                        record.name,
                        record.claimed.len()
                    ),
                ));
            }
        }
        let keyed = keyed(&self.registered.models);
        let context = HookCheckpoint {
            step: trainer.step,
            ..self.hook_context(dir, trainer.iteration)
        };
        let mut restored = HashMap::new();
        for hook in hooks {
            let claimed: &[TensorKey] = manifest
                .hooks
                .iter()
                .find(|r| r.name == hook.name())
                .map_or(&[], |r| &r.claimed);
            let tensors = hook
                .load(dir, &context, &keyed, claimed)
                .map_err(|e| hook_failed(dir, hook, NOT_LOADED, e))?;
            restored.extend(tensors);
        }
        Ok(restored)
    }

    pub(super) fn remember_model(
        &mut self,
        params: Vec<(String, Tensor)>,
        shards: Vec<crate::parallel::sharded::UnitShard>,
    ) {
        self.registered.models.push(params);
        self.registered.shards.push(shards);
    }

    pub(super) fn remember_scheduler(&mut self, scheduler: SharedScheduler) {
        self.registered.schedulers.push(scheduler);
    }

    pub(super) fn remember_loader(&mut self, loader: LoaderHandle) {
        self.registered.loaders.push(loader);
    }
}
