//! Helpers the integration tests share: the repository root and the
//! project's Python (the venv with torch and accelerate, the oracles).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

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
