//! `load_state`: the checkpoint is verified, its hooks asked first, then
//! every prepared object restored from it (sharded models and optimizers
//! reading the rows each process holds now).

use super::super::{lock, Accelerator, RngState};
use super::{
    custom_file, gather_failed, hook_failed, keyed, numbered, read_json, state_err, ScalerFile,
    SchedulerFile, TrainerState,
};
use crate::checkpoint::{
    load_checkpoint_in_model, load_safetensors, model_shards_dir, newest_complete,
    optimizer_shards_dir, verify_complete, CheckpointError, TensorKey,
};
use crate::data::LoaderState;
use crate::optim::{GroupState, OptimizerState};
use crate::plugins::HookCheckpoint;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

impl Accelerator {
    /// FULL_SHARD models' whole parameters, gathered for a save to or a
    /// load from `dir` (a failure names it).
    fn summon_for(&self, dir: &Path) -> Result<super::super::ddp::Summoned, CheckpointError> {
        self.ddp.summon().map_err(|e| gather_failed(dir, &e))
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
}
