//! Optimizers that hearth owns: their state tensors live here (not inside
//! libtorch's C++ optimizers), so checkpoints and sharding can reach them.
//! Each step is one libtorch fused kernel over all parameters:
//! `_fused_adamw_` for AdamW and `_fused_sgd_` for SGD, on CPU and CUDA.

mod adamw;
mod sgd;

pub use adamw::AdamW;
pub use sgd::Sgd;

use tch::{TchError, Tensor};

/// An optimizer over a fixed list of parameters.
pub trait Optimizer {
    /// Applies one update from the parameters' current gradients (parameters
    /// without a gradient are left alone, as in PyTorch).
    fn step(&mut self) -> Result<(), TchError>;
    /// Clears the gradients.
    fn zero_grad(&mut self);
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate for the next steps.
    fn set_lr(&mut self, lr: f64);
    /// The parameters, in the order given at construction.
    fn parameters(&self) -> &[Tensor];
}

/// Gradients of the parameters that have one, with their indices.
fn grads_of(params: &[Tensor]) -> Vec<(usize, Tensor)> {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| (i, p.grad()))
        .filter(|(_, g)| g.defined())
        .collect()
}

fn zero_grads(params: &mut [Tensor]) {
    for p in params {
        p.zero_grad();
    }
}
