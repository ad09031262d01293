//! `hearth launch`'s engine: starts the processes of a job on this machine,
//! prefixes every output line with `[rank k]`, and when one process fails
//! stops the others and says which rank failed and how.
//!
//! CPU jobs go through `mpirun` (its `--tag-output` tells whose line is
//! whose, and mpirun itself stops the job when a process fails); GPU jobs
//! are spawned one process per device with torchrun's variables.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the processes are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LaunchMode {
    /// Through Open MPI's `mpirun` (the CPU backend).
    Mpirun,
    /// One process each, with torchrun's variables (the GPU backend).
    Spawn,
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
}

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
    /// mpirun failed without naming a process.
    #[error("mpirun {0}")]
    Mpirun(String),
}

impl LaunchError {
    /// The exit code `hearth launch` ends with.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::RankFailed { code: Some(c), .. } if *c != 0 => *c,
            _ => 1,
        }
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        _ => format!("ended: {status}"),
    }
}

/// Copies `stream` line by line to stdout or stderr, each line through `tag`.
fn forward(
    stream: impl Read + Send + 'static,
    tag: impl Fn(&str) -> Option<(bool, String)> + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if let Some((to_stderr, text)) = tag(&line) {
                // A closed terminal is not worth a panic in the launcher.
                let _ = if to_stderr {
                    writeln!(std::io::stderr().lock(), "{text}")
                } else {
                    writeln!(std::io::stdout().lock(), "{text}")
                };
            }
        }
    })
}

/// Threads each process's libtorch uses when `OMP_NUM_THREADS` is not set:
/// this machine's cores shared between its processes (torchrun sets 1).
fn threads_per_process(processes: usize) -> Option<String> {
    if std::env::var_os("OMP_NUM_THREADS").is_some() {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some((cores / processes.max(1)).max(1).to_string())
}

/// Runs the job to its end.
pub fn launch(spec: &LaunchSpec) -> Result<(), LaunchError> {
    match spec.mode {
        LaunchMode::Mpirun => launch_mpirun(spec),
        LaunchMode::Spawn => launch_spawn(spec),
    }
}

fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `[1,3]<stdout>:text` → rank 3, stdout, `text`.
fn mpirun_tag(line: &str) -> Option<(usize, bool, &str)> {
    let rest = line.strip_prefix('[')?;
    let (ids, rest) = rest.split_once(']')?;
    let rank = ids.split_once(',')?.1.parse().ok()?;
    if let Some(text) = rest.strip_prefix("<stdout>:") {
        Some((rank, false, text))
    } else {
        rest.strip_prefix("<stderr>:")
            .map(|text| (rank, true, text))
    }
}

/// What mpirun's closing message says about the first failed process.
#[derive(Default)]
struct MpirunReport {
    rank: Option<usize>,
    code: Option<i32>,
}

fn launch_mpirun(spec: &LaunchSpec) -> Result<(), LaunchError> {
    let mut cmd = Command::new("mpirun");
    cmd.arg("--tag-output")
        .args(["-n", &spec.processes.to_string()]);
    match &spec.hostfile {
        Some(hostfile) => cmd.arg("--hostfile").arg(hostfile),
        // One machine: more processes than cores is the user's call.
        None => cmd.arg("--oversubscribe"),
    };
    if let Some(threads) = threads_per_process(spec.processes) {
        cmd.env("OMP_NUM_THREADS", threads);
    }
    if running_as_root() {
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    cmd.args(&spec.program)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| LaunchError::Start {
        program: "mpirun".into(),
        source,
        hint: "CPU jobs run under Open MPI: install it (`make setup` does) or use --launcher spawn",
    })?;
    let report = Arc::new(Mutex::new(MpirunReport::default()));
    let tagger = |report: Arc<Mutex<MpirunReport>>, from_stderr: bool| {
        move |line: &str| -> Option<(bool, String)> {
            if let Some((rank, to_stderr, text)) = mpirun_tag(line) {
                return Some((to_stderr, format!("[rank {rank}] {text}")));
            }
            // mpirun's own lines: read who failed, pass the text on.
            let trimmed = line.trim();
            let mut r = report.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(name) = trimmed.strip_prefix("Process name:") {
                let last = name.trim().trim_end_matches(']').rsplit(',').next();
                r.rank = last.and_then(|rank| rank.parse().ok());
            } else if let Some(code) = trimmed.strip_prefix("Exit code:") {
                r.code = code.trim().parse().ok();
            }
            Some((from_stderr, format!("[mpirun] {line}")))
        }
    };
    let out = forward(
        child.stdout.take().expect("piped"),
        tagger(report.clone(), false),
    );
    let err = forward(
        child.stderr.take().expect("piped"),
        tagger(report.clone(), true),
    );
    let status = child.wait().map_err(|source| LaunchError::Start {
        program: "mpirun".into(),
        source,
        hint: "the launcher lost its child",
    })?;
    let _ = (out.join(), err.join());
    if status.success() {
        return Ok(());
    }
    let report = report.lock().unwrap_or_else(|p| p.into_inner());
    match report.rank {
        Some(rank) => Err(LaunchError::RankFailed {
            rank,
            status: match report.code {
                Some(code) => format!("exited with status {code}"),
                None => "failed".into(),
            },
            code: report.code,
        }),
        None => Err(LaunchError::Mpirun(describe(status))),
    }
}

fn launch_spawn(spec: &LaunchSpec) -> Result<(), LaunchError> {
    let (program, args) = spec.program.split_first().expect("a program to run");
    let world = spec.nnodes * spec.processes;
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut forwarders = Vec::new();
    let threads = threads_per_process(spec.processes);
    for local in 0..spec.processes {
        let rank = spec.node_rank * spec.processes + local;
        let mut cmd = Command::new(program);
        if let Some(threads) = &threads {
            cmd.env("OMP_NUM_THREADS", threads);
        }
        let spawned = cmd
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", spec.processes.to_string())
            .env("GROUP_RANK", spec.node_rank.to_string())
            .env("MASTER_ADDR", &spec.master_addr)
            .env("MASTER_PORT", spec.master_port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(source) => {
                stop(&mut children);
                return Err(LaunchError::Start {
                    program: program.to_string_lossy().into_owned(),
                    source,
                    hint: "check the program's path",
                });
            }
        };
        let prefix = move |to_stderr: bool| {
            move |line: &str| Some((to_stderr, format!("[rank {rank}] {line}")))
        };
        forwarders.push(forward(child.stdout.take().expect("piped"), prefix(false)));
        forwarders.push(forward(child.stderr.take().expect("piped"), prefix(true)));
        children.push((rank, child));
    }
    let mut running: Vec<usize> = (0..children.len()).collect();
    let outcome = loop {
        let mut failed = None;
        running.retain(|&i| {
            let (rank, child) = &mut children[i];
            match child.try_wait() {
                Ok(None) => true,
                Ok(Some(status)) => {
                    if !status.success() && failed.is_none() {
                        failed = Some((*rank, status));
                    }
                    false
                }
                Err(_) => false,
            }
        });
        if let Some((rank, status)) = failed {
            stop(&mut children);
            break Err(LaunchError::RankFailed {
                rank,
                status: describe(status),
                code: status.code(),
            });
        }
        if running.is_empty() {
            break Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    for f in forwarders {
        let _ = f.join();
    }
    outcome
}

/// The processes `pid` started, and theirs, from Linux's
/// `/proc/<pid>/task/<tid>/children`.
fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut pending = vec![pid];
    while let Some(p) = pending.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                found.push(c);
                pending.push(c);
            }
        }
    }
    found
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a pid; at worst it no longer exists (ESRCH).
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Stops every process still running and what they started: SIGTERM, up
/// to 5 s to exit, then SIGKILL; reaps them all. Nothing is left behind.
fn stop(children: &mut [(usize, Child)]) {
    let mut all: Vec<u32> = Vec::new();
    for (_, child) in children.iter() {
        all.push(child.id());
        all.extend(descendants(child.id()));
    }
    for &pid in &all {
        signal(pid, libc::SIGTERM);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline
        && children
            .iter_mut()
            .any(|(_, c)| matches!(c.try_wait(), Ok(None)))
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    for &pid in &all {
        signal(pid, libc::SIGKILL);
    }
    for (_, child) in children.iter_mut() {
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mpirun_tags_name_the_rank_and_stream() {
        assert_eq!(mpirun_tag("[1,3]<stdout>:hello"), Some((3, false, "hello")));
        assert_eq!(mpirun_tag("[2,0]<stderr>: x"), Some((0, true, " x")));
        assert_eq!(mpirun_tag("Process name: [[691,1],1]"), None);
        assert_eq!(mpirun_tag("plain"), None);
    }
}
