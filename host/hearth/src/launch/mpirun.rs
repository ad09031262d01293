//! `hearth launch` through Open MPI's `mpirun`: the command line it gets,
//! its `--tag-output` lines put back together per process and shown as
//! `[rank k]`, and its closing message read for which rank failed and how.

use super::process::{describe, threads_per_process, write_line};
use super::spec::{restart_env, LaunchError, LaunchSpec, Restart, RESTART_VARS};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

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
    /// The signal that killed it, as mpirun words it (`9 (Killed)`).
    signal: Option<String>,
}

impl MpirunReport {
    /// Reads who failed, and how, from one of mpirun's own lines.
    fn read(&mut self, line: &str) {
        if let Some(name) = line.strip_prefix("Process name:") {
            // A new block: "Process name: [[691,1],3]" then "Exit code: 4".
            let last = name.trim().trim_end_matches(']').rsplit(',').next();
            *self = Self {
                rank: last.and_then(|rank| rank.parse().ok()),
                ..Self::default()
            };
        } else if let Some(code) = line.strip_prefix("Exit code:") {
            self.code = code.trim().parse().ok();
        } else if let Some((_, rest)) = line.split_once("noticed that process rank ") {
            // "mpirun (or orterun, prterun, mpiexec) noticed that process
            // rank 1 with PID 0 on node vm exited on signal 9 (Killed)."
            // The signal may come on the next line; "failed" then.
            *self = Self {
                rank: rest.split(' ').next().and_then(|rank| rank.parse().ok()),
                signal: rest
                    .split_once("exited on signal ")
                    .map(|(_, signal)| signal.trim_end_matches('.').to_string()),
                ..Self::default()
            };
        }
    }

    /// How the failed process ended, in words.
    fn status(&self) -> String {
        match (self.code, &self.signal) {
            (Some(code), _) => format!("exited with status {code}"),
            (None, Some(signal)) => format!("was killed by signal {signal}"),
            (None, None) => "failed".into(),
        }
    }
}

pub(super) fn launch_mpirun(spec: &LaunchSpec, run: &Restart) -> Result<(), LaunchError> {
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
    let threads = threads_per_process(spec.processes);
    // Open MPI binds each of up to 2 processes to one core: a process of
    // several threads (one process on 2 cores) would run them all there.
    let per_process = threads
        .clone()
        .or_else(|| std::env::var("OMP_NUM_THREADS").ok())
        .and_then(|t| t.parse::<usize>().ok())
        .unwrap_or(1);
    if per_process > 1 {
        cmd.args(["--bind-to", "none"]);
    }
    if let Some(threads) = threads {
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
                    report
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .read(trimmed);
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
            status: report.status(),
            code: report.code,
        }),
        None => Err(LaunchError::Mpirun(describe(status))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mpiruns_own_lines_say_which_rank_failed_and_how() {
        let mut killed = MpirunReport::default();
        killed.read(
            "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).",
        );
        assert_eq!(killed.rank, Some(1));
        assert_eq!(killed.status(), "was killed by signal 9 (Killed)");
        let mut other = MpirunReport::default();
        other.read("prterun noticed that process rank 2 with PID 7 on node b exited on signal 6 (Aborted).");
        assert_eq!(
            (other.rank, other.status()),
            (Some(2), "was killed by signal 6 (Aborted)".to_string())
        );
        let mut exited = MpirunReport::default();
        exited.read("Process name: [[691,1],3]");
        exited.read("Exit code:    4");
        assert_eq!(
            (exited.rank, exited.status()),
            (Some(3), "exited with status 4".to_string())
        );
        // A later block is read whole: nothing of the first is kept.
        exited.read("Process name: [[691,1],1]");
        assert_eq!(
            (exited.rank, exited.status()),
            (Some(1), "failed".to_string())
        );
        exited.read("Exit code:    5");
        assert_eq!(
            (exited.rank, exited.status()),
            (Some(1), "exited with status 5".to_string())
        );
    }

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
