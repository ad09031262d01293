//! Parameter groups, the `Optimizer` trait and optimizer state as checkpoints hold it.

use tch::{TchError, Tensor};

/// Parameters that share a learning rate and weight decay (PyTorch's
/// `param_groups` entry). Unset values take the optimizer's defaults.
#[derive(Debug)]
pub struct ParamGroup {
    /// The tensors (leaves that require grad).
    pub params: Vec<Tensor>,
    /// This group's learning rate, if not the optimizer's.
    pub lr: Option<f64>,
    /// This group's weight decay, if not the optimizer's.
    pub weight_decay: Option<f64>,
}

impl ParamGroup {
    /// A group with the optimizer's defaults.
    pub fn new(params: Vec<Tensor>) -> Self {
        Self {
            params,
            lr: None,
            weight_decay: None,
        }
    }
    /// Sets this group's learning rate.
    pub fn lr(mut self, lr: f64) -> Self {
        self.lr = Some(lr);
        self
    }
    /// Sets this group's weight decay.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = Some(weight_decay);
        self
    }
}

/// Named parameters in PyTorch's usual two groups for a no-decay list
/// (`[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]`): those
/// whose name contains none of `exempt` first, then, when any matched, the
/// ones that do, without weight decay. `[optimizer] no-decay` is this.
pub fn no_decay_groups(named: Vec<(String, Tensor)>, exempt: &[&str]) -> Vec<ParamGroup> {
    let (exempted, decayed): (Vec<_>, Vec<_>) = named
        .into_iter()
        .partition(|(name, _)| exempt.iter().any(|s| name.contains(s)));
    let tensors = |v: Vec<(String, Tensor)>| v.into_iter().map(|(_, t)| t).collect();
    let mut groups = vec![ParamGroup::new(tensors(decayed))];
    if !exempted.is_empty() {
        groups.push(ParamGroup::new(tensors(exempted)).weight_decay(0.0));
    }
    groups
}

/// What an optimizer can be built over: one list of tensors (one group),
/// one [`ParamGroup`], or several.
pub trait IntoParamGroups {
    /// The groups.
    fn into_param_groups(self) -> Vec<ParamGroup>;
}

impl IntoParamGroups for Vec<Tensor> {
    fn into_param_groups(self) -> Vec<ParamGroup> {
        vec![ParamGroup::new(self)]
    }
}

impl IntoParamGroups for ParamGroup {
    fn into_param_groups(self) -> Vec<ParamGroup> {
        vec![self]
    }
}

impl IntoParamGroups for Vec<ParamGroup> {
    fn into_param_groups(self) -> Vec<ParamGroup> {
        self
    }
}

/// An optimizer over fixed parameter groups.
pub trait Optimizer: Send {
    /// Applies one update from the parameters' current gradients (parameters
    /// without a gradient are left alone, as in PyTorch).
    fn step(&mut self) -> Result<(), TchError>;
    /// Drops the gradients (PyTorch's default `set_to_none=True`).
    fn zero_grad(&mut self);
    /// The learning rate of each group.
    fn lrs(&self) -> Vec<f64>;
    /// Sets the learning rate of each group (one value per group).
    fn set_lrs(&mut self, lrs: &[f64]);
    /// All parameters, group by group, in the order given at construction.
    fn parameters(&self) -> Vec<Tensor>;
    /// The state a checkpoint saves: per-parameter tensors named
    /// `state.<i>.<name>` (`i` counts parameters across groups, as PyTorch's
    /// optimizer `state_dict`) and each group's settings. The tensors are
    /// handles to the live state, not copies.
    fn state_dict(&self) -> OptimizerState;
    /// Takes over the state [`state_dict`](Self::state_dict) described
    /// (moved to the parameters' devices, not copied: pass copies of state
    /// that is still in use); an error names what does not fit.
    fn load_state_dict(&mut self, state: OptimizerState) -> Result<(), String>;

    /// Moves the optimizer onto other tensors, one for each of its
    /// parameters in the same order (sharding gives it each parameter's
    /// shard). Refused once it has state, or by an optimizer that cannot.
    fn replace_parameters(&mut self, params: Vec<Tensor>) -> Result<(), String> {
        let _ = params;
        Err("this optimizer cannot change its parameters, so it cannot be sharded".into())
    }

    /// Makes later steps read each group's learning rate from a tensor on
    /// the parameters' device, which [`set_lrs`](Self::set_lrs) fills: a
    /// step captured in a CUDA graph then follows the scheduler on replay
    /// instead of keeping the rate it was captured with (PyTorch's
    /// `capturable` optimizers with a tensor `lr`). Refused, with why, by
    /// an optimizer that cannot.
    fn use_device_lrs(&mut self) -> Result<(), String> {
        Err("this optimizer cannot take its learning rates from the GPU, so its step cannot be captured in a CUDA graph; use adamw or adam".into())
    }

    /// The processes whose shards together make the parameters, for a
    /// sharded optimizer: norms and overflow checks of its gradients must
    /// combine across them. `None` when each process holds all.
    fn process_group(&self) -> Option<&dyn hearth_comm::ProcessGroup> {
        None
    }

    /// For a sharded optimizer, which of [`parameters`](Self::parameters)
    /// are shards (the others are whole on every process); empty otherwise.
    fn shard_mask(&self) -> Vec<bool> {
        Vec::new()
    }

    /// Which optimizer state is shaped like its parameter
    /// (`exp_avg`, `momentum_buffer`): what sharding cuts into rows. Other
    /// state (`step`) is whole on every process.
    fn param_shaped_state(&self) -> &'static [&'static str] {
        &[]
    }

    /// The state a checkpoint holds: [`state_dict`](Self::state_dict),
    /// except for a sharded optimizer, whose state is gathered whole from
    /// every process, one tensor at a time (a collective: every process
    /// calls it); where `keep` is false the gathered tensors are dropped
    /// (the process only takes part) and the state holds none.
    fn full_state_dict(&self, keep: bool) -> Result<OptimizerState, String> {
        let _ = keep;
        Ok(self.state_dict())
    }

    /// Loads what [`full_state_dict`](Self::full_state_dict) gave (a sharded
    /// optimizer keeps its own rows).
    fn load_full_state_dict(&mut self, state: OptimizerState) -> Result<(), String> {
        self.load_state_dict(state)
    }

    /// For a sharded optimizer, which rows of the whole state tensor `key`
    /// (`state.<i>.<name>`) this process's holds, when it holds only some;
    /// `None` for state every process holds whole (a sharded checkpoint's
    /// pieces, see [`crate::checkpoint::ShardedTensors`]).
    fn held_rows(&self, key: &str) -> Option<crate::checkpoint::HeldRows> {
        let _ = key;
        None
    }

    /// Bytes of state this process holds (for memory reports).
    fn local_state_bytes(&self) -> u64 {
        self.state_dict()
            .tensors
            .iter()
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }

    /// The learning rate of the first group.
    fn lr(&self) -> f64 {
        self.lrs()[0]
    }
    /// Sets every group's learning rate.
    fn set_lr(&mut self, lr: f64) {
        let n = self.lrs().len();
        self.set_lrs(&vec![lr; n]);
    }
}

/// An optimizer's checkpointable state.
#[derive(Debug)]
pub struct OptimizerState {
    /// `state.<i>.<name>` tensors.
    pub tensors: Vec<(String, Tensor)>,
    /// Per group: `lr`, `weight_decay` and the parameter count.
    pub groups: Vec<GroupState>,
}

impl OptimizerState {
    /// The same state: new handles to the same tensors.
    pub fn shallow_clone(&self) -> Self {
        Self {
            tensors: self
                .tensors
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect(),
            groups: self.groups.clone(),
        }
    }
}

/// One parameter group's settings in a checkpoint.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GroupState {
    /// Learning rate.
    pub lr: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// Number of parameters in the group.
    pub params: usize,
}

pub(super) fn group_states(groups: &[Group]) -> Vec<GroupState> {
    groups
        .iter()
        .map(|g| GroupState {
            lr: g.lr,
            weight_decay: g.weight_decay,
            params: g.params.len(),
        })
        .collect()
}

/// Checks `state`'s groups against `groups`, applies their settings, and
/// returns a lookup of the state tensors by name.
pub(super) fn apply_groups(
    groups: &mut [Group],
    state: OptimizerState,
) -> Result<std::collections::HashMap<String, Tensor>, String> {
    let shape: Vec<usize> = groups.iter().map(|g| g.params.len()).collect();
    let saved: Vec<usize> = state.groups.iter().map(|g| g.params).collect();
    if shape != saved {
        return Err(format!(
            "the checkpoint's parameter groups hold {saved:?} parameters, this optimizer's {shape:?}"
        ));
    }
    for (g, s) in groups.iter_mut().zip(&state.groups) {
        g.lr = s.lr;
        g.weight_decay = s.weight_decay;
    }
    Ok(state.tensors.into_iter().collect())
}

/// The saved tensor `state.<i>.<name>` shaped like `like`, on its device.
pub(super) fn restore(
    saved: &mut std::collections::HashMap<String, Tensor>,
    i: usize,
    name: &str,
    like: &Tensor,
    same_shape: bool,
) -> Result<Option<Tensor>, String> {
    let key = format!("state.{i}.{name}");
    let Some(t) = saved.remove(&key) else {
        return Ok(None);
    };
    if same_shape && t.size() != like.size() {
        return Err(format!(
            "`{key}` has shape {:?}, its parameter {:?}",
            t.size(),
            like.size()
        ));
    }
    Ok(Some(t.to_device(like.device())))
}

/// A group with its values resolved against the optimizer's defaults.
pub(super) struct Group {
    pub(super) params: Vec<Tensor>,
    pub(super) lr: f64,
    pub(super) weight_decay: f64,
}

pub(super) fn resolve(groups: impl IntoParamGroups, lr: f64, weight_decay: f64) -> Vec<Group> {
    groups
        .into_param_groups()
        .into_iter()
        .map(|g| Group {
            params: g.params,
            lr: g.lr.unwrap_or(lr),
            weight_decay: g.weight_decay.unwrap_or(weight_decay),
        })
        .collect()
}

pub(super) fn set_group_lrs(groups: &mut [Group], lrs: &[f64]) {
    assert_eq!(
        lrs.len(),
        groups.len(),
        "one learning rate per parameter group"
    );
    for (g, &lr) in groups.iter_mut().zip(lrs) {
        g.lr = lr;
    }
}

pub(super) fn all_params(groups: &[Group]) -> Vec<Tensor> {
    groups
        .iter()
        .flat_map(|g| g.params.iter().map(Tensor::shallow_clone))
        .collect()
}

/// One empty state slot per parameter, group by group.
pub(super) fn empty_slots<T>(groups: &[Group]) -> Vec<Vec<Option<T>>> {
    groups
        .iter()
        .map(|g| g.params.iter().map(|_| None).collect())
        .collect()
}

/// Puts `restored` (one entry per parameter, across groups) into `slots`.
pub(super) fn fill_slots<T>(slots: &mut [Vec<Option<T>>], restored: Vec<Option<T>>) {
    let mut it = restored.into_iter();
    for slot in slots.iter_mut().flatten() {
        *slot = it.next().expect("one per parameter");
    }
}

pub(super) fn zero_grads(groups: &mut [Group]) {
    let params = all_params(groups);
    hearth_ops::clear_grads(&params).expect("dropping gradients cannot fail");
}

/// Puts `params` in place of the parameters of `groups`, one for one;
/// refused when `has_state` or the counts differ.
pub(super) fn replace_group_params(
    groups: &mut [Group],
    params: Vec<Tensor>,
    has_state: bool,
) -> Result<(), String> {
    let count: usize = groups.iter().map(|g| g.params.len()).sum();
    if params.len() != count {
        return Err(format!(
            "{} tensors given for {count} parameters",
            params.len()
        ));
    }
    if has_state {
        return Err("the optimizer already took a step; prepare it before training".into());
    }
    let mut it = params.into_iter();
    for g in groups.iter_mut() {
        for p in g.params.iter_mut() {
            *p = it.next().expect("counted above");
        }
    }
    Ok(())
}
