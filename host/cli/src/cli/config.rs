//! `hearth config`: writes a default training config to start from
//! (Accelerate's `write_basic_config`).

use super::Failure;
use std::path::PathBuf;

/// The default job (`make run`'s): a tiny GPT that learns to sort digits.
const DEFAULT_CONFIG: &str = include_str!("../../../../examples/sort-digits.toml");

/// Arguments of `hearth config`.
#[derive(Debug, clap::Args)]
#[command(
    about = "Write a default training config (the sort-digits job) to edit, or with --launch the launch config `hearth launch` reads; `hearth config schema` prints the config's JSON Schema",
    args_conflicts_with_subcommands = true
)]
pub(super) struct ConfigArgs {
    /// `schema`: print the JSON Schema of a training config instead.
    #[command(subcommand)]
    action: Option<ConfigAction>,
    /// Where to write it (default: hearth.toml; with --launch, the default
    /// launch config, ~/.config/hearth/default_config.json).
    path: Option<PathBuf>,
    /// Replace an existing training config.
    #[arg(long)]
    force: bool,
    /// Write the launch config instead (Accelerate's write_basic_config):
    /// one process per GPU, or one CPU process. An existing one is kept.
    #[arg(long)]
    launch: bool,
    /// The launch config's mixed precision: no, bf16 or fp16.
    #[arg(long, default_value = "no", requires = "launch")]
    mixed_precision: hearth::precision::MixedPrecision,
}

/// What `hearth config` does besides writing a config.
#[derive(Debug, clap::Subcommand)]
enum ConfigAction {
    /// Print the JSON Schema of a training config (for editors: Even
    /// Better TOML and taplo validate and complete configs with it).
    Schema,
}

pub(super) fn execute(args: ConfigArgs) -> Result<(), Failure> {
    if let Some(ConfigAction::Schema) = args.action {
        let schema = hearth::train::config::json_schema();
        println!(
            "{}",
            serde_json::to_string_pretty(&schema).expect("a JSON value prints")
        );
        return Ok(());
    }
    if args.launch {
        return match hearth::launch::write_basic_config(args.mixed_precision, args.path.as_deref())
            .map_err(Failure::failed)?
        {
            Some(path) => {
                println!(
                    "wrote {}; `hearth launch` reads it (or pass --config-file)",
                    path.display()
                );
                Ok(())
            }
            None => {
                let path = args
                    .path
                    .unwrap_or_else(hearth::launch::default_launch_config_path);
                println!(
                    "a launch config exists at {}; it was kept (edit it, or give another path)",
                    path.display()
                );
                Ok(())
            }
        };
    }
    let path = args.path.unwrap_or_else(|| "hearth.toml".into());
    if path.exists() && !args.force {
        return Err(Failure::bad_input(anyhow::anyhow!(
            "{} exists; pass --force to replace it or give another path",
            path.display()
        )));
    }
    hearth_ops::durable::write_atomically(&path, |f| {
        std::io::Write::write_all(f, DEFAULT_CONFIG.as_bytes())
    })
    .map_err(|e| Failure::failed(anyhow::anyhow!("cannot write {}: {e}", path.display())))?;
    println!(
        "wrote {}; train with `hearth run {0}` or `hearth launch -n 2 --cpu {0}`",
        path.display()
    );
    Ok(())
}
