//! `hearth model plan CONFIG`: the module tree, the units the configured
//! wrap policy picks, and the bytes per process of parameters, gradients
//! and optimizer state.

use super::Failure;
use crate::train::{self, RunOptions, TrainConfig, TrainError};
use clap::{Args, Subcommand};
use std::path::PathBuf;

/// Arguments of `hearth model`.
#[derive(Debug, Args)]
pub(super) struct ModelArgs {
    #[command(subcommand)]
    command: ModelCommand,
}

#[derive(Debug, Subcommand)]
enum ModelCommand {
    /// Print the model's module tree, the units its `[fsdp]` wrap policy
    /// picks, and what each process holds with N processes.
    Plan(PlanArgs),
}

#[derive(Debug, Args)]
struct PlanArgs {
    /// The training config (TOML) whose model and `[fsdp]` section to plan.
    config: PathBuf,
    /// Number of processes to plan for.
    #[arg(short = 'n', long = "num-processes", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    processes: u32,
    /// Print JSON: {"modules": [{"path", "class", "params", "bytes"}], "units": [...], "per_process": {...}}.
    #[arg(long)]
    json: bool,
    /// Also look for plugins here (before HEARTH_PLUGIN_PATH, the project's plugins/ and the built-ins).
    #[arg(long = "plugin-dir", value_name = "DIR")]
    plugin_dirs: Vec<PathBuf>,
}

pub(super) fn execute(args: ModelArgs) -> Result<(), Failure> {
    let ModelCommand::Plan(args) = args.command;
    let config = TrainConfig::from_file(&args.config).map_err(Failure::bad_input)?;
    let options = RunOptions {
        plugin_dirs: args.plugin_dirs,
        ..Default::default()
    };
    let plan = train::plan(&config, &options, args.processes as usize).map_err(|e| match e {
        TrainError::Torch(_) | TrainError::Io { .. } => Failure::failed(e),
        _ => Failure::bad_input(e),
    })?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&plan).expect("a plan serialises")
        );
        return Ok(());
    }
    println!(
        "{:<40} {:<16} {:>14} {:>14}",
        "module", "class", "params", "bytes"
    );
    for m in &plan.modules {
        let depth = m.path.matches('.').count() + usize::from(!m.path.is_empty());
        let name = if m.path.is_empty() { "(root)" } else { &m.path };
        let unit = if plan.units.contains(&m.path) {
            " *"
        } else {
            ""
        };
        println!(
            "{:<40} {:<16} {:>14} {:>14}",
            format!("{}{name}{unit}", "  ".repeat(depth)),
            m.class,
            m.params,
            m.bytes
        );
    }
    println!(
        "\n{} units (*) with {} and the `{}` policy: {}",
        plan.units.len(),
        plan.strategy,
        plan.policy,
        plan.units
            .iter()
            .map(|u| if u.is_empty() { "(root)" } else { u })
            .collect::<Vec<_>>()
            .join(", ")
    );
    let p = plan.per_process;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "per process of {}: parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} MiB",
        plan.processes,
        mib(p.param_bytes),
        mib(p.grad_bytes),
        mib(p.optimizer_bytes)
    );
    Ok(())
}
