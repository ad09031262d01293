//! `hearth data prepare CONFIG`: tokenizes a config's documents into their
//! token cache ahead of a run (on a login node, say) and times the loader.

use super::Failure;
use clap::{Args, Subcommand};
use hearth::train::{self, TrainConfig};
use std::path::PathBuf;

/// Arguments of `hearth data`.
#[derive(Debug, Args)]
pub(super) struct DataArgs {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(Debug, Subcommand)]
enum DataCommand {
    /// Open a config's `[data]` as `hearth run` would — tokenizing JSON
    /// Lines or Parquet into their cache when it is absent — and time the
    /// loader drawing training batches on one process.
    Prepare(PrepareArgs),
}

#[derive(Debug, Args)]
struct PrepareArgs {
    /// The training config (TOML) whose `[data]` to prepare.
    config: PathBuf,
    /// Training batches to draw when timing the loader.
    #[arg(long, default_value_t = 200)]
    batches: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub(super) fn execute(args: DataArgs) -> Result<(), Failure> {
    let DataCommand::Prepare(args) = args.command;
    let config = TrainConfig::from_file(&args.config).map_err(Failure::bad_input)?;
    let report = train::prepare_data(&config, args.batches).map_err(Failure::building)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).expect("a report serialises")
        );
        return Ok(());
    }
    println!("data ready in {:.2} s", report.prepare_seconds);
    println!(
        "vocabulary {}, sequences of {} tokens{}",
        report.vocab_size,
        report.seq_len,
        report
            .windows
            .map(|w| format!(", {w} training windows"))
            .unwrap_or_default()
    );
    println!("{} validation batches", report.validation_batches);
    println!(
        "loader: {:.0} tokens/s on one process ({} batches)",
        report.loader_tokens_per_sec, report.batches
    );
    Ok(())
}
