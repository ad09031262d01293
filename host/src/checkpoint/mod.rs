//! Checkpoint files: tensors in safetensors (the Hugging Face layout, with
//! `{"format": "pt"}` metadata so PyTorch loaders accept them), written
//! atomically. State folders, rotation and resume join this module.

mod safetensors_io;

pub use safetensors_io::{load_safetensors, save_safetensors, CheckpointError};
