//! AdamW (Loshchilov & Hutter), as `torch.optim.AdamW(fused=True)`.

use super::{grads_of, zero_grads, Optimizer};
use crate::ops::{self, AdamWHyper};
use tch::{Kind, TchError, Tensor};

/// AdamW with state (`exp_avg`, `exp_avg_sq`, `step`) per parameter, created
/// on the first step each parameter has a gradient.
pub struct AdamW {
    params: Vec<Tensor>,
    hyper: AdamWHyper,
    state: Vec<Option<AdamState>>,
}

struct AdamState {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
}

impl AdamW {
    /// An AdamW over `params` (tensors that require grad).
    pub fn new(params: Vec<Tensor>, hyper: AdamWHyper) -> Self {
        let state = params.iter().map(|_| None).collect();
        Self {
            params,
            hyper,
            state,
        }
    }

    /// The hyper-parameters.
    pub fn hyper(&self) -> AdamWHyper {
        self.hyper
    }
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<(), TchError> {
        let with_grad = grads_of(&self.params);
        let (mut p, mut g, mut m, mut v, mut s) = (vec![], vec![], vec![], vec![], vec![]);
        for (i, grad) in with_grad {
            let param = &self.params[i];
            let st = self.state[i].get_or_insert_with(|| AdamState {
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
        tch::no_grad(|| ops::fused_adamw(&p, &g, &m, &v, &s, self.hyper))
    }
    fn zero_grad(&mut self) {
        zero_grads(&mut self.params)
    }
    fn lr(&self) -> f64 {
        self.hyper.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.hyper.lr = lr;
    }
    fn parameters(&self) -> &[Tensor] {
        &self.params
    }
}
