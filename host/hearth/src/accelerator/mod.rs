//! The user-facing façade, Accelerate's `Accelerator` for Rust: the builder,
//! `prepare` and what it wraps (model, optimizer, data loader, scheduler),
//! backward with accumulation and loss scaling, clipping, the shared
//! gradient state, checkpoints (`save_state`/`load_state`), trackers, and
//! helpers over nested tensors.

mod builder;
mod checkpointing;
mod collectives;
mod data_parallel;
mod facade;
mod grad;
mod join;
mod kinds;
mod loader;
mod memory;
mod model;
mod model_files;
mod nested;
mod optimizer;
mod prepare;
mod profile;
mod scheduler;
mod sharding;
mod state;
mod trackers;
mod unprepared;

pub use crate::parallel::{plan_units, policy_modules, policy_units, BackwardError, ShardingError};
pub use builder::{
    accumulation_steps_from_env, AcceleratorBuilder, BuildError, DataLoaderConfiguration,
};
pub use checkpointing::{
    node_name, Checkpointable, LoadStatePreHook, ProjectConfiguration, RemovableHandle,
    SaveStatePreHook, TrainerState,
};
pub use facade::{Accelerator, AutocastKwargs, RngState};
pub use grad::clip_grad_norm_;
pub use join::JoinError;
pub use kinds::{LoggerType, RngType};
pub use loader::{PreparedBatches, PreparedDataLoader, TryPreparedBatches};
pub use memory::{find_executable_batch_size, is_out_of_memory, BatchSizeError};
pub use model::{ForwardError, PreparedModel};
pub use nested::{TensorTree, TreeShape};
pub use optimizer::AcceleratedOptimizer;
pub use prepare::{Prepare, PrepareError};
pub use scheduler::{AcceleratedScheduler, LrSchedule};
pub use sharding::MemoryStats;
pub use state::{GradientAccumulationPlugin, GradientState};
pub use trackers::{InitTrackersError, TrackerHandle, TrackerHub, UnknownTracker};

/// Locks `m`, taking the data over even if a panicking holder poisoned it
/// (the shared optimizer, scheduler and object states stay usable).
fn lock<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
