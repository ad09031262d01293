//! The `hearth` command line. `main.rs` only calls [`main`]; each
//! subcommand has its own file.

mod app;
mod authoring;
mod checkpoint;
mod config;
mod data;
mod env;
mod launch;
mod model;
mod plugins;
mod report;
mod run;
pub use app::*;
