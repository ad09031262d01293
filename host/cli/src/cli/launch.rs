//! `hearth launch`: runs a training config (or any program) in several
//! processes — under mpirun on CPUs, one process per GPU otherwise.

use super::Failure;
use hearth::launch::{launch, LaunchMode, LaunchSpec};
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
    #[arg(long, value_parser = launcher_names())]
    launcher: Option<LaunchMode>,
    /// Machines in the job (spawn mode; torchrun's --nnodes; default 1).
    #[arg(long)]
    nnodes: Option<usize>,
    /// This machine's index (spawn mode; torchrun's --node-rank; default 0).
    #[arg(long)]
    node_rank: Option<usize>,
    /// Address of the machine with node rank 0 (spawn mode; default
    /// 127.0.0.1).
    #[arg(long)]
    master_addr: Option<String>,
    /// Rendezvous port on it (spawn mode; default 29500).
    #[arg(long)]
    master_port: Option<u16>,
    /// Open MPI hostfile for a CPU job over several machines.
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// When a process fails, start every process again, up to this many
    /// times (torchrun's --max-restarts); `hearth run` then continues from
    /// the newest complete checkpoint.
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// The launch config to take -n, --cpu, mixed precision and the
    /// machines from where these flags are not given (Accelerate's
    /// `--config_file`; default: the one `hearth config --launch` wrote, if
    /// any).
    #[arg(long)]
    config_file: Option<PathBuf>,
    /// The training config for `hearth run`.
    config: Option<PathBuf>,
    /// After `--`: with a config, more `hearth run` flags (`--steps 100`);
    /// without one, the program to run and its arguments.
    #[arg(last = true)]
    program: Vec<OsString>,
}

/// The launch config `--config-file` names, else the default one if it
/// exists; it fills in what the flags leave out (`-n`, `--cpu`, the
/// machines) and its mixed precision reaches every process through
/// `HEARTH_MIXED_PRECISION` (a training config's own setting wins).
fn apply_launch_config(args: &mut LaunchArgs) -> Result<(), Failure> {
    let path = match &args.config_file {
        Some(path) => path.clone(),
        None => match hearth::launch::default_launch_config_path() {
            path if path.is_file() => path,
            _ => return Ok(()),
        },
    };
    let config = hearth::launch::read_launch_config(&path).map_err(Failure::bad_input)?;
    args.processes = args.processes.or(Some(config.num_processes));
    args.cpu |= config.use_cpu;
    args.nnodes = args.nnodes.or(Some(config.num_machines));
    args.node_rank = args.node_rank.or(Some(config.machine_rank));
    args.master_addr = args.master_addr.take().or(config.main_process_ip);
    args.master_port = args.master_port.or(config.main_process_port);
    if config.mixed_precision != hearth::precision::MixedPrecision::No
        && std::env::var_os("HEARTH_MIXED_PRECISION").is_none()
    {
        // SAFETY: the launcher is single-threaded here, before any process starts.
        unsafe {
            std::env::set_var("HEARTH_MIXED_PRECISION", config.mixed_precision.to_string());
        }
    }
    Ok(())
}

pub(super) fn execute(mut args: LaunchArgs) -> Result<(), Failure> {
    apply_launch_config(&mut args)?;
    let nnodes = args.nnodes.unwrap_or(1);
    let node_rank = args.node_rank.unwrap_or(0);
    let gpus = if args.cpu {
        0
    } else {
        hearth_ops::cuda::device_count()
    };
    let mode = args.launcher.unwrap_or(if gpus > 0 {
        LaunchMode::Spawn
    } else {
        LaunchMode::Mpirun
    });
    let processes = args.processes.unwrap_or(gpus.max(1));
    if processes == 0 || nnodes == 0 || node_rank >= nnodes {
        return Err(Failure::bad_input(anyhow::anyhow!(
            "-n {processes}, --nnodes {nnodes}, --node-rank {node_rank}: need at least one process and a node rank below the number of nodes"
        )));
    }
    if args.max_restarts > 0 && nnodes > 1 && mode == LaunchMode::Spawn {
        return Err(Failure::bad_input(anyhow::anyhow!(
            "--max-restarts with --nnodes {nnodes}: each machine's launcher would restart only its own \
             processes while the others wait; restart the job on every machine together, or use \
             --launcher mpirun with a --hostfile"
        )));
    }
    let program = match (&args.config, args.program.is_empty()) {
        (None, false) => args.program,
        (Some(config), _) => {
            // Checked once here rather than failing in every process.
            hearth::train::TrainConfig::from_file(config).map_err(Failure::bad_input)?;
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
        nnodes,
        node_rank,
        master_addr: args.master_addr.unwrap_or_else(|| "127.0.0.1".into()),
        master_port: args.master_port.unwrap_or(29500),
        hostfile: args.hostfile,
        max_restarts: args.max_restarts,
    };
    launch(&spec).map_err(|e| Failure {
        code: u8::try_from(e.exit_code()).unwrap_or(super::EXIT_FAILURE),
        error: e.into(),
    })
}

/// `--launcher`'s values: LaunchMode's names, listed in `--help`.
fn launcher_names() -> impl clap::builder::TypedValueParser<Value = LaunchMode> {
    use clap::builder::TypedValueParser;
    let names: Vec<&'static str> = LaunchMode::ALL.iter().map(|m| m.as_str()).collect();
    clap::builder::PossibleValuesParser::new(names)
        .map(|name| name.parse::<LaunchMode>().expect("one of its own names"))
}
