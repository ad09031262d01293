//! SGD with momentum, dampening, Nesterov and weight decay, as
//! `torch.optim.SGD(fused=True)`.

use super::{grads_of, zero_grads, Optimizer};
use crate::ops::{self, SgdHyper};
use tch::{TchError, Tensor};

/// SGD; with momentum, one buffer per parameter, filled on its first step.
pub struct Sgd {
    params: Vec<Tensor>,
    hyper: SgdHyper,
    buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    /// An SGD over `params` (tensors that require grad).
    pub fn new(params: Vec<Tensor>, hyper: SgdHyper) -> Self {
        let buffers = params.iter().map(|_| None).collect();
        Self {
            params,
            hyper,
            buffers,
        }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<(), TchError> {
        let with_grad = grads_of(&self.params);
        let use_momentum = self.hyper.momentum != 0.0;
        // Parameters stepping for the first time take their buffer from the
        // gradient; the fused kernel does that for a whole call, so they go
        // in a call of their own.
        let (mut fresh, mut seen) = ((vec![], vec![], vec![]), (vec![], vec![], vec![]));
        for (i, grad) in with_grad {
            let param = &self.params[i];
            let first = use_momentum && self.buffers[i].is_none();
            let group = if first { &mut fresh } else { &mut seen };
            if use_momentum {
                let buf = self.buffers[i].get_or_insert_with(|| param.zeros_like());
                group.2.push(buf.shallow_clone());
            }
            group.0.push(param.shallow_clone());
            group.1.push(grad);
        }
        tch::no_grad(|| {
            ops::fused_sgd(&fresh.0, &fresh.1, &fresh.2, self.hyper, true)?;
            ops::fused_sgd(&seen.0, &seen.1, &seen.2, self.hyper, false)
        })
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
