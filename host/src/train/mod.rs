//! Training: the config file and the config-driven loop behind
//! `hearth run`.

pub mod config;
mod eval;
mod loss;
mod progress;
mod runner;

pub use config::{ConfigError, TrainConfig};
pub use eval::Evaluation;
pub use loss::lm_loss;
pub use runner::{run, RunOptions, RunSummary, TrainError};
