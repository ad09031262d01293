//! `save_state` / `load_state`: everything a run needs to continue exactly
//! where it stopped, in Accelerate's layout with safetensors and JSON in
//! place of pickle, written as a complete folder or not at all.
//!
//! A checkpoint folder holds `model.safetensors` (`model_1.safetensors`, …
//! per prepared model), `optimizer.safetensors` + `optimizer.json`
//! (`optimizer_1…`), `scheduler.bin` + `scheduler.json` (the plugin's own
//! state and the step count), `scaler.json` (fp16), `dataloader.json`
//! (`dataloader_1…`: epoch, batches taken, seed), `random_states_0.safetensors`
//! (CPU and CUDA generators), `custom_checkpoint_<i>.bin` for objects given
//! to `register_for_checkpointing`, `trainer_state.json` and, written last,
//! `hearth_checkpoint.json` (the manifest that marks it complete). Saved
//! sharded (FSDP's SHARDED_STATE_DICT), the models and the optimizer state
//! are in `pytorch_model_fsdp_<i>/` and `optimizer_<i>/` instead, a file per
//! process (see `sharded.rs`).
//!
//! Checkpoint hooks (Wasm plugins, [`Accelerator::register_checkpoint_hook`])
//! run inside that transaction: `save` before the host writes (a hook may
//! write files and claim model tensors it saved itself), `seal` after every
//! file is written and before the commit, `load` before anything is
//! restored. A hook that fails abandons the save or the load.

mod buffers;
mod load;
mod pre_hooks;
mod save;
mod sharded;
mod snapshot;
mod state;

pub(crate) use buffers::{Session as SnapshotCopies, SnapshotBuffers};
pub use pre_hooks::{LoadStatePreHook, RemovableHandle, SaveStatePreHook};
pub use state::*;

/// A save of several writers (`save_on_each_node` on several machines)
/// this process committed, not yet known to have succeeded everywhere.
pub(crate) struct Provisional {
    /// Its folder.
    pub(crate) dest: std::path::PathBuf,
    /// The rotation to do once it has (folder, how many to keep).
    pub(crate) rotation: Option<(std::path::PathBuf, usize)>,
}
