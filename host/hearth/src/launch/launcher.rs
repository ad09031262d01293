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

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        _ => format!("ended: {status}"),
    }
}

/// Writes `text` as one line to stdout or stderr.
fn write_line(to_stderr: bool, text: &str) {
    // A closed terminal is not worth a panic in the launcher.
    let _ = if to_stderr {
        writeln!(std::io::stderr().lock(), "{text}")
    } else {
        writeln!(std::io::stdout().lock(), "{text}")
    };
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
                write_line(to_stderr, &text);
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
    let id = hearth_comm::new_job_token();
    let mut restarts = 0;
    loop {
        let run = Restart {
            count: restarts,
            max: spec.max_restarts,
            launch_id: &id,
        };
        let result = match spec.mode {
            LaunchMode::Mpirun => launch_mpirun(spec, &run),
            LaunchMode::Spawn => launch_spawn(spec, &run),
        };
        match result {
            // A process failed (not the launch itself, and not on bad
            // input, exit 2, which would fail again): all start again.
            // Stopped politely: a signal to the launcher (the scheduler
            // taking the machine) ends the launch with status 75 for a
            // requeue; one that reached a process alone is a restart.
            Err(LaunchError::Preempted)
                if !super::signals::Forwarding::get().signalled()
                    && restarts < spec.max_restarts =>
            {
                restarts += 1;
                eprintln!(
                    "hearth launch: the processes stopped politely after a checkpoint; starting \
                     them again from it (restart {restarts} of {})",
                    spec.max_restarts
                );
            }
            // Not on a machine being taken away (the launcher was
            // signalled): a process it cut short failed for that.
            Err(e @ (LaunchError::RankFailed { .. } | LaunchError::Mpirun(_)))
                if restarts < spec.max_restarts
                    && e.exit_code() != 2
                    && !super::signals::Forwarding::get().signalled() =>
            {
                restarts += 1;
                eprintln!(
                    "hearth launch: {e}; starting every process again (restart {restarts} of {})",
                    spec.max_restarts
                );
            }
            other => return other,
        }
    }
}

/// Which start of a launch this is.
struct Restart<'a> {
    count: usize,
    max: usize,
    launch_id: &'a str,
}

/// The variables a process of one start gets.
const RESTART_VARS: [&str; 4] = [
    RESTART_COUNT_VAR,
    LAUNCH_ID_VAR,
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
];

/// Sets the restart variables on a process of start `run`.
fn restart_env(cmd: &mut Command, run: &Restart) {
    cmd.env(RESTART_COUNT_VAR, run.count.to_string())
        .env(LAUNCH_ID_VAR, run.launch_id)
        .env("TORCHELASTIC_RESTART_COUNT", run.count.to_string())
        .env("TORCHELASTIC_MAX_RESTARTS", run.max.to_string());
}

fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// The tag `--tag-output` puts before each piece of a process's output at
/// the start of `s`: `[1,3]<stdout>:` (Open MPI 4) or `[job@1,3]<stdout>: `
/// (Open MPI 5, one space more when `space` is set) → rank 3, stdout, and
/// the tag's length.
fn mpirun_tag(s: &[u8], space: bool) -> Option<(usize, bool, usize)> {
    let rest = s.strip_prefix(b"[")?;
    let close = rest.iter().position(|&b| b == b']')?;
    let ids = std::str::from_utf8(&rest[..close]).ok()?;
    let (job, rank) = ids.rsplit_once(',')?;
    if job.is_empty() || job.contains(['[', ' ']) {
        return None;
    }
    let rank = rank.parse().ok()?;
    let rest = &rest[close + 1..];
    let to_stderr = if rest.starts_with(b"<stdout>:") {
        false
    } else if rest.starts_with(b"<stderr>:") {
        true
    } else {
        return None;
    };
    let mut len = s.len() - rest.len() + b"<stdout>:".len();
    if space && s.get(len) == Some(&b' ') {
        len += 1;
    }
    Some((rank, to_stderr, len))
}

/// Whether this Open MPI's `--tag-output` puts a space after the tag
/// (Open MPI 5 and later, through PMIx).
fn tag_has_space() -> bool {
    let version = Command::new("mpirun").arg("--version").output();
    let text = version.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let major = text.ok().and_then(|t| {
        let v = t
            .split_whitespace()
            .find(|w| w.starts_with(|c: char| c.is_ascii_digit()))?;
        v.split('.').next()?.parse::<u32>().ok()
    });
    major.is_some_and(|m| m >= 5)
}

/// A piece longer than this is shown even without its newline (a progress
/// bar that only returns the carriage, say), so nothing waits unbounded.
const MAX_PARTIAL: usize = 64 * 1024;

/// Rebuilds each process's lines from mpirun's output. mpirun tags every
/// piece a process wrote, not every line: a line written in several
/// writes (Rust's unbuffered stderr writes each formatted part) reaches it
/// as `[1,1]<stderr>:error: [1,1]<stderr>:the rest`, and pieces of
/// different processes can share a line. Pieces are collected, as bytes
/// (a piece may end inside a UTF-8 character), per process and stream until
/// the one that ends a line.
#[derive(Default)]
struct MpirunLines {
    partial: std::collections::BTreeMap<(usize, bool), Vec<u8>>,
    /// Open MPI 5's tags end with a space.
    space: bool,
}

/// A whole line: a process's (with its rank) or mpirun's own (`None`).
#[derive(Debug, PartialEq)]
struct Line {
    rank: Option<usize>,
    to_stderr: bool,
    text: String,
}

impl MpirunLines {
    fn new(space: bool) -> Self {
        Self {
            partial: Default::default(),
            space,
        }
    }

    /// The lines one line of mpirun's output (without its newline) completes.
    fn feed(&mut self, raw: &[u8], from_stderr: bool) -> Vec<Line> {
        let starts: Vec<usize> = (0..raw.len())
            .filter(|&i| raw[i] == b'[' && mpirun_tag(&raw[i..], self.space).is_some())
            .collect();
        let own = |text: &[u8]| Line {
            rank: None,
            to_stderr: from_stderr,
            text: String::from_utf8_lossy(text).into_owned(),
        };
        let Some(&first) = starts.first() else {
            return vec![own(raw)];
        };
        let mut lines = Vec::new();
        if first > 0 {
            lines.push(own(&raw[..first]));
        }
        for (k, &start) in starts.iter().enumerate() {
            let (rank, to_stderr, len) =
                mpirun_tag(&raw[start..], self.space).expect("found above");
            let end = starts.get(k + 1).copied().unwrap_or(raw.len());
            let text = self.partial.entry((rank, to_stderr)).or_default();
            text.extend_from_slice(&raw[start + len..end]);
            // The piece that ends mpirun's line ends this process's line.
            if k + 1 == starts.len() || text.len() >= MAX_PARTIAL {
                let text = self.partial.remove(&(rank, to_stderr)).unwrap_or_default();
                lines.push(Line {
                    rank: Some(rank),
                    to_stderr,
                    text: String::from_utf8_lossy(&text).into_owned(),
                });
            }
        }
        lines
    }

    /// What is left when the output ends: lines that never got their newline.
    fn finish(self) -> Vec<Line> {
        let partial = self.partial.into_iter();
        partial
            .filter(|(_, text)| !text.is_empty())
            .map(|((rank, to_stderr), text)| Line {
                rank: Some(rank),
                to_stderr,
                text: String::from_utf8_lossy(&text).into_owned(),
            })
            .collect()
    }
}

/// What mpirun's closing message says about the first failed process.
#[derive(Default)]
struct MpirunReport {
    rank: Option<usize>,
    code: Option<i32>,
}

fn launch_mpirun(spec: &LaunchSpec, run: &Restart) -> Result<(), LaunchError> {
    let mut cmd = Command::new("mpirun");
    cmd.arg("--tag-output")
        .args(["-n", &spec.processes.to_string()]);
    // Exported to the processes on other machines too.
    restart_env(&mut cmd, run);
    for var in RESTART_VARS {
        cmd.args(["-x", var]);
    }
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
    // Each of mpirun's two streams is read by its own thread.
    let space = tag_has_space();
    let forward_mpirun = |stream: Box<dyn Read + Send>, from_stderr: bool| {
        let report = report.clone();
        std::thread::spawn(move || {
            let mut lines = MpirunLines::new(space);
            let show = |line: Line| match line.rank {
                Some(rank) => write_line(line.to_stderr, &format!("[rank {rank}] {}", line.text)),
                None => {
                    // mpirun's own lines: read who failed, pass the text on.
                    let trimmed = line.text.trim();
                    let mut r = report.lock().unwrap_or_else(|p| p.into_inner());
                    if let Some(name) = trimmed.strip_prefix("Process name:") {
                        let last = name.trim().trim_end_matches(']').rsplit(',').next();
                        r.rank = last.and_then(|rank| rank.parse().ok());
                    } else if let Some(code) = trimmed.strip_prefix("Exit code:") {
                        r.code = code.trim().parse().ok();
                    }
                    write_line(line.to_stderr, &format!("[mpirun] {}", line.text));
                }
            };
            // Bytes, not text: a line that is not UTF-8 is shown, not a
            // reason to stop reading (mpirun would block on a full pipe).
            let mut reader = BufReader::new(stream);
            let mut raw = Vec::new();
            while reader.read_until(b'\n', &mut raw).is_ok_and(|n| n > 0) {
                if raw.last() == Some(&b'\n') {
                    raw.pop();
                }
                lines.feed(&raw, from_stderr).into_iter().for_each(show);
                raw.clear();
            }
            lines.finish().into_iter().for_each(show);
        })
    };
    let out = forward_mpirun(Box::new(child.stdout.take().expect("piped")), false);
    let err = forward_mpirun(Box::new(child.stderr.take().expect("piped")), true);
    let forwarding = super::signals::Forwarding::get();
    forwarding.set_mpirun(Some(child.id()));
    let status = child.wait().map_err(|source| LaunchError::Start {
        program: "mpirun".into(),
        source,
        hint: "the launcher lost its child",
    });
    forwarding.set_mpirun(None);
    let status = status?;
    let _ = (out.join(), err.join());
    if status.success() {
        return Ok(());
    }
    let report = report.lock().unwrap_or_else(|p| p.into_inner());
    if report.code == Some(crate::train::PREEMPTED_EXIT) {
        return Err(LaunchError::Preempted);
    }
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

/// The token the ranks present to the rendezvous store: the one in
/// `HEARTH_JOB_TOKEN` (the same on every machine of a job over several),
/// else a fresh random one for a job on this machine alone. A job over
/// several machines without one runs with a store that answers anyone,
/// as PyTorch's does, and is warned about it.
fn job_token(nnodes: usize) -> Option<String> {
    let given = std::env::var(hearth_comm::JOB_TOKEN_VAR)
        .ok()
        .filter(|t| !t.is_empty());
    match (given, nnodes) {
        (Some(token), _) => Some(token),
        (None, 1) => Some(hearth_comm::new_job_token()),
        (None, _) => {
            tracing::warn!(
                "a job over {nnodes} machines without {var}: its rendezvous store answers any \
                 client that reaches MASTER_ADDR:MASTER_PORT; set {var} to the same secret on \
                 every machine",
                var = hearth_comm::JOB_TOKEN_VAR
            );
            None
        }
    }
}

fn launch_spawn(spec: &LaunchSpec, run: &Restart) -> Result<(), LaunchError> {
    let (program, args) = spec.program.split_first().expect("a program to run");
    let world = spec.nnodes * spec.processes;
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut forwarders = Vec::new();
    let threads = threads_per_process(spec.processes);
    let token = job_token(spec.nnodes);
    for local in 0..spec.processes {
        let rank = spec.node_rank * spec.processes + local;
        let mut cmd = Command::new(program);
        if let Some(threads) = &threads {
            cmd.env("OMP_NUM_THREADS", threads);
        }
        if let Some(token) = &token {
            cmd.env(hearth_comm::JOB_TOKEN_VAR, token);
        }
        restart_env(&mut cmd, run);
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
    let forwarding = super::signals::Forwarding::get();
    forwarding.set_children(children.iter().map(|(_, c)| c.id()).collect());
    let mut running: Vec<usize> = (0..children.len()).collect();
    // A process that stopped politely (status 75) is not a failure: the
    // others agreed on the same step and stop on their own once the
    // checkpoint is saved; signalling them now would cut the save short.
    let mut preempted = false;
    let outcome = loop {
        let mut failed = None;
        running.retain(|&i| {
            let (rank, child) = &mut children[i];
            let ended = child.try_wait();
            if !matches!(ended, Ok(None)) {
                forwarding.forget(child.id());
            }
            match ended {
                Ok(None) => true,
                Ok(Some(status)) if status.code() == Some(crate::train::PREEMPTED_EXIT) => {
                    preempted = true;
                    false
                }
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
            break if preempted {
                Err(LaunchError::Preempted)
            } else {
                Ok(())
            };
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    forwarding.set_children(Vec::new());
    for f in forwarders {
        let _ = f.join();
    }
    outcome
}

/// The processes `pid` started, and theirs, from Linux's
/// `/proc/<pid>/task/<tid>/children`.
pub(super) fn descendants(pid: u32) -> Vec<u32> {
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
        let tag = |s: &str| mpirun_tag(s.as_bytes(), false);
        assert_eq!(tag("[1,3]<stdout>:hello"), Some((3, false, 14)));
        assert_eq!(tag("[2,0]<stderr>: x"), Some((0, true, 14)));
        assert_eq!(tag("[12,10]<stdout>:"), Some((10, false, 16)));
        assert_eq!(tag("Process name: [[691,1],1]"), None);
        assert_eq!(tag("[[691,1],1]"), None);
        assert_eq!(tag("[1,x]<stdout>:"), None);
        assert_eq!(tag("plain"), None);
        // Open MPI 5: a job name and one space after the tag.
        let tag5 = |s: &str| mpirun_tag(s.as_bytes(), true);
        assert_eq!(tag5("[prterun-h-42@1,2]<stdout>: hi"), Some((2, false, 28)));
        assert_eq!(tag5("[1,2]<stdout>:hi"), Some((2, false, 14)));
    }

    fn line(rank: Option<usize>, to_stderr: bool, text: &str) -> Line {
        let text = text.to_string();
        Line {
            rank,
            to_stderr,
            text,
        }
    }

    #[test]
    fn pieces_of_a_line_are_joined_per_process() {
        let mut lines = MpirunLines::new(false);
        let mut feed = |raw: &str, from_stderr| lines.feed(raw.as_bytes(), from_stderr);
        assert_eq!(
            feed("[1,0]<stdout>:hello", false),
            [line(Some(0), false, "hello")]
        );
        // A line written in three writes (what mpirun printed for a
        // failing rank before this was handled).
        let raw = "[1,1]<stderr>:error: [1,1]<stderr>:failed to read config [1,1]<stderr>:/x.toml";
        assert_eq!(
            feed(raw, true),
            [line(Some(1), true, "error: failed to read config /x.toml")]
        );
        // Rank 0's piece interrupted by rank 1's line: rank 0's line waits
        // for its end.
        let raw = "[1,0]<stdout>:step 1[1,1]<stdout>:loss 2";
        assert_eq!(feed(raw, false), [line(Some(1), false, "loss 2")]);
        assert_eq!(
            feed("[1,0]<stdout>: done", false),
            [line(Some(0), false, "step 1 done")]
        );
        // mpirun's own lines, and a piece whose newline never came.
        let own = "Process name: [[691,1],1]";
        assert_eq!(feed(own, true), [line(None, true, own)]);
        let raw = "[1,2]<stdout>:half[1,1]<stdout>:whole";
        assert_eq!(feed(raw, false), [line(Some(1), false, "whole")]);
        assert_eq!(lines.finish(), [line(Some(2), false, "half")]);
    }

    #[test]
    fn a_character_cut_between_pieces_and_bytes_that_are_not_text_survive() {
        let mut lines = MpirunLines::new(true);
        // "é" is two bytes; mpirun's chunking cut it in two (Open MPI 5 tags).
        let mut raw = b"[j@1,0]<stdout>: caf\xc3".to_vec();
        raw.extend_from_slice(b"[j@1,0]<stdout>: \xa9 ok");
        assert_eq!(
            lines.feed(&raw, false),
            [line(Some(0), false, "caf\u{e9} ok")]
        );
        let raw = b"[j@1,1]<stderr>: \xff\xfe";
        assert_eq!(
            lines.feed(raw, true),
            [line(Some(1), true, "\u{fffd}\u{fffd}")]
        );
        // A piece without its newline is shown once it is long.
        let long = format!("[j@1,0]<stdout>: {}", "#".repeat(MAX_PARTIAL));
        let raw = format!("{long}[j@1,1]<stdout>: end");
        let got = lines.feed(raw.as_bytes(), false);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].text.len(), MAX_PARTIAL);
        assert_eq!(got[1], line(Some(1), false, "end"));
    }
}
