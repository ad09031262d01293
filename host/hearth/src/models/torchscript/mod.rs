//! Models exported from Python with `torch.jit.trace` or `torch.jit.script`
//! (`torch.jit.save`), trained by hearth with no Python at run time.
//!
//! `model.rs` loads one and runs it whole; `lazy.rs` loads one without
//! its weights and reads them as `prepare` asks; `pieces.rs` cuts one at a
//! wrap policy's units; `probe.rs` checks its forward pass before training.

mod lazy;
mod model;
mod pieces;
mod probe;

pub use model::{pack_labels, ModelOutput, TorchScriptError, TorchScriptModel};
pub use probe::probe_forward;
