//! Adam and AdamW (Loshchilov & Hutter), as `torch.optim.Adam(fused=True)`
//! and `torch.optim.AdamW(fused=True)`.

use super::{
    all_params, apply_groups, empty_slots, fill_slots, group_states, replace_group_params, resolve,
    restore, set_group_lrs, zero_grads, Group, IntoParamGroups, Optimizer, OptimizerState,
};
use crate::ops::{self, AdamHyper};
use tch::{Kind, TchError, Tensor};

/// Adam or AdamW (`hyper.decoupled`) with state (`exp_avg`, `exp_avg_sq`,
/// `step`) per parameter, created on the first step each parameter has a
/// gradient. `hyper.lr` and `hyper.weight_decay` are the defaults of groups
/// that do not set their own.
pub struct Adam {
    groups: Vec<Group>,
    hyper: AdamHyper,
    state: Vec<Vec<Option<AdamState>>>,
}

struct AdamState {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
}

impl Adam {
    /// An Adam/AdamW over `groups` (a `Vec<Tensor>` is one group).
    pub fn new(groups: impl IntoParamGroups, hyper: AdamHyper) -> Self {
        let groups = resolve(groups, hyper.lr, hyper.weight_decay);
        let state = empty_slots(&groups);
        Self {
            groups,
            hyper,
            state,
        }
    }

    /// The defaults the optimizer was created with.
    pub fn hyper(&self) -> AdamHyper {
        self.hyper
    }
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<(), TchError> {
        for (group, state) in self.groups.iter().zip(&mut self.state) {
            let (mut p, mut g, mut m, mut v, mut s) = (vec![], vec![], vec![], vec![], vec![]);
            for (param, slot) in group.params.iter().zip(state.iter_mut()) {
                let grad = param.grad();
                if !grad.defined() {
                    continue;
                }
                let st = slot.get_or_insert_with(|| AdamState {
                    exp_avg: param.zeros_like(),
                    exp_avg_sq: param.zeros_like(),
                    step: Tensor::zeros([], (Kind::Float, param.device())),
                });
                p.push(param.shallow_clone());
                g.push(grad);
                m.push(st.exp_avg.shallow_clone());
                v.push(st.exp_avg_sq.shallow_clone());
                s.push(st.step.shallow_clone());
            }
            let hyper = AdamHyper {
                lr: group.lr,
                weight_decay: group.weight_decay,
                ..self.hyper
            };
            tch::no_grad(|| ops::fused_adam(&p, &g, &m, &v, &s, hyper))?;
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
        &["exp_avg", "exp_avg_sq"]
    }
    fn replace_parameters(&mut self, params: Vec<Tensor>) -> Result<(), String> {
        let has_state = self.state.iter().flatten().any(Option::is_some);
        replace_group_params(&mut self.groups, params, has_state)
    }
    fn state_dict(&self) -> OptimizerState {
        let mut tensors = Vec::new();
        for (i, st) in self.state.iter().flatten().enumerate() {
            if let Some(st) = st {
                tensors.push((format!("state.{i}.exp_avg"), st.exp_avg.shallow_clone()));
                tensors.push((
                    format!("state.{i}.exp_avg_sq"),
                    st.exp_avg_sq.shallow_clone(),
                ));
                tensors.push((format!("state.{i}.step"), st.step.shallow_clone()));
            }
        }
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
            let m = restore(&mut saved, i, "exp_avg", p, true)?;
            let v = restore(&mut saved, i, "exp_avg_sq", p, true)?;
            let s = restore(&mut saved, i, "step", p, false)?;
            restored.push(match (m, v, s) {
                (Some(exp_avg), Some(exp_avg_sq), Some(step)) => Some(AdamState {
                    exp_avg,
                    exp_avg_sq,
                    step: step.to_kind(Kind::Float),
                }),
                (None, None, None) => None,
                _ => {
                    return Err(format!(
                        "parameter {i}: the checkpoint holds part of its Adam state"
                    ))
                }
            });
        }
        fill_slots(&mut self.state, restored);
        Ok(())
    }
}
