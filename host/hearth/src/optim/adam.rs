//! Adam and AdamW (Loshchilov & Hutter), as `torch.optim.Adam(fused=True)`
//! and `torch.optim.AdamW(fused=True)`.

use super::{
    all_params, apply_groups, empty_slots, fill_slots, group_states, replace_group_params, resolve,
    restore, set_group_lrs, zero_grads, Group, IntoParamGroups, Optimizer, OptimizerState,
};
use hearth_ops::{self as ops, AdamHyper};
use tch::{Kind, TchError, Tensor};

/// Adam or AdamW (`hyper.decoupled`) with state (`exp_avg`, `exp_avg_sq`,
/// `step`) per parameter, created on the first step each parameter has a
/// gradient. `hyper.lr` and `hyper.weight_decay` are the defaults of groups
/// that do not set their own.
pub struct Adam {
    groups: Vec<Group>,
    hyper: AdamHyper,
    state: Vec<Vec<Option<AdamState>>>,
    /// Each group's learning rate on its parameters' device, once
    /// [`Optimizer::use_device_lrs`] asked for them.
    device_lrs: Option<Vec<Tensor>>,
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
            device_lrs: None,
        }
    }

    /// The defaults the optimizer was created with.
    pub fn hyper(&self) -> AdamHyper {
        self.hyper
    }
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<(), TchError> {
        for (i, (group, state)) in self.groups.iter().zip(&mut self.state).enumerate() {
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
            let lr = self.device_lrs.as_ref().map(|lrs| &lrs[i]);
            tch::no_grad(|| ops::fused_adam(&p, &g, &m, &v, &s, hyper, lr))?;
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
        set_group_lrs(&mut self.groups, lrs);
        if let Some(device_lrs) = &mut self.device_lrs {
            for (t, &lr) in device_lrs.iter_mut().zip(lrs) {
                let _ = t.fill_(lr);
            }
        }
    }
    fn use_device_lrs(&mut self) -> Result<(), String> {
        let mut lrs = Vec::with_capacity(self.groups.len());
        for group in &self.groups {
            let device = group
                .params
                .first()
                .map_or(tch::Device::Cpu, Tensor::device);
            lrs.push(
                Tensor::from(group.lr)
                    .to_kind(Kind::Float)
                    .to_device(device),
            );
        }
        self.device_lrs = Some(lrs);
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Learning rates read from tensors that `set_lrs` fills (what a CUDA
    /// graph replays) give the same steps as rates passed by value.
    #[test]
    fn device_learning_rates_step_as_host_ones() {
        let hyper = AdamHyper {
            lr: 1e-2,
            betas: (0.9, 0.99),
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: true,
        };
        // Fixed starting weights, not the global generator: tests running
        // beside this one in the same process draw from it too.
        let start = || {
            let cpu = (Kind::Float, tch::Device::Cpu);
            let w = Tensor::linspace(-1.0, 1.0, 12, cpu).view([4, 3]);
            (w, Tensor::linspace(-0.5, 0.5, 3, cpu))
        };
        let train = |device_lrs: bool| {
            let (w, b) = start();
            let (w, b) = (w.set_requires_grad(true), b.set_requires_grad(true));
            let groups = vec![
                crate::optim::ParamGroup::new(vec![w.shallow_clone()]),
                crate::optim::ParamGroup::new(vec![b.shallow_clone()]).lr(5e-3),
            ];
            let mut opt = Adam::new(groups, hyper);
            if device_lrs {
                opt.use_device_lrs().unwrap();
            }
            for step in 0..5 {
                // Rates a float32 holds exactly (powers of two, small
                // multiples of them): a device rate is a float32 tensor,
                // so 1e-2 would reach the kernel as 0.00999999977….
                let lrs = [2f64.powi(-6 - step), (step + 1) as f64 * 2f64.powi(-8)];
                opt.set_lrs(&lrs);
                // Elementwise, not a matmul: MKL's AVX-512 sgemm may round
                // the same product differently from one call to the next
                // (its results depend on the buffers' alignment), and this
                // compares the optimizer, not the gradients.
                let x = Tensor::ones([4, 3], (Kind::Float, tch::Device::Cpu)) * (step + 1) as f64;
                ((&w * x) + &b).square().sum(Kind::Float).backward();
                opt.step().unwrap();
                opt.zero_grad();
            }
            (w.detach(), b.detach())
        };
        let (host, device) = (train(false), train(true));
        assert!(host.0.equal(&device.0) && host.1.equal(&device.1));
        let (moved, _) = train(false);
        assert!(!moved.equal(&start().0), "the steps changed nothing");
    }
}
