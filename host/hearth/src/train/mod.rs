//! Training: the config file and the config-driven loop behind
//! `hearth run`.

mod adapter;
pub mod config;
mod data_check;
mod error;
mod eval;
mod graphed;
mod history;
mod loss;
mod plan;
pub mod preempt;
mod profile;
mod progress;
mod results;
mod run_options;
mod runner;
mod setup;
mod step;
mod stream;

pub use config::flatten_toml;
pub use config::{ConfigError, TrainConfig};
pub use data_check::{prepare_data, DataReport};
pub use error::TrainError;
pub use eval::Evaluation;
pub use graphed::{GraphStats, WARMUP_STEPS as CUDA_GRAPH_WARMUP_STEPS};
pub use history::{read_history, History, Record, HISTORY_NAME};
pub use loss::lm_loss;
pub use plan::{module_tree, plan, PerProcess, Plan, PlannedModule};
pub use preempt::PREEMPTED_EXIT;
pub use results::RunSummary;
pub use run_options::RunOptions;
pub use runner::run;
