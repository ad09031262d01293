//! `hearth checkpoint inspect|verify PATH`, `hearth checkpoint merge
//! CHECKPOINT OUT`, `hearth checkpoint merge-adapter RUN BASE OUT`.

use super::Failure;
use clap::{Args, Subcommand};
use hearth::checkpoint::{
    adapter, describe_checkpoint, is_checkpoint_dir, merge_fsdp_weights, parse_size, tensor_infos,
    verify_checkpoint, verify_complete, TensorInfo,
};
use std::path::{Path, PathBuf};

/// Arguments of `hearth checkpoint`.
#[derive(Debug, Args)]
pub(super) struct CheckpointArgs {
    #[command(subcommand)]
    command: CheckpointCommand,
}

#[derive(Debug, Subcommand)]
enum CheckpointCommand {
    /// List what a checkpoint folder (or a .safetensors file) holds: files,
    /// tensors with dtypes, shapes and sizes, and which state is present.
    Inspect {
        /// A checkpoint folder (from save_state) or a .safetensors file.
        path: PathBuf,
    },
    /// Check a checkpoint folder completely: manifest, sizes, every tensor's
    /// bytes, every JSON file. Exit status 1 when it is damaged.
    Verify {
        /// A checkpoint folder (from save_state).
        path: PathBuf,
    },
    /// Merge a checkpoint saved with state-dict-type = "SHARDED_STATE_DICT"
    /// into whole tensors: OUTPUT_PATH/model.safetensors, or numbered files
    /// with model.safetensors.index.json past --max-shard-size (Accelerate's
    /// `accelerate merge-weights`).
    Merge {
        /// The checkpoint folder (one model), or its pytorch_model_fsdp_N
        /// or optimizer_N folder.
        checkpoint_directory: PathBuf,
        /// The folder to write the merged weights into.
        output_path: PathBuf,
        /// The largest file to write, e.g. 5GB or 500MiB (default: one file).
        #[arg(long, value_parser = parse_size)]
        max_shard_size: Option<u64>,
    },
    /// Merge a run's LoRA adapter (RUN/adapter, or an adapter folder
    /// PeftModel.save_pretrained wrote) into its base model's weights (a
    /// Hugging Face folder or .safetensors file): OUT/model.safetensors
    /// holds each adapted weight as W + scale · B·A, beside the base
    /// folder's config and tokenizer, for a plain from_pretrained(OUT).
    MergeAdapter {
        /// The run folder (its adapter/) or an adapter folder.
        run: PathBuf,
        /// The base model the adapter was trained on.
        base: PathBuf,
        /// The folder to write the merged model into.
        out: PathBuf,
    },
}

fn print_tensors(tensors: &[TensorInfo]) {
    let mut table = super::table(&["tensor", "dtype", "shape", "bytes"]);
    for t in tensors {
        table.add_row(vec![
            t.name.clone(),
            t.dtype.to_string(),
            format!("{:?}", t.shape),
            t.bytes.to_string(),
        ]);
    }
    super::align_right(&mut table, &[3]);
    println!("{table}");
}

/// Which kinds of state the files of a checkpoint hold (one file per
/// object: `model_1.safetensors`, `optimizer.safetensors`, `scheduler.bin`…).
fn kinds(names: &[String]) -> String {
    let mut parts = Vec::new();
    let counted = |n: usize, what: &str| {
        if n == 1 {
            format!("1 {what}")
        } else {
            format!("{n} {what}s")
        }
    };
    for (stem, ext, what) in [
        ("model", ".safetensors", "model"),
        ("optimizer", ".safetensors", "optimizer"),
        ("scheduler", ".bin", "scheduler"),
        ("dataloader", ".json", "data loader"),
        ("random_states_", ".safetensors", "random state"),
        ("custom_checkpoint_", ".bin", "custom object"),
    ] {
        let n = names
            .iter()
            .filter(|n| !n.contains('/') && n.starts_with(stem) && n.ends_with(ext))
            .count();
        if n > 0 {
            parts.push(counted(n, what));
        }
    }
    // A sharded save: one folder per model and optimizer, a file per process.
    for (stem, what) in [
        ("pytorch_model_fsdp_", "sharded model"),
        ("optimizer_", "sharded optimizer"),
    ] {
        let folders: std::collections::BTreeSet<&str> = names
            .iter()
            .filter_map(|n| n.split_once('/').map(|(dir, _)| dir))
            .filter(|dir| dir.starts_with(stem))
            .collect();
        if !folders.is_empty() {
            parts.push(counted(folders.len(), what));
        }
    }
    if names.iter().any(|n| n == "scaler.json") {
        parts.push("fp16 scaler".into());
    }
    parts.join(", ")
}

fn inspect(path: &Path) -> Result<(), Failure> {
    if !is_checkpoint_dir(path) {
        let tensors = tensor_infos(path, false).map_err(Failure::bad_input)?;
        let total: usize = tensors.iter().map(|t| t.bytes).sum();
        println!(
            "{}: {} tensors, {total} bytes",
            path.display(),
            tensors.len()
        );
        print_tensors(&tensors);
        return Ok(());
    }
    let files = describe_checkpoint(path, false).map_err(Failure::failed)?;
    let names: Vec<String> = files.iter().map(|f| f.name.clone()).collect();
    println!(
        "{}: complete checkpoint — {}",
        path.display(),
        kinds(&names)
    );
    for f in &files {
        println!("  {} ({} bytes)", f.name, f.size);
        print_tensors(&f.tensors);
    }
    let manifest = verify_complete(path).map_err(Failure::failed)?;
    for hook in &manifest.hooks {
        match hook.claimed.len() {
            0 => println!("checkpoint hook {}", hook.name),
            n => println!(
                "checkpoint hook {} saved {n} tensor(s) itself (loading needs it): {}",
                hook.name,
                hook.claimed
                    .iter()
                    .map(|k| k.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
    if let Ok(text) = std::fs::read_to_string(path.join("trainer_state.json")) {
        println!(
            "trainer state: {}",
            text.split_whitespace().collect::<Vec<_>>().join(" ")
        );
    }
    Ok(())
}

pub(super) fn execute(args: CheckpointArgs) -> Result<(), Failure> {
    match args.command {
        CheckpointCommand::Inspect { path } => inspect(&path),
        CheckpointCommand::Verify { path } => {
            let files = verify_checkpoint(&path).map_err(Failure::failed)?;
            let tensors: usize = files.iter().map(|f| f.tensors.len()).sum();
            let bytes: u64 = files.iter().map(|f| f.size).sum();
            println!(
                "{}: complete and readable — {} files, {tensors} tensors, {bytes} bytes",
                path.display(),
                files.len()
            );
            Ok(())
        }
        CheckpointCommand::Merge {
            checkpoint_directory,
            output_path,
            max_shard_size,
        } => {
            let saved = merge_fsdp_weights(&checkpoint_directory, &output_path, max_shard_size)
                .map_err(Failure::failed)?;
            let files: Vec<String> = saved
                .files
                .iter()
                .map(|f| f.display().to_string())
                .collect();
            println!(
                "merged {} into {} ({} bytes)",
                checkpoint_directory.display(),
                files.join(", "),
                saved.total_size
            );
            Ok(())
        }
        CheckpointCommand::MergeAdapter { run, base, out } => {
            let folder = run.join("adapter");
            let adapter = match folder.join(adapter::ADAPTER_CONFIG).is_file() {
                true => folder,
                false => run,
            };
            let merged = adapter::merge(&adapter, &base, &out).map_err(Failure::bad_input)?;
            println!(
                "merged {} into {} weights of {}: {}",
                adapter.display(),
                merged.merged,
                base.display(),
                merged.path.display()
            );
            Ok(())
        }
    }
}
