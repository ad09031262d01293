//! `hearth run CONFIG`.

use super::Failure;
use clap::Args;
use hearth::train::{self, RunOptions, TrainConfig, TrainError};
use std::path::PathBuf;

/// Arguments of `hearth run`. Flags win over the config file.
#[derive(Debug, Args)]
pub(super) struct RunArgs {
    /// The training config (TOML); see examples/sort-digits.toml.
    config: PathBuf,
    /// Folder for run folders (overrides run.output-dir).
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Number of steps (overrides run.steps).
    #[arg(long)]
    steps: Option<u64>,
    /// Train on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,
    /// No progress bar (log lines only).
    #[arg(long, short)]
    quiet: bool,
    /// Also look for plugins here (before HEARTH_PLUGIN_PATH, the project's plugins/ and the built-ins).
    #[arg(long = "plugin-dir", value_name = "DIR")]
    plugin_dirs: Vec<PathBuf>,
    /// Continue from the newest complete checkpoint in the run folder (see run.save-every).
    #[arg(long)]
    resume: bool,
    /// Record some steps with libtorch's profiler (as the config's profile table says, by default steps 7 to 9) and write profile_RANK.json here.
    #[arg(long, value_name = "DIR")]
    profile: Option<PathBuf>,
}

pub(super) fn execute(args: RunArgs) -> Result<(), Failure> {
    let config = TrainConfig::from_file(&args.config).map_err(Failure::bad_input)?;
    let options = RunOptions {
        output_dir: args.output_dir,
        steps: args.steps,
        cpu: args.cpu,
        quiet: args.quiet,
        plugin_dirs: args.plugin_dirs,
        resume: args.resume,
        // Restarted by `hearth launch --max-restarts`: from the newest
        // complete checkpoint, if the run got to one.
        resume_if_any: hearth::launch::restart_count() > 0,
        profile: args.profile,
    };
    let summary = train::run(&config, &options).map_err(|e| match e {
        TrainError::Data(_)
        | TrainError::Dataset(_)
        | TrainError::TooFewWindows { .. }
        | TrainError::Init { .. }
        | TrainError::Trainability { .. }
        | TrainError::Adapter { .. }
        | TrainError::NoCuda(_)
        | TrainError::CudaGraphRefused { .. }
        | TrainError::Plugin { .. }
        | TrainError::TorchScript(_)
        | TrainError::Prepare(hearth::accelerator::PrepareError::Sharding(
            hearth::accelerator::ShardingError::Cut(_),
        ))
        | TrainError::Profile(
            hearth::profiling::ProfileError::Activity(_)
            | hearth::profiling::ProfileError::Schedule(_),
        ) => Failure::bad_input(e),
        TrainError::Preempted { .. } => Failure::preempted(e),
        _ => Failure::failed(e),
    })?;
    if summary.process_index != 0 {
        return Ok(()); // the main process reports
    }
    if summary.final_loss.is_nan() {
        // Resumed at the last step: nothing was left to train.
        println!("no steps left to train (all {} taken)", summary.steps);
    } else {
        println!("final training loss: {:.4}", summary.final_loss);
        println!("throughput: {:.0} tokens/s", summary.tokens_per_sec);
    }
    if let Some(eval) = summary.eval {
        println!("{eval}");
    }
    println!("model written to {}", summary.model_path.display());
    Ok(())
}
