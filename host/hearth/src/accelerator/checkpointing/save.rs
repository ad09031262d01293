//! `save_state`: the state is gathered or copied off the training
//! tensors (a snapshot), staged in a temporary folder every process writes
//! its own parts into, and committed with its manifest — on a background
//! thread with `async_save`.

use super::super::Accelerator;
use super::snapshot::{Part, Snapshot};
use super::SnapshotCopies;
use super::{hook_failed, node_name, numbered, state_err};
use crate::checkpoint::storage::{FileSystem, SaveSpace};
use crate::checkpoint::{rotate_after_commit, CheckpointError, StagedCheckpoint, TensorKey};
use crate::optim::OptimizerState;
use hearth_plugins::{CheckpointHookPlugin, HookCheckpoint};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tch::Tensor;

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
        let source = hearth_plugins::PluginError::Runtime {
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
                let xxh3 = write_pieces(staged.folder(), &name, &pieces)?;
                staged.adopt(&name, xxh3)?;
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
/// created); returns the file's content hash.
fn write_pieces(
    folder: &Path,
    name: &str,
    pieces: &[crate::checkpoint::Piece],
) -> Result<Option<String>, CheckpointError> {
    let path = folder.join(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(CheckpointError::io(parent))?;
    }
    crate::checkpoint::save_pieces(&path, pieces)
}

impl Accelerator {
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
        let _span = crate::profiling::span("hearth::save_state");
        // The gathers below are collectives, and a process whose last save
        // failed stops here: every process goes on, or none.
        self.wait_for_checkpoint_everywhere()?;
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
        let writers = self
            .checkpoint_writers()
            .map_err(|e| state_err(&dest, format!("the processes could not agree: {e}")))?;
        let me = self.process_index();
        // SHARDED_STATE_DICT: each process writes its own shards.
        // Otherwise the state is whole: a sharded optimizer's gathered, and
        // FULL_SHARD's parameters too (by every process; released once the
        // snapshot holds them).
        // An asynchronous save copies into the previous one's buffers.
        let mut copies = self
            .project
            .async_save
            .then(|| self.snapshot_buffers.session());
        let (optimizer_states, models) = if self.saves_sharded() {
            (self.optimizer_groups(), Vec::new())
        } else {
            let writes = writers[me] == me;
            let optimizers = self.full_optimizer_states(&dest, writes)?;
            (
                optimizers,
                self.whole_models(&dest, writes, copies.as_mut())?,
            )
        };
        let rotation = (automatic && self.project.total_limit.is_some()).then(|| {
            (
                self.project.checkpoints_dir(),
                self.project.total_limit.unwrap_or(0),
            )
        });
        // Several writers (save_on_each_node on several machines) each
        // commit their own folder: a commit stays provisional, and old
        // checkpoints stay, until every process agreed the save succeeded.
        let several_writers = writers.iter().any(|&w| w != writers[0]);
        let written = match self.stage(&dest, &writers) {
            Err(e) => {
                drop(copies);
                Err(e)
            }
            // A process that writes no checkpoint: its part is written.
            Ok(None) => {
                drop(copies);
                Ok(dest.clone())
            }
            Ok(Some(staged)) => {
                let rotate_now = rotation.clone().filter(|_| !several_writers);
                let write =
                    self.prepare_write(staged, &dest, models, optimizer_states, copies, rotate_now);
                if several_writers {
                    self.provisional = Some(super::Provisional {
                        dest: dest.clone(),
                        rotation,
                    });
                }
                match write {
                    Err(e) => Err(e),
                    Ok(write) if self.project.async_save => std::thread::Builder::new()
                        .name("hearth-checkpoint".into())
                        .spawn(write)
                        .map(|handle| {
                            self.pending_save = Some(handle);
                            dest.clone()
                        })
                        .map_err(CheckpointError::io(&dest)),
                    Ok(write) => write(),
                }
            }
        };
        // The number is taken even by a save that fails: every process
        // names the next one alike.
        self.project.iteration += 1;
        let agreed = self.agree_on_write(written, &dest);
        // A background write's outcome is agreed later (on every process:
        // each took this path).
        self.unagreed_save = self.project.async_save && agreed.is_ok();
        agreed
    }

    /// A writer's part of [`save_state`](Self::save_state) once its folder
    /// is staged: the snapshot, then what writes it — the hooks, the files,
    /// the commit and the rotation — to run here or on a background thread.
    fn prepare_write(
        &self,
        staged: StagedCheckpoint,
        dest: &Path,
        models: Vec<Vec<(String, Tensor)>>,
        optimizer_states: Vec<OptimizerState>,
        mut copies: Option<SnapshotCopies<'_>>,
        rotation: Option<(PathBuf, usize)>,
    ) -> Result<impl FnOnce() -> Result<PathBuf, CheckpointError> + Send + 'static, CheckpointError>
    {
        let mut models = models;
        self.registered
            .pre_hooks
            .before_save(&mut models, staged.folder());
        let snapshot = self.snapshot(dest, models, optimizer_states, copies.as_mut())?;
        drop(copies);
        let needed = snapshot.bytes();
        let context = self.hook_context(dest, self.project.iteration);
        let hooks = self.registered.hooks.clone();
        let target = dest.to_path_buf();
        let write = move || -> Result<PathBuf, CheckpointError> {
            // A full disk, a quota, a size limit or a failing disk is told
            // with the file system and the bytes (the partial folder is
            // gone by then).
            let space = SaveSpace::begin(&target, needed);
            let saved = write_checkpoint(staged, snapshot, &hooks, &context)
                .map_err(|e| space.explain(e))?;
            if let Some((folder, limit)) = rotation {
                rotate_after_commit(&folder, limit);
            }
            Ok(saved)
        };
        Ok(write)
    }

    /// With several processes, whether every process did its part of the
    /// save — all of it for a blocking save, what happens before the
    /// background write for an asynchronous one (whose outcome is agreed
    /// at the next save or [`wait_for_checkpoint_everywhere`](Self::wait_for_checkpoint_everywhere)).
    /// Each returns the first failure, naming its rank, so all stop (or,
    /// with `on-save-error = "continue"`, go on) together.
    fn agree_on_write(
        &mut self,
        written: Result<PathBuf, CheckpointError>,
        dest: &Path,
    ) -> Result<PathBuf, CheckpointError> {
        if self.num_processes() == 1 {
            return written;
        }
        let mine = written.as_ref().map(|_| ()).map_err(|e| format!("{e:#}"));
        let all = self
            .gather_object(&mine)
            .map_err(|e| state_err(dest, format!("the processes could not agree: {e}")))?;
        let failed = all
            .iter()
            .enumerate()
            .find_map(|(rank, r)| r.as_ref().err().map(|m| (rank, m)));
        let mut committed = written.is_ok();
        if failed.is_some() && self.project.async_save {
            // This process's background write must end before its folder
            // can be set aside; the save failed anyway.
            committed &= self.wait_for_checkpoint().is_ok();
        }
        if !self.project.async_save || failed.is_some() {
            self.settle(failed.is_none(), committed)?;
        }
        let written = written?;
        match failed {
            Some((rank, m)) => Err(state_err(
                dest,
                format!("rank {rank} could not write its part, so nothing was saved: {m}"),
            )),
            None => Ok(written),
        }
    }

    /// Once every process agreed on a save of several writers: its old
    /// checkpoints rotated away when all succeeded; when some failed, the
    /// folder this writer `committed` set aside (`checkpoint_<n>.incomplete`),
    /// so every machine's newest checkpoint is again the same one.
    fn settle(&mut self, all_succeeded: bool, committed: bool) -> Result<(), CheckpointError> {
        let Some(provisional) = self.provisional.take() else {
            return Ok(());
        };
        if all_succeeded {
            if let Some((folder, limit)) = provisional.rotation {
                rotate_after_commit(&folder, limit);
            }
            return Ok(());
        }
        if committed {
            let to = crate::checkpoint::set_aside_as(&provisional.dest, "incomplete")?;
            tracing::warn!(
                "{} is set aside as {}: another machine could not write its copy",
                provisional.dest.display(),
                to.display()
            );
        }
        Ok(())
    }

    /// Starts the checkpoint `dest`. In a world of one that is all; with
    /// several processes, the writers (rank 0, or the first process of
    /// each machine with `save_on_each_node`) stage a folder, every other
    /// process writes its own parts (its generators, per-process objects)
    /// into its writer's, and all learn whether every process succeeded.
    /// Returns the staged checkpoint, holding its processes' parts, on a
    /// writer, `None` on the others.
    fn stage(
        &self,
        dest: &Path,
        writers: &[usize],
    ) -> Result<Option<StagedCheckpoint>, CheckpointError> {
        if self.num_processes() == 1 {
            return StagedCheckpoint::begin(dest).map(Some);
        }
        let disagree = |e: hearth_comm::DistError| {
            state_err(dest, format!("the processes could not agree: {e}"))
        };
        let me = self.process_index();
        let staged = (writers[me] == me).then(|| StagedCheckpoint::begin(dest));
        let folder: Result<PathBuf, String> = match &staged {
            Some(Ok(s)) => Ok(s.folder().to_path_buf()),
            Some(Err(e)) => Err(e.to_string()),
            None => Ok(PathBuf::new()),
        };
        let folders = self.gather_object(&folder).map_err(disagree)?;
        // Each process's files, with the content hash each had as it was
        // written: the writer records them without reading them.
        let written: Result<Vec<(String, Option<String>)>, String> = match &folders[writers[me]] {
            Ok(folder) if staged.is_none() => self
                .write_process_parts(folder, dest)
                .map_err(|e| format!("{e:#}")),
            _ => Ok(Vec::new()),
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
            let hashes: std::collections::HashMap<&str, &Option<String>> = match &all[rank] {
                Ok(files) => files.iter().map(|(n, h)| (n.as_str(), h)).collect(),
                Err(_) => unreachable!("a failed rank returned above"),
            };
            for name in self.process_part_names(rank) {
                let Some(xxh3) = hashes.get(name.as_str()) else {
                    return Err(state_err(
                        dest,
                        format!("rank {rank} did not report writing {name}"),
                    ));
                };
                staged.adopt(&name, (*xxh3).clone())?;
            }
        }
        Ok(Some(staged))
    }

    /// For each rank, the rank that writes the checkpoint its parts go
    /// into: rank 0, or with `save_on_each_node` the first rank on the
    /// same machine.
    fn checkpoint_writers(&self) -> Result<Vec<usize>, hearth_comm::DistError> {
        if !self.project.save_on_each_node {
            return Ok(vec![0; self.num_processes()]);
        }
        let names = self.gather_object(&node_name())?;
        Ok(names
            .iter()
            .map(|n| names.iter().position(|m| m == n).unwrap_or(0))
            .collect())
    }

    /// Writes this process's own parts into the main process's staging
    /// `folder` (each file atomically and durably); returns each file's
    /// name and content hash.
    fn write_process_parts(
        &self,
        folder: &Path,
        dest: &Path,
    ) -> Result<Vec<(String, Option<String>)>, CheckpointError> {
        let parts = self.process_parts(dest)?;
        let space = SaveSpace {
            dest,
            needed: parts.iter().map(Part::bytes).sum(),
            before: FileSystem::of(folder),
        };
        self.write_parts(folder, parts)
            .map_err(|e| space.explain(e))
    }

    /// Writes `parts` into `folder`; returns each file's name and hash.
    fn write_parts(
        &self,
        folder: &Path,
        parts: Vec<Part>,
    ) -> Result<Vec<(String, Option<String>)>, CheckpointError> {
        let mut written = Vec::new();
        for part in parts {
            let (name, xxh3) = match part {
                Part::Tensors(name, tensors) => {
                    let xxh3 = crate::checkpoint::save_safetensors(&folder.join(&name), &tensors)?;
                    (name, xxh3)
                }
                Part::Bytes(name, bytes) => {
                    let path = folder.join(&name);
                    hearth_ops::durable::write_atomically(&path, |f| {
                        std::io::Write::write_all(f, &bytes)
                    })
                    .map_err(CheckpointError::io(&path))?;
                    (name, crate::checkpoint::digest::recorded(&bytes))
                }
                Part::Pieces(name, pieces) => {
                    let xxh3 = write_pieces(folder, &name, &pieces)?;
                    (name, xxh3)
                }
                Part::Json(..) => unreachable!("a process's own parts are tensors and bytes"),
            };
            written.push((name, xxh3));
        }
        Ok(written)
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

    /// [`wait_for_checkpoint`](Self::wait_for_checkpoint) on every
    /// process (a collective): each returns the first failure, its own or
    /// another rank's (named), so all stop or go on together.
    pub fn wait_for_checkpoint_everywhere(&mut self) -> Result<(), CheckpointError> {
        let waited = self.wait_for_checkpoint();
        // Only a background save is left to agree on: every process knows
        // alike whether one was started, so all gather or none does.
        let unagreed = std::mem::take(&mut self.unagreed_save);
        if !unagreed || self.num_processes() == 1 || hearth_comm::collectives_broken() {
            // No group to agree with: what was provisional stays so.
            self.provisional = None;
            return waited;
        }
        let mine = waited.as_ref().map(|_| ()).map_err(|e| format!("{e:#}"));
        let all = self.gather_object(&mine).map_err(|e| {
            state_err(
                &self.project.project_dir,
                format!("the processes could not agree: {e}"),
            )
        })?;
        let failed = all
            .iter()
            .enumerate()
            .find_map(|(rank, r)| r.as_ref().err().map(|m| (rank, m)));
        self.settle(failed.is_none(), waited.is_ok())?;
        waited?;
        match failed {
            Some((rank, m)) => Err(state_err(
                &self.project.project_dir,
                format!("rank {rank}'s last checkpoint failed: {m}"),
            )),
            None => Ok(()),
        }
    }
}
