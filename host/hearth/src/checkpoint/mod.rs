//! Checkpoint files: tensors in safetensors (the Hugging Face layout, with
//! `{"format": "pt"}` metadata so PyTorch loaders accept them), written
//! atomically; model weights whole or sharded with an index, and loaded
//! back into a model with strict name, shape and dtype checks. Checkpoint
//! folders are written whole or not at all, numbered, rotated and found.

pub mod adapter;
mod describe;
pub mod digest;
mod model_files;
pub mod pretrained;
mod safetensors_io;
mod sharded;
mod state_dir;
pub mod storage;
mod writeback;

pub use describe::{
    describe_checkpoint, is_checkpoint_dir, tensor_infos, verify_checkpoint, FileReport, TensorInfo,
};
pub use model_files::{
    load_checkpoint_in_model, parse_size, plan_shards, save_model, save_model_from,
    stage_checkpoint_in_model, write_order, LoadReport, SavedModel, ShardIndex,
    SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
};
pub(crate) use model_files::{weight_files, WeightFile};
pub(crate) use safetensors_io::{dtype_of, kind_of, open_mapped, tensor_bytes, tensor_from_view};
pub use safetensors_io::{
    load_safetensors, read_safetensor, save_safetensors, CheckpointError, TensorMeta,
};
pub use sharded::{
    merge_fsdp_weights, model_shards_dir, optimizer_shards_dir, save_pieces, shard_file_name,
    HeldRows, Piece, ShardedTensors,
};
pub use state_dir::{
    newest_complete, newest_intact, numbered_checkpoints, rotate, rotate_after_commit, set_aside,
    set_aside_as, verify_complete, verify_contents, verify_intact, HookRecord, Manifest,
    ManifestFile, StagedCheckpoint, TensorKey, MANIFEST_NAME,
};
