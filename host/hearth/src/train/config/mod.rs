//! The TOML file behind `hearth run`, one file per section. Keys are
//! kebab-case; an unknown key, a wrong type or a key that does not apply to
//! the chosen `kind` is an error that names the file and the key.
//!
//! ```toml
//! [run]
//! name = "sort-digits"
//! steps = 1500
//! [model]
//! kind = "gpt"
//! [data]
//! kind = "sort-digits"
//! ```

mod checkpoint_hooks;
mod data;
mod distributed;
mod error;
mod eval;
mod fsdp;
mod model;
mod optimizer;
mod pins;
mod profile;
mod run;
mod scheduler;
mod trackers;
mod train_config;

pub use checkpoint_hooks::CheckpointHookSection;
pub use data::{BinDtype, DataKind, DataSection, Sampling};
pub use distributed::DistributedSection;
pub use error::ConfigError;
pub use eval::EvalSection;
pub use fsdp::FsdpSection;
pub use model::{ModelKind, ModelSection};
pub use optimizer::{OptimizerKind, OptimizerSection};
pub use pins::{PluginLock, LOCK_FILE};
pub use profile::ProfileSection;
pub use run::{DeviceChoice, OnSaveError, RunSection};
pub use scheduler::SchedulerSection;
pub use trackers::TrackerSection;
pub use train_config::*;
