//! `hearth launch`: runs a training config (or any program) in several
//! processes — under mpirun on CPUs, one process per GPU otherwise.

use super::Failure;
use crate::launch::{launch, LaunchMode, LaunchSpec};
use std::ffi::OsString;
use std::path::PathBuf;

/// Arguments of `hearth launch`.
#[derive(Debug, clap::Args)]
#[command(
    about = "Run a config (`hearth run CONFIG`) or `-- PROGRAM ARGS` in several processes",
    after_help = "Output lines carry a [rank k] prefix. When a process fails the others are stopped and the launcher exits with its status, naming its rank.\n\
Examples:\n  hearth launch -n 2 --cpu examples/sort-digits.toml\n  hearth launch -n 2 --cpu job.toml -- --steps 100 --resume\n  hearth launch -n 4 -- target/release/my-trainer --lr 1e-3"
)]
pub(super) struct LaunchArgs {
    /// Processes on this machine (default: one per GPU, or 1 on CPU).
    #[arg(short = 'n', long = "num-processes")]
    processes: Option<usize>,
    /// Train on CPUs (through mpirun) even when GPUs are available.
    #[arg(long)]
    cpu: bool,
    /// How processes are started (default: mpirun on CPU, spawn on GPUs).
    #[arg(long, value_enum)]
    launcher: Option<LaunchMode>,
    /// Machines in the job (spawn mode; torchrun's --nnodes).
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This machine's index (spawn mode; torchrun's --node-rank).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of the machine with node rank 0 (spawn mode).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Rendezvous port on it (spawn mode).
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Open MPI hostfile for a CPU job over several machines.
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// When a process fails, start every process again, up to this many
    /// times (torchrun's --max-restarts); `hearth run` then continues from
    /// the newest complete checkpoint.
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// The training config for `hearth run`.
    config: Option<PathBuf>,
    /// After `--`: with a config, more `hearth run` flags (`--steps 100`);
    /// without one, the program to run and its arguments.
    #[arg(last = true)]
    program: Vec<OsString>,
}

pub(super) fn execute(args: LaunchArgs) -> Result<(), Failure> {
    let gpus = if args.cpu {
        0
    } else {
        crate::ops::cuda::device_count()
    };
    let mode = args.launcher.unwrap_or(if gpus > 0 {
        LaunchMode::Spawn
    } else {
        LaunchMode::Mpirun
    });
    let processes = args.processes.unwrap_or(gpus.max(1));
    if processes == 0 || args.nnodes == 0 || args.node_rank >= args.nnodes {
        return Err(Failure::bad_input(anyhow::anyhow!(
            "-n {processes}, --nnodes {}, --node-rank {}: need at least one process and a node rank below the number of nodes",
            args.nnodes,
            args.node_rank
        )));
    }
    if args.max_restarts > 0 && args.nnodes > 1 && mode == LaunchMode::Spawn {
        return Err(Failure::bad_input(anyhow::anyhow!(
            "--max-restarts with --nnodes {}: each machine's launcher would restart only its own \
             processes while the others wait; restart the job on every machine together, or use \
             --launcher mpirun with a --hostfile",
            args.nnodes
        )));
    }
    let program = match (&args.config, args.program.is_empty()) {
        (None, false) => args.program,
        (Some(config), _) => {
            // Checked once here rather than failing in every process.
            crate::train::TrainConfig::from_file(config).map_err(Failure::bad_input)?;
            let exe = std::env::current_exe().map_err(Failure::failed)?;
            let mut p = vec![exe.into(), "run".into(), config.into()];
            if args.cpu {
                p.push("--cpu".into());
            }
            p.extend(args.program);
            p
        }
        (None, true) => {
            return Err(Failure::bad_input(anyhow::anyhow!(
                "give a config to train (`hearth launch -n 2 job.toml`) or a program after `--` (`hearth launch -n 2 -- ./trainer`)"
            )))
        }
    };
    let spec = LaunchSpec {
        processes,
        mode,
        program,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        hostfile: args.hostfile,
        max_restarts: args.max_restarts,
    };
    launch(&spec).map_err(|e| Failure {
        code: u8::try_from(e.exit_code()).unwrap_or(super::EXIT_FAILURE),
        error: e.into(),
    })
}
