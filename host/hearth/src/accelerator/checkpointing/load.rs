//! `load_state`: the checkpoint is verified, its hooks asked first, then
//! every prepared object restored from it (sharded models and optimizers
//! reading the rows each process holds now).

use super::super::{lock, Accelerator, RngState};
use super::{
    custom_file, gather_failed, hook_failed, keyed, numbered, read_json, state_err, ScalerFile,
    SchedulerFile, TrainerState,
};
use crate::checkpoint::{
    load_safetensors, model_shards_dir, newest_intact, optimizer_shards_dir, set_aside,
    stage_checkpoint_in_model, verify_complete, verify_intact, CheckpointError, TensorKey,
};
use crate::data::LoaderState;
use crate::optim::{GroupState, OptimizerState};
use hearth_plugins::HookCheckpoint;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

impl Accelerator {
    /// FULL_SHARD models' whole parameters, gathered for a save to or a
    /// load from `dir` (a failure names it).
    fn summon_for(
        &self,
        dir: &Path,
    ) -> Result<crate::parallel::data_parallel::Summoned, CheckpointError> {
        self.data_parallel
            .summon()
            .map_err(|e| gather_failed(dir, &e))
    }

    /// Restores a checkpoint written by [`save_state`](Self::save_state)
    /// from `dir`, or — with `None` — the newest intact one of the project
    /// (incomplete ones, and ones whose files no longer hash as written,
    /// are skipped with a warning that says why), and continues
    /// the iteration count after it. Every prepared object must have its
    /// counterpart in the checkpoint. All or nothing: every file is read
    /// and checked before anything is restored, and when an object refuses
    /// its state (an optimizer whose groups differ, a scheduler plugin, a
    /// registered object), those restored before it are put back.
    pub fn load_state(&mut self, dir: Option<&Path>) -> Result<PathBuf, CheckpointError> {
        let _span = crate::profiling::span("hearth::load_state");
        // Every process, before the gathers below.
        self.wait_for_checkpoint_everywhere()?;
        // The newest intact checkpoint has had its files hashed already.
        let (dir, hashed, skipped) = match dir {
            Some(d) => (d.to_path_buf(), false, Vec::new()),
            None => {
                let folder = self.project.checkpoints_dir();
                let (newest, skipped) = newest_intact(&folder);
                let newest = newest
                    .map(|(_, d)| d)
                    .ok_or_else(|| CheckpointError::NotFound(folder.clone()));
                (self.agree_on_checkpoint(&folder, newest)?, true, skipped)
            }
        };
        // Every process checks and reads what it needs before anything is
        // restored; each step ends with all processes agreeing that all
        // succeeded (`agree`), so that a rank that cannot load (a file of
        // its own missing) stops every rank with its reason instead of
        // leaving the others waiting in the next collective.
        let checked = (|| {
            let manifest = match hashed {
                true => verify_complete(&dir)?,
                false => verify_intact(&dir)?,
            };
            let trainer: TrainerState = read_json(&dir.join("trainer_state.json"))?;
            check_counters(&dir, &trainer)?;
            // Hooks first: they may refuse the checkpoint before anything is restored.
            let restored = self.run_load_hooks(&dir, &manifest, &trainer)?;
            Ok((trainer, restored))
        })();
        let (trainer, restored) = self.agree(&dir, checked)?;
        // Every process is past its checks: the newer checkpoints skipped
        // move out of the way of this run's saves (kept, not deleted), by
        // the one process that writes checkpoints there.
        let writer = match self.project.save_on_each_node {
            true => self.is_local_main_process(),
            false => self.is_main_process(),
        };
        if writer {
            for skipped in skipped {
                match set_aside(&skipped) {
                    Ok(to) => tracing::warn!(
                        "moved the skipped {} to {}, so that this run's saves can take its number",
                        skipped.display(),
                        to.display()
                    ),
                    Err(e) => {
                        tracing::warn!("could not move the skipped {}: {e}", skipped.display())
                    }
                }
            }
        }
        // FULL_SHARD models are gathered whole to be read into (released
        // unchanged if the load fails).
        let sharded_model = |i: usize| dir.join(model_shards_dir(i)).is_dir();
        let summoned = match (0..self.registered.models.len()).all(sharded_model) {
            true => None,
            false => Some(self.summon_for(&dir)?),
        };
        let staged = (|| {
            let read = self
                .registered
                .pre_hooks
                .before_load(self.registered.models.len(), &dir)
                .map_err(|m| state_err(&dir, m))?;
            let staged = self.stage_checkpoint(&dir, restored, &read)?;
            let previous = self.previous_state(&dir)?;
            Ok((staged, previous))
        })();
        let (staged, previous) = self.agree(&dir, staged)?;
        let applied = self.apply_refusable(&staged);
        if let Err(e) = self.agree(&dir, applied) {
            self.put_back(previous);
            return Err(e);
        }
        // What is left cannot fail: it was checked when read.
        tch::no_grad(|| {
            for (target, value) in &staged.model_writes {
                target.detach().copy_(value);
            }
        });
        if let Some(summoned) = summoned {
            summoned.write_back();
        }
        if let (Some(scaler), Some(s)) = (&self.scaler, &staged.scaler) {
            lock(scaler).load_state(s.scale, s.growth_tracker, self.device);
        }
        for (loader, state) in self.registered.loaders.iter().zip(staged.loaders) {
            loader.load_state(state);
        }
        self.micro_steps
            .store(trainer.step, std::sync::atomic::Ordering::Relaxed);
        self.state
            .set_accumulation_position(trainer.accumulation_position);
        self.project.iteration = trainer.iteration + 1;
        Ok(dir)
    }

    /// `mine` if every process's step of a load succeeded; else an error
    /// on every process, the failed rank's own on that rank and, on the
    /// others, which rank failed and why. A collective when there are
    /// several processes.
    /// The newest intact checkpoint every process found (each looked for
    /// itself): one that some process could not find, or processes that
    /// found different ones (a file that reads otherwise on one machine),
    /// stop them all, saying so.
    fn agree_on_checkpoint(
        &self,
        folder: &Path,
        mine: Result<PathBuf, CheckpointError>,
    ) -> Result<PathBuf, CheckpointError> {
        if self.num_processes() < 2 {
            return mine;
        }
        // By name: with save_on_each_node each machine has its own folder.
        let said = mine
            .as_ref()
            .map(|d| {
                d.file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
            })
            .map_err(|e| format!("{e:#}"));
        let all = self
            .gather_object(&said)
            .map_err(|e| state_err(folder, format!("the processes could not agree: {e}")))?;
        let mine = mine?;
        if let Some((rank, Err(m))) = all.iter().enumerate().find(|(_, r)| r.is_err()) {
            return Err(state_err(
                folder,
                format!("rank {rank} found no checkpoint to resume from: {m}"),
            ));
        }
        let found: Vec<String> = all.into_iter().filter_map(Result::ok).collect();
        if found.iter().any(|f| *f != found[0]) {
            return Err(state_err(
                folder,
                format!(
                    "the processes found different newest intact checkpoints ({}): a file reads \
                     differently on some machine; check its file system",
                    found.join(", ")
                ),
            ));
        }
        Ok(mine)
    }

    fn agree<T>(&self, dir: &Path, mine: Result<T, CheckpointError>) -> Result<T, CheckpointError> {
        if self.num_processes() < 2 {
            return mine;
        }
        let said = mine.as_ref().map(|_| ()).map_err(|e| format!("{e:#}"));
        let all = self
            .gather_object(&said)
            .map_err(|e| state_err(dir, format!("the processes could not agree: {e}")))?;
        let value = mine?;
        match all
            .iter()
            .enumerate()
            .find_map(|(rank, r)| r.as_ref().err().map(|m| (rank, m)))
        {
            Some((rank, m)) => Err(state_err(
                dir,
                format!("rank {rank} could not load it, so no process did: {m}"),
            )),
            None => Ok(value),
        }
    }

    /// Reads and checks every file of the checkpoint in `dir` that a
    /// prepared object needs, restoring nothing; `restored` are the model
    /// tensors the hooks gave back, `read` the models to read from the
    /// model files, in file order (what the pre-hooks left).
    fn stage_checkpoint(
        &self,
        dir: &Path,
        restored: HashMap<TensorKey, Tensor>,
        read: &[usize],
    ) -> Result<Staged, CheckpointError> {
        let mut model_writes = Vec::new();
        for (position, &i) in read.iter().enumerate() {
            let model = &self.registered.models[i];
            let shards = dir.join(model_shards_dir(i));
            if shards.is_dir() {
                model_writes.extend(self.stage_sharded_model(i, &shards)?);
                continue;
            }
            let from_file: Vec<(String, Tensor)> = model
                .iter()
                .filter(|(name, _)| !restored.contains_key(&TensorKey::new(i, name)))
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect();
            let path = dir.join(numbered("model", position, "safetensors"));
            let (writes, report) = stage_checkpoint_in_model(&from_file, &path, false)?;
            let buffers = &self.registered.buffers[i];
            let (absent_buffers, missing): (Vec<String>, Vec<String>) = report
                .missing
                .into_iter()
                .partition(|n| buffers.contains(n));
            if !missing.is_empty() || !report.unexpected.is_empty() {
                return Err(CheckpointError::Keys {
                    path,
                    missing,
                    unexpected: report.unexpected,
                });
            }
            if !absent_buffers.is_empty() {
                tracing::warn!(
                    "{} holds no {} (saved before hearth saved buffers?): they keep their values",
                    path.display(),
                    absent_buffers.join(", ")
                );
            }
            model_writes.extend(writes);
        }
        for (key, source) in restored {
            let (_, target) = self.registered.models[key.model as usize]
                .iter()
                .find(|(name, _)| *name == key.name)
                .expect("hooks restore only tensors the model has");
            model_writes.push((target.shallow_clone(), source));
        }
        let mut optimizers = Vec::new();
        for i in 0..self.optimizers.len() {
            let json = dir.join(numbered("optimizer", i, "json"));
            let groups: Vec<GroupState> = read_json(&json)?;
            let shards = dir.join(optimizer_shards_dir(i));
            let staged = if shards.is_dir() {
                let state = self.read_sharded_optimizer(i, &shards, groups)?;
                StagedOptimizer::Held(shards, state)
            } else {
                let path = dir.join(numbered("optimizer", i, "safetensors"));
                let tensors = load_safetensors(&path, Device::Cpu)?;
                StagedOptimizer::Full(path, OptimizerState { tensors, groups })
            };
            optimizers.push(staged);
        }
        let mut schedulers = Vec::new();
        for i in 0..self.registered.schedulers.len() {
            let path = dir.join(numbered("scheduler", i, "bin"));
            let bytes = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
            let json = dir.join(numbered("scheduler", i, "json"));
            let file: SchedulerFile = read_json(&json)?;
            plausible(&json, "steps", file.steps)?;
            schedulers.push((path, file.steps, bytes));
        }
        let scaler = match &self.scaler {
            Some(_) => read_scaler(&dir.join("scaler.json"))?,
            None => None,
        };
        let loaders = (0..self.registered.loaders.len())
            .map(|i| {
                let path = dir.join(numbered("dataloader", i, "json"));
                let state: LoaderState = read_json(&path)?;
                plausible(&path, "epoch", state.epoch)?;
                plausible(&path, "batches_seen", state.batches_seen as u64)?;
                Ok(state)
            })
            .collect::<Result<_, CheckpointError>>()?;
        let rng_path = dir.join(format!(
            "random_states_{}.safetensors",
            self.process_index()
        ));
        // A process the checkpoint was not saved by (resuming on more
        // processes) keeps the generators `set_seed` gave it, as
        // Accelerate's `load_state` does when its file is absent. (With
        // save_on_each_node a machine's folder holds its own ranks' files
        // only: whether this rank was saved is whether its file is there.)
        let saved = rng_path.exists();
        let rng = if saved {
            Some((rng_path.clone(), read_rng(&rng_path)?))
        } else {
            tracing::warn!(
                "{} was saved by {} processes: process {} has no {} and keeps the generators its seed gave it",
                dir.display(),
                saved_processes(dir)?,
                self.process_index(),
                rng_path.file_name().unwrap_or_default().to_string_lossy(),
            );
            None
        };
        let mut custom = Vec::new();
        for (i, object) in self.registered.custom.iter().enumerate() {
            let per_process = lock(object).per_process();
            let new_process = per_process && !saved;
            let rank = if new_process { 0 } else { self.process_index() };
            let path = dir.join(custom_file(i, per_process, rank));
            let bytes = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
            custom.push(StagedObject {
                path,
                bytes,
                of_process_zero: new_process,
            });
        }
        Ok(Staged {
            model_writes,
            optimizers,
            schedulers,
            scaler,
            loaders,
            rng,
            custom,
        })
    }

    /// The current state of what may refuse its new one, to put back if
    /// any does (a scheduler that cannot report its state stops the load
    /// before anything is restored).
    fn previous_state(&self, dir: &Path) -> Result<Previous, CheckpointError> {
        let schedulers = self
            .registered
            .schedulers
            .iter()
            .map(|s| lock(s).state())
            .collect::<Result<_, _>>()
            .map_err(|e| {
                state_err(
                    dir,
                    format!(
                        "the scheduler cannot report its current state (nothing was restored): {e}"
                    ),
                )
            })?;
        Ok(Previous {
            optimizers: self
                .optimizers
                .iter()
                .map(|o| lock(o).inner.state_dict())
                .collect(),
            schedulers,
            custom: self
                .registered
                .custom
                .iter()
                .map(|o| lock(o).state_dict())
                .collect(),
            rng: self.rng_state().ok(),
        })
    }

    /// Restores what may refuse its state: optimizers, schedulers,
    /// registered objects and the generators, in that order.
    fn apply_refusable(&self, staged: &Staged) -> Result<(), CheckpointError> {
        for (opt, staged) in self.optimizers.iter().zip(&staged.optimizers) {
            let inner = &mut lock(opt).inner;
            let result = match staged {
                StagedOptimizer::Full(path, state) => inner
                    .load_full_state_dict(state.shallow_clone())
                    .map_err(|m| state_err(path, m)),
                StagedOptimizer::Held(folder, state) => inner
                    .load_state_dict(state.shallow_clone())
                    .map_err(|m| state_err(folder, m)),
            };
            result?;
        }
        for (sched, (path, steps, bytes)) in
            self.registered.schedulers.iter().zip(&staged.schedulers)
        {
            lock(sched)
                .load_state(*steps, bytes)
                .map_err(|e| state_err(path, format!("the scheduler refused its state: {e}")))?;
        }
        for (object, staged) in self.registered.custom.iter().zip(&staged.custom) {
            let mut object = lock(object);
            let result = if staged.of_process_zero {
                object
                    .load_state_dict_of_process_zero(&staged.bytes)
                    .map_err(|m| {
                        format!("process {} was not among the processes that saved the checkpoint, and this object cannot start from process 0's state ({m}); resume on as many processes as saved it, or fewer", self.process_index())
                    })
            } else {
                object.load_state_dict(&staged.bytes)
            };
            result.map_err(|m| state_err(&staged.path, m))?;
        }
        match &staged.rng {
            Some((path, rng)) => self
                .set_rng_state(rng)
                .map_err(|e| state_err(path, format!("cannot restore the generators: {e}"))),
            None => Ok(()),
        }
    }

    /// Puts back what [`previous_state`](Self::previous_state) took after a
    /// refused load (a failure here is logged: the load's own error is the
    /// one to report).
    fn put_back(&self, previous: Previous) {
        for (opt, state) in self.optimizers.iter().zip(previous.optimizers) {
            if let Err(e) = lock(opt).inner.load_state_dict(state) {
                tracing::error!("putting an optimizer's state back after a refused load: {e}");
            }
        }
        for (sched, (steps, bytes)) in self.registered.schedulers.iter().zip(previous.schedulers) {
            if let Err(e) = lock(sched).load_state(steps, &bytes) {
                tracing::error!("putting the scheduler's state back after a refused load: {e}");
            }
        }
        for (object, bytes) in self.registered.custom.iter().zip(previous.custom) {
            if let Err(e) = lock(object).load_state_dict(&bytes) {
                tracing::error!(
                    "putting a registered object's state back after a refused load: {e}"
                );
            }
        }
        if let Some(rng) = previous.rng {
            let _ = self.set_rng_state(&rng);
        }
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
}

/// A checkpoint read and checked, nothing of it applied yet.
struct Staged {
    /// Each model tensor (or shard) with its value from the checkpoint.
    model_writes: Vec<(Tensor, Tensor)>,
    optimizers: Vec<StagedOptimizer>,
    /// Each scheduler's file, step count and plugin state.
    schedulers: Vec<(PathBuf, u64, Vec<u8>)>,
    scaler: Option<ScalerFile>,
    loaders: Vec<LoaderState>,
    /// The generators' file and state; none for a process the
    /// checkpoint was not saved by.
    rng: Option<(PathBuf, RngState)>,
    custom: Vec<StagedObject>,
}

/// A registered object's file and state.
struct StagedObject {
    path: PathBuf,
    bytes: Vec<u8>,
    /// Process 0's state, for a process the checkpoint was not saved by.
    of_process_zero: bool,
}

/// How many processes wrote the checkpoint in `dir` (its
/// `random_states_<rank>` files).
fn saved_processes(dir: &Path) -> Result<usize, CheckpointError> {
    Ok(std::fs::read_dir(dir)
        .map_err(CheckpointError::io(dir))?
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("random_states_") && name.ends_with(".safetensors")
        })
        .count())
}

/// An optimizer's state from a whole save (spread over the shards as
/// this process holds them when restored), or as this process holds it
/// already (a sharded save), with the file or folder it came from.
enum StagedOptimizer {
    Full(PathBuf, OptimizerState),
    Held(PathBuf, OptimizerState),
}

/// What a refused load puts back.
struct Previous {
    optimizers: Vec<OptimizerState>,
    schedulers: Vec<(u64, Vec<u8>)>,
    custom: Vec<Vec<u8>>,
    rng: Option<RngState>,
}

/// `scaler.json`, checked: a finite scale above 0 and a count of at least 0
/// (`None` when the checkpoint has none: saved without fp16).
fn read_scaler(path: &Path) -> Result<Option<ScalerFile>, CheckpointError> {
    if !path.exists() {
        return Ok(None);
    }
    let s: ScalerFile = read_json(path)?;
    if !(s.scale.is_finite() && s.scale > 0.0) || s.growth_tracker < 0 {
        return Err(state_err(
            path,
            format!(
                "holds scale {} and growth_tracker {}: the scale must be a finite number above 0 \
                 and the tracker at least 0",
                s.scale, s.growth_tracker
            ),
        ));
    }
    Ok(Some(s))
}

/// The generator states in `path` (`cpu`, then `cuda.<i>` for each device).
fn read_rng(path: &Path) -> Result<RngState, CheckpointError> {
    let tensors = load_safetensors(path, Device::Cpu)?;
    let find = |name: &str| {
        tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.shallow_clone())
    };
    Ok(RngState {
        cpu: find("cpu").ok_or_else(|| state_err(path, "holds no `cpu` generator state"))?,
        cuda: (0..).map_while(|i| find(&format!("cuda.{i}"))).collect(),
    })
}

/// Counters past 2^53 (beyond what JSON numbers hold exactly, and where
/// adding to them could overflow) are refused, naming the file and key.
fn plausible(path: &Path, key: &str, value: u64) -> Result<(), CheckpointError> {
    match value > 1 << 53 {
        true => Err(state_err(
            path,
            format!("`{key}` is {value}, not a count a run reaches"),
        )),
        false => Ok(()),
    }
}

/// `trainer_state.json`'s counters, checked to be plausible counts.
fn check_counters(dir: &Path, t: &TrainerState) -> Result<(), CheckpointError> {
    let path = dir.join("trainer_state.json");
    plausible(&path, "iteration", t.iteration)?;
    plausible(&path, "step", t.step)?;
    plausible(&path, "epoch", t.epoch)?;
    plausible(
        &path,
        "accumulation_position",
        t.accumulation_position as u64,
    )
}
