//! What `hearth launch` starts (`LaunchSpec`, its `LaunchMode`), why a
//! job did not succeed (`LaunchError`), and the variables each start of
//! a launch hands its processes.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;

/// How the processes are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchMode {
    /// Through Open MPI's `mpirun` (the CPU backend).
    Mpirun,
    /// One process each, with torchrun's variables (the GPU backend).
    Spawn,
}

hearth_ops::spelled_enum! {
    LaunchMode: "launcher" {
        Mpirun = "mpirun",
        Spawn = "spawn",
    }
}

/// What to start, and where this machine stands in the job.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Processes on this machine.
    pub processes: usize,
    /// How they are started.
    pub mode: LaunchMode,
    /// The program and its arguments, run by every process.
    pub program: Vec<OsString>,
    /// Machines in the job (spawn mode).
    pub nnodes: usize,
    /// This machine's index among them (spawn mode).
    pub node_rank: usize,
    /// The rendezvous host (spawn mode).
    pub master_addr: String,
    /// The rendezvous port (spawn mode).
    pub master_port: u16,
    /// An Open MPI hostfile for a job over several machines (mpirun mode).
    pub hostfile: Option<PathBuf>,
    /// How many times every process is started again when one fails
    /// (torchrun's `--max-restarts`; default 0).
    pub max_restarts: usize,
}

pub use hearth_comm::{launch_id, restart_count, LAUNCH_ID_VAR, RESTART_COUNT_VAR};

/// Why a launched job did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The launcher or program could not be started.
    #[error("cannot start {program}: {source}; {hint}")]
    Start {
        /// What was started.
        program: String,
        /// Why not.
        source: std::io::Error,
        /// What to do.
        hint: &'static str,
    },
    /// A process failed; the others were stopped.
    #[error("rank {rank} {status}; the other processes were stopped")]
    RankFailed {
        /// The first process that failed.
        rank: usize,
        /// How it ended ("exited with status 3", "was killed by signal 9").
        status: String,
        /// Its exit code, when it exited.
        code: Option<i32>,
    },
    /// Every process stopped politely for a signal, its checkpoint saved
    /// (exit status 75: resume me).
    #[error("the job was stopped by a signal after saving a checkpoint; it resumes from it with --resume (or a restart)")]
    Preempted,
    /// mpirun failed without naming a process.
    #[error("mpirun {0}")]
    Mpirun(String),
}

impl LaunchError {
    /// The exit code `hearth launch` ends with.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::RankFailed { code: Some(c), .. } if *c != 0 => *c,
            LaunchError::Preempted => crate::train::PREEMPTED_EXIT,
            _ => 1,
        }
    }
}

/// Which start of a launch this is.
pub(super) struct Restart<'a> {
    /// 0 for the first start.
    pub(super) count: usize,
    /// `--max-restarts`.
    pub(super) max: usize,
    /// The same for every start of one launch.
    pub(super) launch_id: &'a str,
}

/// The variables a process of one start gets.
pub(super) const RESTART_VARS: [&str; 4] = [
    RESTART_COUNT_VAR,
    LAUNCH_ID_VAR,
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
];

/// Sets the restart variables on a process of start `run`.
pub(super) fn restart_env(cmd: &mut Command, run: &Restart) {
    cmd.env(RESTART_COUNT_VAR, run.count.to_string())
        .env(LAUNCH_ID_VAR, run.launch_id)
        .env("TORCHELASTIC_RESTART_COUNT", run.count.to_string())
        .env("TORCHELASTIC_MAX_RESTARTS", run.max.to_string());
}
