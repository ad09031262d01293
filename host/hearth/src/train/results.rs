//! What a finished run leaves: its model (under the names its pretrained
//! weights had), a copy of its config, and `summary.json` ([`RunSummary`]).

use super::config::TrainConfig;
use super::error::TrainError;
use super::eval::Evaluation;
use super::graphed::GraphStats;
use super::setup::io_err;
use crate::accelerator::{Accelerator, MemoryStats, PreparedModel};
use crate::models::Model;
use serde::Serialize;
use std::collections::HashMap;
use std::path::PathBuf;

/// What a finished run reports (also written as `summary.json`).
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// The run folder.
    pub run_dir: PathBuf,
    /// The trained model's weights.
    pub model_path: PathBuf,
    /// Device trained on (`cpu`, `cuda:0`).
    pub device: String,
    /// Scalar parameters of the model.
    pub num_parameters: i64,
    /// Optimizer steps taken.
    pub steps: u64,
    /// Mean training loss over the last logging window.
    pub final_loss: f64,
    /// Training throughput in input tokens per second, measured after warm-up steps.
    pub tokens_per_sec: f64,
    /// The final held-out evaluation, when the dataset has one.
    pub eval: Option<Evaluation>,
    /// This process's rank (the summary file is the main process's).
    pub process_index: usize,
    /// Number of processes that trained together.
    pub num_processes: usize,
    /// What gradient averaging did on this process (the file holds the
    /// main process's counts; `bytes` is what it sent; zeros for one process).
    pub gradient_sync: crate::parallel::SyncStats,
    /// Bytes of parameters, gradients and optimizer state this process
    /// held at the last step (the main process's in the file).
    pub memory: MemoryStats,
    /// The FSDP settings the run sharded with, when `[fsdp]` is on.
    pub fsdp: Option<crate::parallel::FsdpSettings>,
    /// What the CUDA graph did, when `run.cuda-graph` is on.
    pub cuda_graph: Option<GraphStats>,
    /// This process's Chrome trace, when the run was profiled.
    pub profile: Option<PathBuf>,
    /// What calls into plugins cost in this process during the run, per
    /// plugin (a scheduler's wall time is the training loop's; trackers'
    /// CPU time is their own thread's). A process running several runs at
    /// once counts all their calls.
    pub plugin_calls: Vec<hearth_plugins::PluginUsage>,
    /// Each tracker's faults (call, step, kind), restarts, the values it
    /// never received and the step it was disabled at, if it was.
    pub trackers: Vec<hearth_plugins::TrackerHealth>,
    /// The steps whose checkpoint could not be written, with
    /// `on-save-error = "continue"` (why is in `metrics.jsonl`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checkpoints_not_saved: Vec<u64>,
}

/// What the training loop measured.
pub(super) struct Trained {
    pub(super) final_loss: f64,
    pub(super) tokens_per_sec: f64,
    /// This process's trace, when profiled.
    pub(super) profile: Option<PathBuf>,
    /// Steps whose checkpoint failed (`on-save-error = "continue"`).
    pub(super) checkpoints_not_saved: Vec<u64>,
}

/// What [`write_results`] takes of a run that finished training.
pub(super) struct Finished<'a> {
    pub(super) model: &'a PreparedModel<Box<dyn Model>>,
    /// The pretrained file's name of each tensor `init-from` loaded.
    pub(super) file_names: &'a HashMap<String, String>,
    /// The adapter `adapter-from` read: written back as `adapter/`.
    pub(super) adapter: Option<&'a super::adapter::RunAdapter>,
    pub(super) steps: u64,
    pub(super) cuda_graph: Option<GraphStats>,
    pub(super) trained: Trained,
}

/// Saves the weights (`model.safetensors`, or shards and their index) and,
/// from the main process, the config copy and `summary.json`.
pub(super) fn write_results(
    acc: &Accelerator,
    config: &TrainConfig,
    run_dir: &std::path::Path,
    finished: Finished,
    eval: Option<Evaluation>,
    plugin_calls: Vec<hearth_plugins::PluginUsage>,
) -> Result<RunSummary, TrainError> {
    // Started from pretrained weights: saved under their names, beside
    // copies of their folder's configuration and tokenizer.
    let (names, map) = (finished.file_names, config.model.init_names());
    let saved_name = |n: &str| {
        names
            .get(n)
            .cloned()
            .unwrap_or_else(|| map.unprefix(n).to_string())
    };
    let saved = acc.save_model_named(
        finished.model,
        run_dir,
        config.run.max_shard_size(),
        saved_name,
    )?;
    if let Some(adapter) = finished.adapter {
        super::adapter::write(acc, run_dir, adapter, saved_name)?;
    }
    if let (Some(from), true) = (&config.model.init_from, acc.is_main_process()) {
        crate::checkpoint::pretrained::copy_companions(&config.resolve(from), run_dir)
            .map_err(io_err(run_dir))?;
    }
    let model_path = saved
        .map(|s| s.index.unwrap_or_else(|| s.files[0].clone()))
        .unwrap_or_else(|| run_dir.join(crate::checkpoint::SAFE_WEIGHTS_NAME));
    let summary = RunSummary {
        run_dir: run_dir.to_path_buf(),
        model_path,
        device: hearth_ops::spelling::device_name(acc.device()),
        num_parameters: finished.model.num_parameters(),
        steps: finished.steps,
        final_loss: finished.trained.final_loss,
        tokens_per_sec: finished.trained.tokens_per_sec,
        eval,
        process_index: acc.process_index(),
        num_processes: acc.num_processes(),
        gradient_sync: acc.gradient_sync_stats(),
        memory: acc.memory_stats(),
        fsdp: acc.fsdp_settings().cloned(),
        cuda_graph: finished.cuda_graph,
        profile: finished.trained.profile,
        plugin_calls,
        trackers: acc.tracker_health().to_vec(),
        checkpoints_not_saved: finished.trained.checkpoints_not_saved,
    };
    if acc.is_main_process() {
        std::fs::create_dir_all(run_dir).map_err(io_err(run_dir))?;
        let config_copy = run_dir.join("config.toml");
        if let Ok(text) = std::fs::read_to_string(&config.source) {
            std::fs::write(&config_copy, text).map_err(io_err(&config_copy))?;
        }
        let summary_path = run_dir.join("summary.json");
        let json = serde_json::to_string_pretty(&summary).expect("summary serialises");
        std::fs::write(&summary_path, json).map_err(io_err(&summary_path))?;
    }
    Ok(summary)
}
