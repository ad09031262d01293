//! Helpers the integration tests share: the repository root and the
//! project's Python (the venv with torch and accelerate, the oracles).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
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
        .output()
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

/// Runs `child` of this binary in `n` ranks under mpirun; the children
/// write `rank_<r>.json` into `out`.
pub fn mpirun(n: usize, child: &str, mode: &str, out: &std::path::Path) -> Output {
    let exe = std::env::current_exe().unwrap();
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    Command::new("mpirun")
        .args(["--oversubscribe", "-n", &n.to_string()])
        .arg(exe)
        .args(["--exact", child, "--nocapture", "--test-threads", "1"])
        .env(CHILD, mode)
        .env(OUT, out)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun runs (Open MPI is installed by `make setup`)")
}

/// [`mpirun`], which must succeed (its stderr is the failure message).
pub fn mpirun_ok(n: usize, child: &str, mode: &str, out: &std::path::Path) {
    let run = mpirun(n, child, mode, out);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
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
