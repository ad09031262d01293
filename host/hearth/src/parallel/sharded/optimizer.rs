//! `ShardedOptimizer`: the user's optimizer, stepping only this process's
//! shards of the sharded parameters (its state exists only for them), then
//! all-gathering every unit so each process holds the whole updated
//! parameters again. Its full state dict (what a checkpoint holds) is the
//! whole one — every parameter-shaped state tensor gathered — exactly what
//! a DDP run's optimizer holds; loading one keeps this process's rows.

use super::{ParamShard, UnitShard};
use crate::optim::{Optimizer, OptimizerState};
use hearth_comm::{DistError, ProcessGroup};
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
    /// SHARD_GRAD_OP: after a step every unit is all-gathered whole again.
    /// FULL_SHARD: units stay sharded until they are next used.
    gather_after_step: bool,
}

fn dist_err(e: DistError) -> TchError {
    TchError::Torch(e.to_string())
}

impl ShardedOptimizer {
    /// Moves `inner` from the whole parameters onto this process's shards
    /// of those in `units` (others stay as they are; the units must be
    /// gathered, for their parameters to be recognised). Fails when `inner`
    /// already has state or cannot change its parameters.
    pub fn new(
        mut inner: Box<dyn Optimizer>,
        group: Box<dyn ProcessGroup>,
        units: Vec<UnitShard>,
        gather_after_step: bool,
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
            gather_after_step,
        })
    }

    fn place(&self, i: usize) -> Option<&ParamShard> {
        self.places.get(i)?.map(|(u, p)| &self.units[u].params[p])
    }

    /// The shard the state tensor `key` (`state.<i>.<name>`) belongs to,
    /// when it is shaped like its parameter and the parameter is sharded.
    fn sharded_state(&self, key: &str) -> Option<&ParamShard> {
        let (i, name) = state_key(key)?;
        if !self.inner.param_shaped_state().contains(&name) {
            return None;
        }
        self.place(i)
    }

    /// All-gathers every unit's shards into its whole parameters (a unit of
    /// frozen parameters alone did not change: it is left as it is).
    fn gather_parameters(&self) -> Result<(), DistError> {
        for unit in self.units.iter().filter(|u| u.trains()) {
            let flat = tch::no_grad(|| unit.pack_shards());
            let gathered = self.group.all_gather_into(&flat)?;
            unit.unpack_gathered(&gathered);
        }
        Ok(())
    }
}

/// The parameter index and state name of a `state.<i>.<name>` key.
fn state_key(key: &str) -> Option<(usize, &str)> {
    let (index, name) = key.strip_prefix("state.")?.split_once('.')?;
    Some((index.parse().ok()?, name))
}

impl Optimizer for ShardedOptimizer {
    fn step(&mut self) -> Result<(), TchError> {
        self.inner.step()?;
        if self.gather_after_step {
            self.gather_parameters().map_err(dist_err)?;
        }
        Ok(())
    }
    /// Drops the shards' gradients, and any whole-parameter gradients left
    /// by backward passes that did not sync.
    fn zero_grad(&mut self) {
        self.inner.zero_grad();
        let full: Vec<Tensor> = self
            .units
            .iter()
            .flat_map(|u| u.params.iter().map(|p| p.full.shallow_clone()))
            .collect();
        hearth_ops::clear_grads(&full).expect("dropping gradients cannot fail");
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
    /// This process's state: shaped like its shards.
    fn state_dict(&self) -> OptimizerState {
        self.inner.state_dict()
    }
    /// This process's state, as [`state_dict`](Self::state_dict) gives it.
    fn load_state_dict(&mut self, state: OptimizerState) -> Result<(), String> {
        self.inner.load_state_dict(state)
    }
    fn param_shaped_state(&self) -> &'static [&'static str] {
        self.inner.param_shaped_state()
    }
    /// The whole state, as a DDP run's optimizer holds it (on the CPU):
    /// every parameter-shaped state tensor of a shard gathered from every
    /// process.
    fn full_state_dict(&self, keep: bool) -> Result<OptimizerState, String> {
        let mut state = self.inner.state_dict();
        let world = self.group.num_processes() as i64;
        for (key, t) in state.tensors.iter_mut() {
            let Some(p) = self.sharded_state(key) else {
                continue;
            };
            let padded = p.padded_shard(t);
            let gathered = self
                .group
                .all_gather_into(&padded)
                .map_err(|e| format!("gathering `{key}` from every process failed: {e}"))?;
            if keep {
                let gathered = gathered.to_device(tch::Device::Cpu);
                *t = p.unchunked(&gathered.reshape([world, p.chunk_numel()]));
            }
        }
        if !keep {
            state.tensors.clear();
        }
        Ok(state)
    }
    /// Takes the whole state (as [`full_state_dict`](Self::full_state_dict)
    /// gives it) and keeps this process's rows.
    fn load_full_state_dict(&mut self, mut state: OptimizerState) -> Result<(), String> {
        let rank = self.group.process_index();
        for (key, t) in state.tensors.iter_mut() {
            let Some(p) = self.sharded_state(key) else {
                continue;
            };
            if t.size() != p.shape {
                return Err(format!(
                    "`{key}` has shape {:?}, its parameter `{}` {:?}",
                    t.size(),
                    p.name,
                    p.shape
                ));
            }
            *t = p.own_rows(t, rank).contiguous();
        }
        self.inner.load_state_dict(state)
    }
    /// The rows of its parameter's shard, for state shaped like it.
    fn held_rows(&self, key: &str) -> Option<crate::checkpoint::HeldRows> {
        let p = self.sharded_state(key)?;
        p.held_rows(self.group.process_index())
    }
    fn replace_parameters(&mut self, _: Vec<Tensor>) -> Result<(), String> {
        Err("a sharded optimizer's parameters are its shards; prepare the model once".into())
    }
    fn process_group(&self) -> Option<&dyn ProcessGroup> {
        Some(self.group.as_ref())
    }
    fn shard_mask(&self) -> Vec<bool> {
        self.places.iter().map(Option::is_some).collect()
    }
}
