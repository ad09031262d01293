//! Why `hearth run` failed: [`TrainError`].

use crate::accelerator::{BackwardError, BuildError, ForwardError, PrepareError};
use crate::checkpoint::CheckpointError;
use crate::data::TextFileError;
use crate::models::TorchScriptError;
use hearth_plugins::PluginError;
use std::path::PathBuf;
use tch::TchError;

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The dataset could not be opened.
    #[error(transparent)]
    Data(#[from] TextFileError),
    /// A data file is unreadable or holds what the run cannot use.
    #[error(transparent)]
    Dataset(#[from] crate::data::DataError),
    /// Sequential sampling with fewer training windows than one step takes.
    #[error("config {config}: the training data holds {windows} windows of seq-len + 1 tokens, and one step of batch-size × processes takes {needed}; use more data, a smaller batch or fewer processes")]
    TooFewWindows {
        /// The config file.
        config: PathBuf,
        /// Windows in the training part.
        windows: usize,
        /// Windows one step takes.
        needed: usize,
    },
    /// Writing the model failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A libtorch operation failed.
    #[error("libtorch error")]
    Torch(#[from] TchError),
    /// A forward pass failed (a collective it runs: FULL_SHARD's gathers,
    /// DDP's `broadcast_buffers`).
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// A backward pass, or the gradient averaging after it, failed.
    #[error(transparent)]
    Backward(#[from] BackwardError),
    /// A collective between the processes failed.
    #[error("the processes could not agree")]
    Dist(#[from] hearth_comm::DistError),
    /// The TorchScript model could not be loaded.
    #[error(transparent)]
    TorchScript(#[from] TorchScriptError),
    /// An accelerator setting (or `HEARTH_*` variable) is unusable.
    #[error("cannot set up the accelerator")]
    Accelerator(#[from] BuildError),
    /// Preparing the model, optimizer or scheduler failed.
    #[error("cannot prepare the training objects")]
    Prepare(#[from] PrepareError),
    /// Profiling the run (`[profile]`, `--profile`) failed.
    #[error("profiling the run failed")]
    Profile(#[source] crate::profiling::ProfileError),
    /// The run folder could not be written.
    #[error("failed to write {path}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `run.device = "cuda"` on a machine without a usable GPU.
    #[error("config {0}: run.device = \"cuda\" but no CUDA device is available; use \"auto\" or \"cpu\"")]
    NoCuda(PathBuf),
    /// A tracker named in the config could not be found or loaded.
    #[error("config {path}")]
    Plugin {
        /// The config file.
        path: PathBuf,
        /// What went wrong with the plugin.
        #[source]
        source: PluginError,
    },
    /// The scheduler plugin failed during training (it cannot fail open:
    /// the run needs its rates).
    #[error("training stopped: the scheduler failed")]
    Scheduler(#[source] PluginError),
    /// Saving or loading a checkpoint failed.
    #[error("checkpoint")]
    State(#[source] CheckpointError),
    /// `[fsdp]` (with `HEARTH_FSDP_*` variables) is unusable.
    #[error(transparent)]
    Config(super::ConfigError),
    /// `run.cuda-graph = true` where the step cannot be captured.
    #[error("config {path}: run.cuda-graph = true {why}")]
    CudaGraphRefused {
        /// The config file.
        path: PathBuf,
        /// What stands in the way, and what to change.
        why: String,
    },
    /// Capturing or replaying the CUDA graph failed.
    #[error(transparent)]
    CudaGraph(#[from] hearth_ops::cuda_graph::GraphError),
    /// `[model] trainable` / `frozen` cannot be applied, or nothing trains.
    #[error("config {config}: {source}")]
    Trainability {
        /// The config file.
        config: PathBuf,
        /// What is wrong.
        #[source]
        source: crate::models::TrainabilityError,
    },
    /// `[model] adapter-from` cannot be read into the model.
    #[error("config {config}: model.adapter-from")]
    Adapter {
        /// The config file.
        config: PathBuf,
        /// What does not fit.
        #[source]
        source: crate::checkpoint::adapter::AdapterError,
    },
    /// `[model] init-from` cannot initialise the model.
    #[error("config {config}: model.init-from")]
    Init {
        /// The config file.
        config: PathBuf,
        /// What does not fit.
        #[source]
        source: crate::checkpoint::pretrained::InitError,
    },
    /// A signal asked for a polite stop: every process finished step
    /// `step`, and `checkpoint` holds it (exit with
    /// [`super::PREEMPTED_EXIT`]).
    #[error(
        "stopped by {signal} after step {step}; the checkpoint {checkpoint} holds it: resume with \
         `hearth run CONFIG --resume` (the same output folder)"
    )]
    Preempted {
        /// The last step taken.
        step: u64,
        /// The signal's name.
        signal: &'static str,
        /// The checkpoint saved at that step.
        checkpoint: std::path::PathBuf,
    },
    /// The loss became NaN or infinite.
    #[error("training diverged at step {step}: the loss is {loss}; lower optimizer.lr or set optimizer.max-grad-norm")]
    Diverged {
        /// Step at which it was seen.
        step: u64,
        /// The loss value.
        loss: f64,
    },
}

/// The first process whose `mine` (each process's own outcome of the
/// same step) failed, with its message: every process learns it, so all
/// stop together. `None` when every one worked (or there is one process).
pub(super) fn failed_rank<T, E: std::fmt::Display>(
    acc: &crate::accelerator::Accelerator,
    mine: &Result<T, E>,
) -> Result<Option<(usize, String)>, TrainError> {
    if acc.num_processes() == 1 {
        return Ok(None);
    }
    let said = mine.as_ref().map(|_| ()).map_err(|e| e.to_string());
    let all = acc.gather_object(&said)?;
    Ok(all
        .into_iter()
        .enumerate()
        .find_map(|(r, s)| s.err().map(|m| (r, m))))
}
