//! `hearth launch`'s engine: starts the processes of a job on this machine,
//! prefixes every output line with `[rank k]`, and when one process fails
//! stops the others and says which rank failed and how.
//!
//! CPU jobs go through `mpirun` (its `--tag-output` tells whose line is
//! whose, and mpirun itself stops the job when a process fails); GPU jobs
//! are spawned one process per device with torchrun's variables.

use super::process::{descendants, describe, threads_per_process, write_line};
use super::spec::{restart_env, LaunchError, LaunchMode, LaunchSpec, Restart};
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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
            LaunchMode::Mpirun => super::mpirun::launch_mpirun(spec, &run),
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
