//! `hearth config`: writes a default training config to start from
//! (Accelerate's `write_basic_config`).

use super::Failure;
use std::path::PathBuf;

/// The default job (`make run`'s): a tiny GPT that learns to sort digits.
const DEFAULT_CONFIG: &str = include_str!("../../../examples/sort-digits.toml");

/// Arguments of `hearth config`.
#[derive(Debug, clap::Args)]
#[command(about = "Write a default training config (the sort-digits job) to edit")]
pub(super) struct ConfigArgs {
    /// Where to write it.
    #[arg(default_value = "hearth.toml")]
    path: PathBuf,
    /// Replace an existing file.
    #[arg(long)]
    force: bool,
}

pub(super) fn execute(args: ConfigArgs) -> Result<(), Failure> {
    if args.path.exists() && !args.force {
        return Err(Failure::bad_input(anyhow::anyhow!(
            "{} exists; pass --force to replace it or give another path",
            args.path.display()
        )));
    }
    crate::durable::write_atomically(&args.path, |f| {
        std::io::Write::write_all(f, DEFAULT_CONFIG.as_bytes())
    })
    .map_err(|e| Failure::failed(anyhow::anyhow!("cannot write {}: {e}", args.path.display())))?;
    println!(
        "wrote {}; train with `hearth run {0}` or `hearth launch -n 2 --cpu {0}`",
        args.path.display()
    );
    Ok(())
}
