//! SGD with momentum, dampening, Nesterov and weight decay, as
//! `torch.optim.SGD(fused=True)`.

use super::{
    all_params, apply_groups, empty_slots, fill_slots, group_states, replace_group_params, resolve,
    restore, set_group_lrs, zero_grads, Group, IntoParamGroups, Optimizer, OptimizerState,
};
use hearth_ops::{self as ops, SgdHyper};
use tch::{TchError, Tensor};

/// SGD; with momentum, one buffer per parameter, filled on its first step.
/// `hyper.lr` and `hyper.weight_decay` are the defaults of groups that do
/// not set their own.
pub struct Sgd {
    groups: Vec<Group>,
    hyper: SgdHyper,
    buffers: Vec<Vec<Option<Tensor>>>,
}

impl Sgd {
    /// An SGD over `groups` (a `Vec<Tensor>` is one group).
    pub fn new(groups: impl IntoParamGroups, hyper: SgdHyper) -> Self {
        let groups = resolve(groups, hyper.lr, hyper.weight_decay);
        let buffers = empty_slots(&groups);
        Self {
            groups,
            hyper,
            buffers,
        }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<(), TchError> {
        let use_momentum = self.hyper.momentum != 0.0;
        for (group, buffers) in self.groups.iter().zip(&mut self.buffers) {
            // Parameters stepping for the first time take their buffer from
            // the gradient; the fused kernel does that for a whole call, so
            // they go in a call of their own.
            let (mut fresh, mut seen) = ((vec![], vec![], vec![]), (vec![], vec![], vec![]));
            for (param, slot) in group.params.iter().zip(buffers.iter_mut()) {
                let grad = param.grad();
                if !grad.defined() {
                    continue;
                }
                let first = use_momentum && slot.is_none();
                let part = if first { &mut fresh } else { &mut seen };
                if use_momentum {
                    let buf = slot.get_or_insert_with(|| param.zeros_like());
                    part.2.push(buf.shallow_clone());
                }
                part.0.push(param.shallow_clone());
                part.1.push(grad);
            }
            let hyper = SgdHyper {
                lr: group.lr,
                weight_decay: group.weight_decay,
                ..self.hyper
            };
            tch::no_grad(|| {
                ops::fused_sgd(&fresh.0, &fresh.1, &fresh.2, hyper, true)?;
                ops::fused_sgd(&seen.0, &seen.1, &seen.2, hyper, false)
            })?;
        }
        Ok(())
    }
    fn zero_grad(&mut self) {
        zero_grads(&mut self.groups)
    }
    fn lrs(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.lr).collect()
    }
    fn set_lrs(&mut self, lrs: &[f64]) {
        set_group_lrs(&mut self.groups, lrs)
    }
    fn parameters(&self) -> Vec<Tensor> {
        all_params(&self.groups)
    }
    fn param_shaped_state(&self) -> &'static [&'static str] {
        &["momentum_buffer"]
    }
    fn replace_parameters(&mut self, params: Vec<Tensor>) -> Result<(), String> {
        let has_state = self.buffers.iter().flatten().any(Option::is_some);
        replace_group_params(&mut self.groups, params, has_state)
    }
    fn state_dict(&self) -> OptimizerState {
        let tensors = self
            .buffers
            .iter()
            .flatten()
            .enumerate()
            .filter_map(|(i, b)| {
                b.as_ref()
                    .map(|b| (format!("state.{i}.momentum_buffer"), b.shallow_clone()))
            })
            .collect();
        OptimizerState {
            tensors,
            groups: group_states(&self.groups),
        }
    }
    fn load_state_dict(&mut self, state: OptimizerState) -> Result<(), String> {
        let mut saved = apply_groups(&mut self.groups, state)?;
        let params = all_params(&self.groups);
        let mut restored = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            restored.push(restore(&mut saved, i, "momentum_buffer", p, true)?);
        }
        fill_slots(&mut self.buffers, restored);
        Ok(())
    }
}
