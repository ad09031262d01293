//! `ShardedOptimizer`: the user's optimizer, stepping only this process's
//! shards of the sharded parameters (its state exists only for them), then
//! all-gathering every unit so each process holds the whole updated
//! parameters again. Its state dict is the whole one — every state tensor
//! shaped like its shard is gathered — so a checkpoint holds exactly what a
//! DDP run's holds, and loading one keeps this process's rows.

use super::{ParamShard, UnitShard};
use crate::dist::{DistError, ProcessGroup};
use crate::optim::{Optimizer, OptimizerState};
use std::collections::HashMap;
use tch::{TchError, Tensor};

/// An optimizer over the shards of sharded parameters.
pub struct ShardedOptimizer {
    inner: Box<dyn Optimizer>,
    /// Its own channel among the processes (collectives at step and save
    /// time, apart from the gradient round's).
    group: Box<dyn ProcessGroup>,
    /// The units whose parameters it steps, with their layout.
    units: Vec<UnitShard>,
    /// Per optimizer parameter (in the optimizer's order): where it lies
    /// as (unit, parameter), or `None` for a parameter that is not sharded
    /// (an ignored module's).
    places: Vec<Option<(usize, usize)>>,
}

fn dist_err(e: DistError) -> TchError {
    TchError::Torch(e.to_string())
}

impl ShardedOptimizer {
    /// Moves `inner` from the whole parameters onto this process's shards
    /// of those in `units` (others stay as they are). Fails when `inner`
    /// already has state or cannot change its parameters.
    pub fn new(
        mut inner: Box<dyn Optimizer>,
        group: Box<dyn ProcessGroup>,
        units: Vec<UnitShard>,
    ) -> Result<Self, String> {
        let mut by_ptr: HashMap<usize, (usize, usize)> = HashMap::new();
        for (u, unit) in units.iter().enumerate() {
            for (i, p) in unit.params.iter().enumerate() {
                by_ptr.insert(p.full.data_ptr() as usize, (u, i));
            }
        }
        let params = inner.parameters();
        let places: Vec<Option<(usize, usize)>> = params
            .iter()
            .map(|p| by_ptr.get(&(p.data_ptr() as usize)).copied())
            .collect();
        let shards: Vec<Tensor> = params
            .iter()
            .zip(&places)
            .map(|(p, place)| match place {
                Some((u, i)) => units[*u].params[*i].shard.shallow_clone(),
                None => p.shallow_clone(),
            })
            .collect();
        inner.replace_parameters(shards)?;
        Ok(Self {
            inner,
            group,
            units,
            places,
        })
    }

    fn place(&self, i: usize) -> Option<&ParamShard> {
        self.places[i].map(|(u, p)| &self.units[u].params[p])
    }

    /// All-gathers every unit's shards into its whole parameters.
    fn gather_parameters(&self) -> Result<(), DistError> {
        for unit in &self.units {
            let flat = tch::no_grad(|| unit.pack_shards());
            let gathered = self.group.all_gather_into(&flat)?;
            unit.unpack_gathered(&gathered);
        }
        Ok(())
    }

    /// Bytes of the optimizer state this process holds.
    pub fn local_state_bytes(&self) -> u64 {
        state_bytes(&self.inner.state_dict())
    }
}

/// Bytes of the tensors of `state`.
pub fn state_bytes(state: &OptimizerState) -> u64 {
    state
        .tensors
        .iter()
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}

/// The parameter index of a `state.<i>.<name>` key.
fn param_index(key: &str) -> Option<usize> {
    key.strip_prefix("state.")?.split('.').next()?.parse().ok()
}

impl Optimizer for ShardedOptimizer {
    fn step(&mut self) -> Result<(), TchError> {
        self.inner.step()?;
        self.gather_parameters().map_err(dist_err)
    }
    fn zero_grad(&mut self) {
        self.inner.zero_grad()
    }
    fn lrs(&self) -> Vec<f64> {
        self.inner.lrs()
    }
    fn set_lrs(&mut self, lrs: &[f64]) {
        self.inner.set_lrs(lrs)
    }
    /// The shards (and unsharded parameters): what the optimizer steps and
    /// where the gradients are.
    fn parameters(&self) -> Vec<Tensor> {
        self.inner.parameters()
    }
    /// The whole state, as a DDP run's optimizer holds it: a collective,
    /// every process must call it.
    fn state_dict(&self) -> OptimizerState {
        let mut state = self.inner.state_dict();
        let rank = self.group.process_index();
        let world = self.group.num_processes();
        for (key, t) in state.tensors.iter_mut() {
            let Some(p) = param_index(key).and_then(|i| self.place(i)) else {
                continue;
            };
            if t.size() != p.shard_shape(rank) || t.dim() == 0 {
                continue;
            }
            let padded = p.padded_shard(t);
            let gathered = self
                .group
                .all_gather_into(&padded)
                .expect("gathering the optimizer state for a checkpoint failed");
            *t = p.unchunked(&gathered.reshape([world as i64, p.chunk_numel()]));
        }
        state
    }
    /// Takes the whole state (as [`state_dict`](Self::state_dict) gives
    /// it) and keeps this process's rows.
    fn load_state_dict(&mut self, mut state: OptimizerState) -> Result<(), String> {
        let rank = self.group.process_index();
        for (key, t) in state.tensors.iter_mut() {
            let Some(p) = param_index(key).and_then(|i| self.place(i)) else {
                continue;
            };
            if t.size() == p.full.size() && t.dim() > 0 {
                *t = p.own_rows(t, rank).contiguous();
            }
        }
        self.inner.load_state_dict(state)
    }
    fn replace_parameters(&mut self, _: Vec<Tensor>) -> Result<(), String> {
        Err("a sharded optimizer's parameters are its shards; prepare the model once".into())
    }
    fn process_group(&self) -> Option<&dyn ProcessGroup> {
        Some(self.group.as_ref())
    }
    fn local_state_bytes(&self) -> u64 {
        ShardedOptimizer::local_state_bytes(self)
    }
}
