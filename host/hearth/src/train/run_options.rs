//! What `hearth run`'s flags change of a config ([`RunOptions`]).

use std::path::PathBuf;

/// Overrides given on the command line (they win over the config file).
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Replaces `run.output-dir`.
    pub output_dir: Option<PathBuf>,
    /// Replaces `run.steps`.
    pub steps: Option<u64>,
    /// Forces the CPU (replaces `run.device`).
    pub cpu: bool,
    /// No progress bar.
    pub quiet: bool,
    /// Folders searched for plugins before `HEARTH_PLUGIN_PATH`, the
    /// project's `plugins/` and the built-ins.
    pub plugin_dirs: Vec<PathBuf>,
    /// Continue from the newest complete checkpoint of the run folder.
    pub resume: bool,
    /// Continue from the newest complete checkpoint if this process's
    /// `hearth launch` wrote it, else start afresh (a rank restarted by
    /// `hearth launch --max-restarts`).
    pub resume_if_any: bool,
    /// Profile the run (as `[profile]` says, or its defaults) and write
    /// the traces here (replaces `profile.output-trace-dir`).
    pub profile: Option<PathBuf>,
}
