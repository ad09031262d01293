//! What the launcher does with processes: how one ended, in words; a
//! line written whole; threads per process; a process's descendants.

use std::io::Write;
use std::process::ExitStatus;

/// How a process ended, in words ("exited with status 3").
pub(super) fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        _ => format!("ended: {status}"),
    }
}

/// Writes `text` as one line to stdout or stderr.
pub(super) fn write_line(to_stderr: bool, text: &str) {
    // A closed terminal is not worth a panic in the launcher.
    let _ = if to_stderr {
        writeln!(std::io::stderr().lock(), "{text}")
    } else {
        writeln!(std::io::stdout().lock(), "{text}")
    };
}

/// Threads each process's libtorch uses when `OMP_NUM_THREADS` is not set:
/// this machine's cores shared between its processes (torchrun sets 1).
pub(super) fn threads_per_process(processes: usize) -> Option<String> {
    if std::env::var_os("OMP_NUM_THREADS").is_some() {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some((cores / processes.max(1)).max(1).to_string())
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
