//! Checkpoints: save_state/load_state against Accelerate's, checkpoint
//! hook plugins, and model files PyTorch and transformers read.

mod checkpointing;
mod hooks;
mod model_files;
