//! The command line: parsing, logging, exit codes and the shared table style.

use super::{checkpoint, config, data, env, launch, model, plugins, report, run};
use clap::{Parser, Subcommand};
use std::io::IsTerminal;

/// Exit status for a run that started and failed.
pub const EXIT_FAILURE: u8 = 1;
/// Exit status for bad input: a config, a path or a flag (as clap uses for usage errors).
pub const EXIT_BAD_INPUT: u8 = 2;

/// hearth — train libtorch models from Rust on one CPU, many processes or
/// many GPUs, customised by sandboxed WebAssembly plugins.
#[derive(Debug, Parser)]
#[command(name = "hearth", version, about, long_about = None)]
#[command(
    after_help = "Exit status: 0 success, 1 the run failed, 2 bad input (config, flags, files).\n\
Logs: set HEARTH_LOG (e.g. HEARTH_LOG=debug) to change what is logged."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
pub(super) enum Command {
    /// Train the model a TOML config describes, evaluate it, and write the
    /// run folder (model.safetensors, config.toml, summary.json,
    /// metrics.jsonl).
    Run(run::RunArgs),
    /// List, inspect and check WebAssembly plugins.
    Plugins(plugins::PluginsArgs),
    /// Inspect and verify checkpoints written by save_state.
    Checkpoint(checkpoint::CheckpointArgs),
    /// Run a config or a program in several processes, `[rank k]` on each line.
    Launch(launch::LaunchArgs),
    /// Print versions, devices, backends and this process's rank.
    Env(env::EnvArgs),
    /// Write a default training config to start from.
    Config(config::ConfigArgs),
    /// Plan a config's model: module tree, sharding units, bytes per
    /// process; sizes and device maps; memory estimates.
    Model(model::ModelArgs),
    /// Prepare a config's data ahead of a run (tokenize documents into
    /// their cache) and time its loader.
    Data(data::DataArgs),
    /// Draw the curves of one or more run folders as report.html and PNGs,
    /// offline (loss, evaluation, learning rate, throughput, …).
    Report(report::ReportArgs),
}

pub(super) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HEARTH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}

/// Parses the command line, runs the command, and maps errors to exit codes
/// (0 on success). Everything the command opened — files, threads, MPI —
/// is closed when this returns.
pub fn main() -> u8 {
    // Output piped into `head` ends quietly, as other command-line tools
    // do, instead of panicking on a broken pipe.
    // A file past the size limit (`ulimit -f`) fails its write with EFBIG,
    // which a checkpoint reports with the limit, instead of SIGXFSZ ending
    // the process without a word.
    // SAFETY: setting the disposition of two signals, before any thread
    // starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    let cli = Cli::parse();
    init_logging();
    // A HEARTH_CPU_KERNELS that cannot be honoured stops a run before it
    // starts, rather than at the model's first GELU.
    let trains = matches!(cli.command, Command::Run(_) | Command::Launch(_));
    let refused = trains.then(hearth_ops::cpu_kernels).and_then(Result::err);
    let result = match cli.command {
        _ if refused.is_some() => Err(Failure::bad_input(refused.expect("checked"))),
        Command::Run(args) => run::execute(args),
        Command::Plugins(args) => plugins::execute(args),
        Command::Checkpoint(args) => checkpoint::execute(args),
        Command::Launch(args) => launch::execute(args),
        Command::Env(args) => env::execute(args),
        Command::Config(args) => config::execute(args),
        Command::Model(args) => model::execute(args),
        Command::Report(args) => report::execute(args),
        Command::Data(args) => data::execute(args),
    };
    match result {
        Ok(()) => 0,
        Err(failure) => {
            // One write, so that a launcher reading several processes'
            // output gets the line whole (eprintln! writes it in parts).
            let message = format!("error: {:#}\n", failure.error);
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), message.as_bytes());
            failure.code
        }
    }
}

/// Ends the process with `code` once [`main`] has returned: flushes Rust's
/// and C's output streams, then exits without running the C++ static
/// destructors. libtorch's deregister every operator it registered at
/// start (~0.08 s of a 0.3 s bare start-and-exit on the 2-core machine,
/// `make bench`'s whole-process row); by then hearth has dropped, flushed
/// and joined everything it owns, so nothing is lost.
pub fn exit(code: u8) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: fflush(NULL) flushes every C stream; `_exit` ends the process
    // without running atexit handlers, which is the point.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(i32::from(code))
    }
}

/// A table as hearth prints them: columns as wide as their contents,
/// `header` in bold lines, numbers right-aligned by the caller.
pub(crate) fn table(header: &[&str]) -> comfy_table::Table {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED)
        .set_header(header.to_vec());
    t
}

/// Right-aligns the columns `columns` of `t`.
pub(crate) fn align_right(t: &mut comfy_table::Table, columns: &[usize]) {
    for &c in columns {
        if let Some(column) = t.column_mut(c) {
            column.set_cell_alignment(comfy_table::CellAlignment::Right);
        }
    }
}

/// An error with the exit status it maps to.
pub(super) struct Failure {
    pub(super) error: anyhow::Error,
    pub(super) code: u8,
}

impl Failure {
    pub(super) fn bad_input(error: impl Into<anyhow::Error>) -> Self {
        Self {
            error: error.into(),
            code: EXIT_BAD_INPUT,
        }
    }
    pub(super) fn failed(error: impl Into<anyhow::Error>) -> Self {
        Self {
            error: error.into(),
            code: EXIT_FAILURE,
        }
    }
    /// A run stopped politely by a signal, its checkpoint saved: exit
    /// status 75, which `hearth launch` and requeue scripts take as
    /// "resume me".
    pub(super) fn preempted(error: impl Into<anyhow::Error>) -> Self {
        Self {
            error: error.into(),
            code: hearth::train::PREEMPTED_EXIT as u8,
        }
    }
    /// A config's model or data that could not be built outside a run:
    /// libtorch and I/O failures fail, everything else is the config's.
    pub(super) fn building(error: hearth::train::TrainError) -> Self {
        use hearth::train::TrainError::{Io, Torch};
        match error {
            Torch(_) | Io { .. } => Self::failed(error),
            _ => Self::bad_input(error),
        }
    }
}
