//! FSDP's SHARDED_STATE_DICT in `save_state` and `load_state`: every
//! process writes the rows its shards hold of each model and optimizer
//! state tensor into one file of `pytorch_model_fsdp_<i>/` and
//! `optimizer_<i>/` (the layout of [`crate::checkpoint::ShardedTensors`],
//! which torch's `HuggingFaceStorageReader` reads), and a load reads the
//! rows each process holds now — from files written by any number of
//! processes.

use super::super::{lock, Accelerator};
use super::state_err;
use crate::checkpoint::{
    model_shards_dir, optimizer_shards_dir, shard_file_name, CheckpointError, Piece, ShardedTensors,
};
use crate::optim::{GroupState, OptimizerState};
use crate::parallel::sharded::ParamShard;
use crate::parallel::StateDictType;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use tch::{Device, Tensor};

/// A copy of `t` on the CPU that training cannot change.
fn owned(t: &Tensor) -> Tensor {
    t.detach().to_device(Device::Cpu).copy()
}

impl Accelerator {
    /// True when checkpoints are saved sharded (`state-dict-type =
    /// "SHARDED_STATE_DICT"`).
    pub(super) fn saves_sharded(&self) -> bool {
        self.data_parallel
            .fsdp()
            .is_some_and(|s| s.state_dict_type == StateDictType::ShardedStateDict)
    }

    /// The files process `rank` writes in a sharded save: one per prepared
    /// model and optimizer (none on a machine other than the first under
    /// HYBRID: its shards are copies).
    pub(super) fn shard_file_names(&self, rank: usize) -> Vec<String> {
        let (replica, shard_rank) = self.data_parallel.shard_place(rank);
        if !self.saves_sharded() || replica != 0 {
            return Vec::new();
        }
        let file = shard_file_name(shard_rank);
        let models = (0..self.registered.models.len()).map(model_shards_dir);
        let optimizers = (0..self.optimizers.len()).map(optimizer_shards_dir);
        models
            .chain(optimizers)
            .map(|dir| format!("{dir}/{file}"))
            .collect()
    }

    /// This process's pieces of every prepared model and optimizer, by the
    /// file they go in (see [`shard_file_names`](Self::shard_file_names)).
    pub(super) fn shard_pieces(&self) -> Vec<(String, Vec<Piece>)> {
        let names = self.shard_file_names(self.process_index());
        let models = (0..self.registered.models.len()).map(|i| self.model_pieces(i));
        let optimizers = self.optimizers.iter().map(|o| {
            let (_, rank) = self.data_parallel.shard_place(self.process_index());
            let inner = &lock(o).inner;
            inner
                .state_dict()
                .tensors
                .into_iter()
                .filter_map(|(key, t)| match inner.held_rows(&key) {
                    Some(rows) => {
                        (rows.count > 0).then(|| Piece::rows(&key, owned(&t), rows.start))
                    }
                    None => (rank == 0).then(|| Piece::whole(&key, owned(&t))),
                })
                .collect()
        });
        names.into_iter().zip(models.chain(optimizers)).collect()
    }

    /// Each parameter of prepared model `i` by name, with its place in
    /// the shard layout when it is sharded.
    fn shards_of(&self, i: usize) -> HashMap<&str, &ParamShard> {
        self.registered.shards[i]
            .iter()
            .flat_map(|u| u.params.iter().map(|p| (p.name.as_str(), p)))
            .collect()
    }

    /// This process's pieces of prepared model `i`: the rows its shards
    /// hold of each sharded parameter and, on rank 0, the others whole.
    fn model_pieces(&self, i: usize) -> Vec<Piece> {
        let (_, rank) = self.data_parallel.shard_place(self.process_index());
        let shards = self.shards_of(i);
        let mut pieces = Vec::new();
        for (name, t) in &self.registered.models[i] {
            match shards.get(name.as_str()) {
                Some(p) => match p.held_rows(rank) {
                    Some(rows) if rows.count > 0 => {
                        pieces.push(Piece::rows(name, owned(&p.shard), rows.start))
                    }
                    Some(_) => {}
                    // A 0-dimensional parameter: rank 0's shard is it.
                    None if rank == 0 => {
                        pieces.push(Piece::whole(name, owned(&p.shard.reshape([]))))
                    }
                    None => {}
                },
                None if rank == 0 => pieces.push(Piece::whole(name, owned(t))),
                None => {}
            }
        }
        pieces
    }

    /// Every optimizer's parameter groups (what `optimizer_<i>.json` holds
    /// beside the state shards).
    pub(super) fn optimizer_groups(&self) -> Vec<OptimizerState> {
        self.optimizers
            .iter()
            .map(|o| OptimizerState {
                tensors: Vec::new(),
                groups: lock(o).inner.state_dict().groups,
            })
            .collect()
    }

    /// Refuses a sharded save this layout cannot hold.
    pub(super) fn check_sharded_save(&self, dest: &Path) -> Result<(), CheckpointError> {
        if self.saves_sharded() && self.project.save_on_each_node && self.num_processes() > 1 {
            return Err(state_err(
                dest,
                "save_on_each_node with state-dict-type = \"SHARDED_STATE_DICT\" would leave each \
                 machine's checkpoint with only its own processes' shards; save to a filesystem \
                 every machine shares (save_on_each_node = false) or use FULL_STATE_DICT",
            ));
        }
        Ok(())
    }

    /// What restoring prepared model `i` from the sharded folder `folder`
    /// writes, read and checked (names, shapes, dtypes) but not yet
    /// written: each process reads the rows its shards hold now (the whole
    /// parameters where it holds them whole). Returns (target, value) pairs.
    pub(super) fn stage_sharded_model(
        &self,
        i: usize,
        folder: &Path,
    ) -> Result<Vec<(Tensor, Tensor)>, CheckpointError> {
        let (_, rank) = self.data_parallel.shard_place(self.process_index());
        let shards = ShardedTensors::open(folder)?;
        let model = &self.registered.models[i];
        let held = self.shards_of(i);
        let names: BTreeSet<&str> = model.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(extra) = shards.names().find(|n| !names.contains(n)) {
            return Err(state_err(
                folder,
                format!("holds `{extra}`, which model {i} does not have (a checkpoint of another model?)"),
            ));
        }
        let mut writes: Vec<(Tensor, Tensor)> = Vec::new();
        for (name, t) in model {
            let p = held.get(name.as_str());
            let whole = p.map_or_else(|| t.size(), |p| p.shape.clone());
            let Some((shape, kind)) = shards.shape(name) else {
                if self.registered.buffers[i].contains(name) {
                    tracing::warn!(
                        "{} holds no buffer `{name}` (saved before hearth saved buffers?): it keeps its value",
                        folder.display()
                    );
                    continue;
                }
                return Err(state_err(
                    folder,
                    format!("holds no `{name}` of model {i} in any shard file"),
                ));
            };
            if shape != whole.as_slice() || kind != t.kind() {
                return Err(state_err(
                    folder,
                    format!(
                        "`{name}` is {kind:?} {shape:?} in the checkpoint, {:?} {whole:?} in model {i}",
                        t.kind()
                    ),
                ));
            }
            let Some(p) = p else {
                writes.push((t.shallow_clone(), shards.read(name)?));
                continue;
            };
            let gathered = p.full.numel() as i64 == whole.iter().product::<i64>();
            if gathered {
                let values = shards.read(name)?;
                writes.push((p.shard.shallow_clone(), own_part(p, &values, rank)));
                writes.push((t.shallow_clone(), values));
            } else {
                let values = match p.held_rows(rank) {
                    Some(rows) => shards.read_rows(name, rows.start, rows.count)?,
                    None => own_part(p, &shards.read(name)?, rank),
                };
                writes.push((p.shard.shallow_clone(), values));
            }
        }
        Ok(writes)
    }

    /// The state of prepared optimizer `i` in the sharded folder `folder`
    /// with its `groups`, as this process holds it: the rows of the state
    /// of the parameters it holds (read and checked, not yet applied).
    pub(super) fn read_sharded_optimizer(
        &self,
        i: usize,
        folder: &Path,
        groups: Vec<GroupState>,
    ) -> Result<OptimizerState, CheckpointError> {
        let shards = ShardedTensors::open(folder)?;
        let optimizer = lock(&self.optimizers[i]);
        let inner = &optimizer.inner;
        let mut tensors = Vec::new();
        for key in shards.names() {
            let values = match inner.held_rows(key) {
                Some(rows) => {
                    let (shape, _) = shards.shape(key).expect("a listed name");
                    if shape != rows.whole.as_slice() {
                        return Err(state_err(
                            folder,
                            format!(
                                "`{key}` has shape {shape:?}, its parameter {:?}",
                                rows.whole
                            ),
                        ));
                    }
                    shards.read_rows(key, rows.start, rows.count)?
                }
                None => shards.read(key)?,
            };
            tensors.push((key.to_string(), values));
        }
        Ok(OptimizerState { tensors, groups })
    }
}

/// `rank`'s part of the whole parameter `values`, shaped like its shard.
fn own_part(p: &ParamShard, values: &Tensor, rank: usize) -> Tensor {
    if p.shape.is_empty() {
        values.reshape([-1]).narrow(0, 0, p.shard.numel() as i64)
    } else {
        p.own_rows(values, rank).contiguous()
    }
}
