//! Training: the config file and the config-driven loop behind
//! `hearth run`.

pub mod config;
mod eval;
mod history;
mod loss;
mod plan;
mod progress;
mod runner;
mod setup;

pub use config::flatten_toml;
pub use config::{ConfigError, TrainConfig};
pub use eval::Evaluation;
pub use history::{read_history, History, Record, HISTORY_NAME};
pub use loss::lm_loss;
pub use plan::{module_tree, plan, PerProcess, Plan, PlannedModule};
pub use runner::{run, RunOptions, RunSummary, TrainError};
