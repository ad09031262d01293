//! Built-in models, TorchScript models, and the module tree that wrap policies will read.
//!
//! A model is a sequence of units (embedding, blocks…, head) that the host
//! can step through one by one; parameters live in a tch `VarStore` under
//! PyTorch's names (`blocks.0.qkv.weight`), which become checkpoint keys.

mod gpt;
mod mlp;
mod model;
mod torchscript;
mod trainability;
mod tree;
mod weights;

#[cfg(test)]
pub(crate) use gpt::tiny_gpt;
pub use gpt::{Gpt, GptConfig};
pub use mlp::{Mlp, MlpConfig};
pub use model::{sorted_variables, Model, StateDict, Unit, VarStoreModel};
pub use torchscript::{
    pack_labels, probe_forward, ModelOutput, TorchScriptError, TorchScriptModel,
};
pub use trainability::{apply as set_trainable, TrainabilityError, Trainable};
pub(crate) use tree::under;
pub use tree::{declaration_order, ModuleInfo, ModuleTree, TensorEntry};
pub use weights::Weights;
