//! Helpers hearth's integration tests share: the repository root, the
//! project's Python (the venv with torch and accelerate, the oracles),
//! mpirun jobs whose ranks are children of the test binary itself, and
//! running a command with a time limit, so that no test can hang, and the
//! canonical tiny job ([`TinyJob`]).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod tiny_job;
pub use tiny_job::TinyJob;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("host/testkit is two folders below the repository root")
        .to_path_buf()
}

/// The project's Python (`HEARTH_PYTHON`, else `.venv/bin/python`).
pub fn python() -> PathBuf {
    std::env::var_os("HEARTH_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"))
}

/// Runs `tests/oracles/<script>` with `args` and returns its stdout;
/// panics with its output when it fails.
pub fn oracle(script: &str, args: &[&str]) -> String {
    let out = Command::new(python())
        .arg(repo_root().join("tests/oracles").join(script))
        .args(args)
        .run()
        .expect("the project's Python (.venv) runs; run `make setup`");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "oracle {script} failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A test's scratch folder under the system's temporary folder; it is
/// removed with everything in it when dropped, also when the test fails.
pub struct Scratch(tempfile::TempDir);

/// A fresh, empty scratch folder named `hearth-<name>-<random>`.
pub fn scratch(name: &str) -> Scratch {
    let dir = tempfile::Builder::new()
        .prefix(&format!("hearth-{name}-"))
        .tempdir()
        .expect("a folder in the system's temporary folder");
    Scratch(dir)
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.path().as_os_str()
    }
}

/// The accelerator builder of an MPI child: the CPU, and a 60 s collective
/// timeout so that a child whose peers died fails instead of hanging.
pub fn child_builder() -> hearth::accelerator::AcceleratorBuilder {
    hearth::accelerator::Accelerator::builder()
        .cpu(true)
        .timeout(std::time::Duration::from_secs(60))
}

/// The variable that tells a test binary started by [`mpirun`] which child
/// mode to run.
pub const CHILD: &str = "HEARTH_MPI_CHILD";

/// Where the children write their results.
pub const OUT: &str = "HEARTH_MPI_OUT";

/// `mpirun` for `n` ranks on this machine: more ranks than cores allowed
/// (`--oversubscribe`), and as root where the tests run as root (Open MPI
/// refuses otherwise). The program and its arguments are the caller's.
pub fn mpirun_base(n: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "-n", &n.to_string()]);
    open_mpi_as_root(&mut cmd);
    cmd
}

/// Lets Open MPI run `cmd` (mpirun, or hearth, which starts mpirun) as
/// root, as the tests do; Open MPI refuses otherwise.
pub fn open_mpi_as_root(cmd: &mut Command) -> &mut Command {
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
}

/// libtest's name for test function `name` of module `module` (a
/// `module_path!()`): the path without the test binary's own name
/// (`mpi::child_ddp`), which [`mpirun_command`] passes to `--exact`.
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, inner)) => format!("{inner}::{name}"),
        None => name.to_string(),
    }
}

/// The libtest name of test function `$name` of the calling module, for
/// [`mpirun`]: `child!("child_ddp")`.
#[macro_export]
macro_rules! child {
    ($name:literal) => {
        $crate::test_path(module_path!(), $name)
    };
}

/// The command line of [`mpirun`]: `child` of this binary in `n` ranks,
/// their output tagged by rank (`--tag-output`, read by [`ranked`]), told
/// `mode`, writing into `out` (emptied first).
pub fn mpirun_command(n: usize, child: &str, mode: &str, out: &Path) -> Command {
    let exe = std::env::current_exe().unwrap();
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    let mut cmd = mpirun_base(n);
    cmd.arg("--tag-output")
        .arg(exe)
        .args(["--exact", child, "--nocapture", "--test-threads", "1"])
        .env(CHILD, mode)
        .env(OUT, out);
    cmd
}

/// Runs `child` of this binary in `n` ranks under mpirun; the children
/// write `rank_<r>.json` into `out`. A rank's lines come as `[rank r] …`
/// ([`ranked`]).
pub fn mpirun(n: usize, child: &str, mode: &str, out: &std::path::Path) -> Output {
    let run = mpirun_command(n, child, mode, out)
        .run()
        .expect("mpirun runs (Open MPI is installed by `make setup`)");
    ranked(run)
}

/// [`mpirun`], which must succeed (the last lines of each rank's output
/// are the failure message).
pub fn mpirun_ok(n: usize, child: &str, mode: &str, out: &std::path::Path) {
    let run = mpirun(n, child, mode, out);
    assert!(
        run.status.success(),
        "mpirun of {child} ({mode}) failed: {}\n{}",
        run.status,
        tails(&run)
    );
}

/// Writes rank `rank`'s `result` as `rank_<r>.json` into the folder the
/// parent gave in `$HEARTH_MPI_OUT` (what [`results`] reads).
pub fn write_result(rank: usize, result: &serde_json::Value) {
    let out = PathBuf::from(std::env::var(OUT).expect("run under mpirun by a parent test"));
    std::fs::write(out.join(format!("rank_{rank}.json")), result.to_string()).unwrap();
}

/// The `rank_<r>.json` results of `n` ranks in `dir`.
pub fn results(dir: &std::path::Path, n: usize) -> Vec<serde_json::Value> {
    (0..n)
        .map(|r| {
            let text = std::fs::read_to_string(dir.join(format!("rank_{r}.json")))
                .unwrap_or_else(|e| panic!("rank {r} wrote no result: {e}"));
            serde_json::from_str(&text).unwrap()
        })
        .collect()
}

/// The variable that marks every process a test starts, and theirs: what
/// finds those that left the command's process group (torchrun's workers,
/// `script`'s shell) when they must be killed.
const TAG: &str = "HEARTH_TEST_TAG";

/// How many lines of each rank's output a failure message shows.
const TAIL: usize = 20;

/// How long a command a test starts may run: `$HEARTH_TEST_TIMEOUT_S`
/// seconds, 600 when unset.
pub fn limit() -> Duration {
    let secs = match std::env::var("HEARTH_TEST_TIMEOUT_S") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("HEARTH_TEST_TIMEOUT_S={s:?} is not a number of seconds")),
        Err(_) => 600,
    };
    Duration::from_secs(secs)
}

/// A command run as a test may: to its end within a time limit, or its
/// processes killed and the test failed ([`Running::finish`]).
pub trait Limited {
    /// The command's output, as [`Command::output`] gives it, within
    /// [`limit`]; an error only when it does not start.
    fn run(&mut self) -> std::io::Result<Output> {
        self.run_for(limit())
    }

    /// [`Limited::run`] within `limit`.
    fn run_for(&mut self, limit: Duration) -> std::io::Result<Output>;
}

impl Limited for Command {
    fn run_for(&mut self, limit: Duration) -> std::io::Result<Output> {
        Ok(start(self)?.finish(limit))
    }
}

/// A command a test started ([`start`]). Dropped while it still runs (the
/// test failed mid-way), it is killed with all its processes.
pub struct Running {
    child: Child,
    /// The command line, as the failure message shows it.
    line: String,
    tag: String,
    /// What its stdout and stderr said so far, read by a thread each.
    out: [Reader; 2],
}

/// A thread that reads a pipe to its end into a buffer.
struct Reader {
    read: Arc<Mutex<Vec<u8>>>,
    thread: std::thread::JoinHandle<()>,
}

impl Reader {
    fn new(mut pipe: impl Read + Send + 'static) -> Reader {
        let read = Arc::new(Mutex::new(Vec::new()));
        let to = Arc::clone(&read);
        let thread = std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            loop {
                match pipe.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => to.lock().unwrap().extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        });
        Reader { read, thread }
    }

    /// What it read (all of it once the pipe has closed).
    fn take(&self) -> Vec<u8> {
        std::mem::take(&mut self.read.lock().unwrap())
    }
}

/// Starts `cmd` in a process group of its own, stdin empty, stdout and
/// stderr read as it runs, and every process it starts marked with a tag
/// of its own in the environment. Out of the test's process group, it is
/// sent SIGTERM when the test process dies (Ctrl-C reaches only that group).
pub fn start(cmd: &mut Command) -> std::io::Result<Running> {
    use std::os::unix::process::CommandExt;
    static STARTED: AtomicUsize = AtomicUsize::new(0);
    let test = std::process::id();
    let tag = format!("{test}-{}", STARTED.fetch_add(1, Ordering::Relaxed));
    // SAFETY: prctl, getppid and raise are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            if libc::getppid() as u32 != test {
                libc::raise(libc::SIGTERM);
            }
            Ok(())
        });
    }
    let mut child = cmd
        .env(TAG, &tag)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let out = [
        Reader::new(child.stdout.take().unwrap()),
        Reader::new(child.stderr.take().unwrap()),
    ];
    let line = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| match a.to_string_lossy() {
            a if a.is_empty() || a.contains(char::is_whitespace) => format!("{a:?}"),
            a => a.into_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ");
    Ok(Running {
        child,
        line,
        tag,
        out,
    })
}

impl Running {
    /// The tag in the environment of each of its processes ([`tagged`]).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Its output once it has ended and closed its output, within `limit`
    /// from now. Past it, its processes are killed (SIGTERM to its group,
    /// SIGKILL 5 s later, and to every process with its tag) and the test
    /// fails, naming itself, the command, and the last lines of each rank's
    /// output ([`tails`]).
    pub fn finish(mut self, limit: Duration) -> Output {
        let deadline = Instant::now() + limit;
        while !self.ended() {
            if Instant::now() >= deadline {
                self.kill();
                let test = std::thread::current().name().unwrap_or("a test").to_owned();
                let tails = tails(&self.output());
                panic!(
                    "{test}: `{}` did not finish within {}s; its processes were killed\n{tails}",
                    self.line,
                    limit.as_secs_f64(),
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.output()
    }

    /// Whether the command has exited and its output has closed.
    fn ended(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
            && self.out.iter().all(|r| r.thread.is_finished())
    }

    /// Kills its processes and waits for the command (and, up to 5 s, for
    /// its output to close).
    fn kill(&mut self) {
        let group = self.child.id() as libc::pid_t;
        let grace = Instant::now() + Duration::from_secs(5);
        // SAFETY: signals to the command's own process group.
        unsafe { libc::killpg(group, libc::SIGTERM) };
        while !self.ended() && Instant::now() < grace {
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: as above.
        unsafe { libc::killpg(group, libc::SIGKILL) };
        for _ in 0..20 {
            let left = tagged(&self.tag);
            if left.is_empty() {
                break;
            }
            for pid in left {
                // SAFETY: a process that carries this command's tag.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.wait();
        let grace = Instant::now() + Duration::from_secs(5);
        while !self.ended() && Instant::now() < grace {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its exit status (it must have exited) and what it wrote.
    fn output(&mut self) -> Output {
        Output {
            status: self.child.wait().unwrap(),
            stdout: self.out[0].take(),
            stderr: self.out[1].take(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

/// The processes, other than this one, whose environment holds `tag` (see
/// [`Running::tag`]).
pub fn tagged(tag: &str) -> Vec<libc::pid_t> {
    let entry = format!("{TAG}={tag}");
    let me = std::process::id();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .filter_map(|p| p.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == entry.as_bytes()))
        })
        .map(|pid| pid as libc::pid_t)
        .collect()
}

/// The tag mpirun's `--tag-output` puts before each piece a process wrote,
/// at the start of `s`: `[1,3]<stderr>:` (Open MPI 4; `[job@1,3]` in 5) →
/// rank 3 and the tag's length.
fn mpirun_tag(s: &[u8]) -> Option<(usize, usize)> {
    let rest = s.strip_prefix(b"[")?;
    let close = rest.iter().position(|&b| b == b']')?;
    let (job, rank) = std::str::from_utf8(&rest[..close]).ok()?.rsplit_once(',')?;
    if job.is_empty() || job.contains(['[', ' ']) {
        return None;
    }
    let rank = rank.parse().ok()?;
    let after = &rest[close + 1..];
    let stream = after.starts_with(b"<stdout>:") || after.starts_with(b"<stderr>:");
    stream.then_some((rank, s.len() - after.len() + b"<stdout>:".len()))
}

/// The lines of one stream of a command's output, each with the rank that
/// wrote it where a tag says so: hearth launch's `[rank 3] `, or mpirun's
/// `--tag-output`, whose tag comes before every piece a process wrote, so
/// that a line written in several writes (Rust's unbuffered stderr writes
/// each formatted part) comes in pieces, put together here as hearth
/// launch does: a process's line ends with the piece that ends mpirun's.
fn lines(raw: &[u8]) -> Vec<(Option<usize>, String)> {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let (mut found, mut partial) = (Vec::new(), BTreeMap::<usize, Vec<u8>>::new());
    if raw.is_empty() {
        return found;
    }
    for line in raw
        .strip_suffix(b"\n")
        .unwrap_or(raw)
        .split(|&b| b == b'\n')
    {
        let starts: Vec<usize> = (0..line.len())
            .filter(|&i| mpirun_tag(&line[i..]).is_some())
            .collect();
        let Some(&first) = starts.first() else {
            let line = text(line);
            let launched = line.strip_prefix("[rank ").and_then(|rest| {
                let (rank, said) = rest.split_once("] ")?;
                Some((Some(rank.parse().ok()?), said.to_owned()))
            });
            found.push(launched.unwrap_or((None, line)));
            continue;
        };
        if first > 0 {
            found.push((None, text(&line[..first])));
        }
        for (k, &at) in starts.iter().enumerate() {
            let (rank, len) = mpirun_tag(&line[at..]).expect("found above");
            let end = starts.get(k + 1).copied().unwrap_or(line.len());
            let piece = partial.entry(rank).or_default();
            piece.extend_from_slice(&line[at + len..end]);
            if k + 1 == starts.len() {
                let whole = partial.remove(&rank).unwrap_or_default();
                found.push((Some(rank), text(&whole)));
            }
        }
    }
    found.extend(
        partial
            .into_iter()
            .map(|(rank, piece)| (Some(rank), text(&piece))),
    );
    found
}

/// The output of an `mpirun --tag-output` command with each line whole
/// and a rank's as `[rank r] <line>`, as hearth launch shows them.
pub fn ranked(out: Output) -> Output {
    let whole = |raw: &[u8]| -> Vec<u8> {
        let lines = lines(raw).into_iter().map(|(rank, line)| match rank {
            Some(r) => format!("[rank {r}] {line}\n"),
            None => format!("{line}\n"),
        });
        lines.collect::<String>().into_bytes()
    };
    Output {
        status: out.status,
        stdout: whole(&out.stdout),
        stderr: whole(&out.stderr),
    }
}

/// The last 20 lines of each rank's stdout and stderr in `out`, and of
/// those no rank is named on (`lines`), under a heading each.
pub fn tails(out: &Output) -> String {
    let names = ["stdout", "stderr"];
    let mut streams = BTreeMap::<(Option<usize>, usize), Vec<String>>::new();
    for (stream, raw) in [&out.stdout, &out.stderr].into_iter().enumerate() {
        for (rank, line) in lines(raw) {
            streams.entry((rank, stream)).or_default().push(line);
        }
    }
    if streams.is_empty() {
        return "(no output)\n".to_string();
    }
    let mut shown = String::new();
    for ((rank, stream), lines) in streams {
        let who = rank.map_or(String::new(), |r| format!("rank {r}, "));
        let skipped = lines.len().saturating_sub(TAIL);
        let of = match skipped {
            0 => String::new(),
            _ => format!(" (last {TAIL} of {} lines)", lines.len()),
        };
        shown += &format!("--- {who}{}{of} ---\n", names[stream]);
        for line in &lines[skipped..] {
            shown += line;
            shown.push('\n');
        }
    }
    shown
}
