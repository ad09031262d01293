//! Optimizers that hearth owns: their state tensors live here (not inside
//! libtorch's C++ optimizers), so checkpoints and sharding can reach them.
//! Each step is one libtorch fused kernel per parameter group:
//! `_fused_adamw_`/`_fused_adam_` for AdamW/Adam and `_fused_sgd_` for SGD,
//! on CPU and CUDA. Parameter groups carry their own learning rate and
//! weight decay, as in PyTorch.

mod adam;
mod optimizer;
mod sgd;

pub use adam::Adam;
pub use optimizer::*;
pub use sgd::Sgd;
