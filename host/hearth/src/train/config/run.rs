//! `[run]`: what the run is called, how long it trains, where it writes.

use super::{ConfigError, Invalid};
use serde::Deserialize;
use std::path::PathBuf;

/// Where to train.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceChoice {
    /// The GPU when one is available, else the CPU (default).
    #[default]
    Auto,
    /// The CPU even when a GPU is available.
    Cpu,
    /// A CUDA GPU; an error when none is available.
    Cuda,
}

/// What a checkpoint that cannot be written does to the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum OnSaveError {
    /// The run ends with status 1 (default).
    #[default]
    Stop,
    /// The failure is logged and training goes on.
    Continue,
}

/// The `[run]` section.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RunSection {
    /// Name of the run; its folder is `output-dir/name`.
    pub name: String,
    /// Project name handed to trackers (default `hearth`).
    #[serde(default = "default_project")]
    pub project: String,
    /// Folder that holds run folders, relative to the current directory (default `runs`).
    #[serde(default = "default_output_dir")]
    pub output_dir: PathBuf,
    /// Number of optimizer steps.
    pub steps: u64,
    /// Seed for parameter initialisation and data (default 0).
    #[serde(default)]
    pub seed: u64,
    /// Log the mean loss every this many steps (default 100).
    #[serde(default = "default_log_every")]
    pub log_every: u64,
    /// `auto` (default), `cpu` or `cuda`.
    #[serde(default)]
    pub device: DeviceChoice,
    /// Micro-batches of `data.batch-size` whose gradients add up before each
    /// optimizer step (default: `HEARTH_GRADIENT_ACCUMULATION_STEPS`, else 1).
    pub gradient_accumulation_steps: Option<usize>,
    /// The last batch of each epoch ends an accumulation group (default
    /// true; false counts micro-batches across epochs). Accelerate's
    /// `GradientAccumulationPlugin(sync_with_dataloader=)`.
    pub sync_with_dataloader: Option<bool>,
    /// Average gradients between processes on every micro-batch, not only
    /// those that step (default false; `sync_each_batch=`).
    pub sync_each_batch: Option<bool>,
    /// Accelerate's `adjust_scheduler=`, accepted with Accelerate's effect:
    /// none (see `GradientAccumulationPlugin::adjust_scheduler`).
    pub adjust_scheduler: Option<bool>,
    /// `no`, `bf16` or `fp16` (default: `HEARTH_MIXED_PRECISION`, else `no`).
    /// fp16 scales the loss on a GPU; on the CPU it trains in float32, as
    /// Accelerate does.
    pub mixed_precision: Option<crate::precision::MixedPrecision>,
    /// Largest weight file of the saved model (`"10GB"` by default, as
    /// Accelerate's `save_model`); a larger model is saved in shards with
    /// `model.safetensors.index.json`.
    pub max_shard_size: Option<String>,
    /// Save a checkpoint (`save_state`) every this many steps into
    /// `<run folder>/checkpoints/checkpoint_<n>` (default: never); resume
    /// with `hearth run --resume`.
    pub save_every: Option<u64>,
    /// Keep only the newest this many checkpoints (default: all).
    pub keep_checkpoints: Option<usize>,
    /// What a checkpoint that cannot be written (a full file system, a
    /// used-up quota, a failing disk, a failed hook) does: `stop` (default)
    /// ends the run with status 1; `continue` logs it, records it in
    /// `metrics.jsonl` and trains on. Either way the previous checkpoint is
    /// untouched and the partial one removed. Accelerate has no such
    /// choice: its `save_state` raises.
    #[serde(default)]
    pub on_save_error: OnSaveError,
    /// Write each checkpoint on a background thread while training goes on
    /// (default true: the next save and the run's end wait for it); false
    /// blocks training until the checkpoint is on disk.
    #[serde(default = "default_async_save")]
    pub async_save: bool,
    /// Capture the training step in a CUDA graph after a few eager steps
    /// and replay it (default false): one launch per step instead of one
    /// per kernel. Needs a GPU, one process, no accumulation, no fp16, no
    /// `[fsdp]`, and Adam or AdamW; shapes must not change.
    #[serde(default)]
    pub cuda_graph: bool,
    /// Signals that stop the run politely: every process finishes the step
    /// it is in, they agree on the step, a checkpoint is saved, and hearth
    /// exits with status 75 (resume me). Default `["SIGTERM", "SIGUSR1"]`
    /// (what SLURM, Kubernetes and spot instances send, and what SLURM's
    /// `--signal` sends by default); `[]` leaves them their default (an
    /// immediate stop). Also `SIGUSR2`, `SIGINT`.
    #[serde(default = "default_save_on_signal")]
    pub save_on_signal: Vec<String>,
    /// Seconds a polite stop may take after its signal before hearth stops
    /// at once (the last complete checkpoint stays). Default 90: set it
    /// below the time your scheduler waits before it kills.
    #[serde(default = "default_signal_grace_seconds")]
    pub signal_grace_seconds: u64,
}

fn default_save_on_signal() -> Vec<String> {
    vec!["SIGTERM".into(), "SIGUSR1".into()]
}

fn default_async_save() -> bool {
    true
}

fn default_signal_grace_seconds() -> u64 {
    90
}

fn default_output_dir() -> PathBuf {
    PathBuf::from("runs")
}

fn default_project() -> String {
    "hearth".into()
}

impl RunSection {
    /// The shard size limit in bytes (default 10 GB).
    pub fn max_shard_size(&self) -> u64 {
        self.max_shard_size
            .as_deref()
            .and_then(|s| crate::checkpoint::parse_size(s).ok())
            .unwrap_or(10_000_000_000)
    }
}

fn default_log_every() -> u64 {
    100
}

impl RunSection {
    pub(super) fn validate(&self, invalid: &Invalid) -> Result<(), ConfigError> {
        if self.name.is_empty()
            || self.name.contains(['/', '\\'])
            || self.name == ".."
            || self.name == "."
        {
            return Err(invalid(
                "run.name",
                "must be a plain folder name (no slashes)".into(),
            ));
        }
        if self.steps == 0 {
            return Err(invalid("run.steps", "must be at least 1".into()));
        }
        if self.gradient_accumulation_steps == Some(0) {
            return Err(invalid(
                "run.gradient-accumulation-steps",
                "must be at least 1".into(),
            ));
        }
        for name in &self.save_on_signal {
            if crate::train::preempt::signal_number(name).is_none() {
                let names: Vec<&str> = crate::train::preempt::SIGNALS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect();
                return Err(invalid(
                    "run.save-on-signal",
                    format!("names {name:?}, which is not one of {}", names.join(", ")),
                ));
            }
        }
        if self.save_every == Some(0) {
            return Err(invalid("run.save-every", "must be at least 1".into()));
        }
        if self.keep_checkpoints == Some(0) {
            return Err(invalid(
                "run.keep-checkpoints",
                "must be at least 1 (leave it out to keep all)".into(),
            ));
        }
        if let Some(size) = &self.max_shard_size {
            crate::checkpoint::parse_size(size)
                .map_err(|why| invalid("run.max-shard-size", why))?;
        }
        if self.log_every == 0 {
            return Err(invalid("run.log-every", "must be at least 1".into()));
        }
        Ok(())
    }
}
