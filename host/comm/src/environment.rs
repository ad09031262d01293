//! What this machine and this build offer, as Accelerate's `accelerate.utils`
//! reports it: `is_cuda_available`, `is_nccl_available`, `is_mpi_available`,
//! `is_bf16_available`, `is_torch_version` (`hearth env --json` prints
//! them); and its scoped changes of the environment, `patch_environment`
//! and `clear_environment`.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::{fmt, str::FromStr};

use pep440_rs::Version;

/// The value of `key` in one of Linux's `key: value` files under `/proc`
/// (`/proc/meminfo`, `/proc/cpuinfo`; the first match), trimmed; `None`
/// where the file or the key is missing.
pub fn proc_field(file: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// Whether CUDA can be used: the NVIDIA driver, libtorch_cuda and a GPU
/// (`accelerate.utils.is_cuda_available`).
pub fn is_cuda_available() -> bool {
    hearth_ops::cuda::is_available()
}

/// Whether the NCCL backend can be used: built in (the default `cuda`
/// feature) and the driver and `libnccl.so` load. A GPU is not needed.
pub fn is_nccl_available() -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::nccl_unavailable().is_none()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// Whether the MPI library hearth links answers (its version query works),
/// so that `mpirun` can start a job of hearth processes.
pub fn is_mpi_available() -> bool {
    mpi_library_version().is_some()
}

/// The version line of the MPI library hearth links (`Open MPI v4.1.4,
/// ...`), trimmed; `None` where the library does not answer.
pub fn mpi_library_version() -> Option<String> {
    let version = mpi::environment::library_version().ok()?;
    Some(
        version
            .trim_matches(|c: char| c == '\0' || c.is_whitespace())
            .to_string(),
    )
}

/// Whether bf16 can be used on the device a process would train on
/// (`accelerate.utils.is_bf16_available`): always on the CPU; on a GPU when
/// a bf16 tensor can be made there, as `torch.cuda.is_bf16_supported()`
/// checks (with emulation, its default).
pub fn is_bf16_available() -> bool {
    if !is_cuda_available() {
        return true;
    }
    tch::Tensor::f_ones([1], (tch::Kind::BFloat16, tch::Device::Cuda(0))).is_ok()
}

/// The version of the PyTorch whose libtorch this process runs, without a
/// local part (`2.11.0`, not `2.11.0+cu130`), as Accelerate's
/// `torch_version`: read from the wheel's `version.py` beside the loaded
/// libtorch, else the version libtorch's headers had at build time.
pub fn torch_version() -> &'static Version {
    static VERSION: OnceLock<Version> = OnceLock::new();
    VERSION.get_or_init(|| {
        let text = wheel_version().unwrap_or_else(|| env!("HEARTH_TORCH_VERSION").to_string());
        let parsed = Version::from_str(text.trim())
            .or_else(|_| Version::from_str(env!("HEARTH_TORCH_VERSION")))
            .expect("build.rs checks that libtorch's version parses");
        parsed.without_local()
    })
}

/// `__version__` of the `version.py` in the torch folder whose libtorch
/// this process loaded.
fn wheel_version() -> Option<String> {
    let lib: PathBuf = hearth_ops::cuda::libtorch_folder()?;
    let text = std::fs::read_to_string(lib.parent()?.join("version.py")).ok()?;
    let line = text.lines().find(|l| l.starts_with("__version__"))?;
    let quoted = line.split_once('=')?.1.trim();
    Some(quoted.trim_matches(|c| c == '\'' || c == '"').to_string())
}

/// A comparison of versions, spelled as Accelerate's `STR_OPERATION_TO_FUNC`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionOp {
    /// `>`
    Greater,
    /// `>=`
    GreaterEqual,
    /// `==`
    Equal,
    /// `!=`
    NotEqual,
    /// `<=`
    LessEqual,
    /// `<`
    Less,
}

impl FromStr for VersionOp {
    type Err = VersionError;
    fn from_str(s: &str) -> Result<Self, VersionError> {
        Ok(match s {
            ">" => Self::Greater,
            ">=" => Self::GreaterEqual,
            "==" => Self::Equal,
            "!=" => Self::NotEqual,
            "<=" => Self::LessEqual,
            "<" => Self::Less,
            other => return Err(VersionError::Operation(other.to_string())),
        })
    }
}

/// A comparison that cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    /// The operation is none of Accelerate's.
    #[error(
        "`operation` must be one of [\">\", \">=\", \"==\", \"!=\", \"<=\", \"<\"], received {0:?}"
    )]
    Operation(String),
    /// The version is not a PEP 440 version.
    #[error("{0:?} is not a version (PEP 440, as Python's `packaging` reads it): {1}")]
    Version(String, String),
}

impl fmt::Display for VersionOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Greater => ">",
            Self::GreaterEqual => ">=",
            Self::Equal => "==",
            Self::NotEqual => "!=",
            Self::LessEqual => "<=",
            Self::Less => "<",
        })
    }
}

/// `version` compared to `requirement` by `operation` (Accelerate's
/// `compare_versions`, under PEP 440's ordering as `packaging` has it).
pub fn compare_versions(
    version: &Version,
    operation: &str,
    requirement: &str,
) -> Result<bool, VersionError> {
    let op: VersionOp = operation.parse()?;
    let other = Version::from_str(requirement)
        .map_err(|e| VersionError::Version(requirement.to_string(), e.to_string()))?;
    let order = version.cmp(&other);
    Ok(match op {
        VersionOp::Greater => order.is_gt(),
        VersionOp::GreaterEqual => order.is_ge(),
        VersionOp::Equal => order.is_eq(),
        VersionOp::NotEqual => order.is_ne(),
        VersionOp::LessEqual => order.is_le(),
        VersionOp::Less => order.is_lt(),
    })
}

/// The running PyTorch's version compared to `version`
/// (`accelerate.utils.is_torch_version(operation, version)`), e.g.
/// `is_torch_version(">=", "2.4")`.
pub fn is_torch_version(operation: &str, version: &str) -> Result<bool, VersionError> {
    compare_versions(torch_version(), operation, version)
}

/// The process environment as it was before a [`patch_environment`] or
/// [`clear_environment`]; dropping it (or [`EnvironmentGuard::restore`])
/// puts that back.
///
/// Changing the environment is process-wide: as with
/// `std::env::set_var`, no other thread may read or write it meanwhile
/// (libc's `getenv` is not synchronised with it).
#[must_use = "the environment is restored when the guard is dropped"]
pub struct EnvironmentGuard {
    /// Each variable touched and its value before (`None`: it was unset);
    /// `None` for a cleared environment, which is restored whole.
    previous: Vec<(std::ffi::OsString, Option<std::ffi::OsString>)>,
    cleared: Option<Vec<(std::ffi::OsString, std::ffi::OsString)>>,
}

/// Sets each variable for as long as the guard lives, with its name
/// upper-cased (Accelerate's `patch_environment(**kwargs)`); dropping the
/// guard gives each back its value before, or unsets it.
pub fn patch_environment<K, V>(vars: impl IntoIterator<Item = (K, V)>) -> EnvironmentGuard
where
    K: AsRef<str>,
    V: ToString,
{
    let mut previous = Vec::new();
    for (key, value) in vars {
        let key = std::ffi::OsString::from(key.as_ref().to_uppercase());
        previous.push((key.clone(), std::env::var_os(&key)));
        // SAFETY: see EnvironmentGuard: the caller keeps other threads off
        // the environment, as std::env::set_var requires.
        unsafe { std::env::set_var(&key, value.to_string()) };
    }
    EnvironmentGuard {
        previous,
        cleared: None,
    }
}

/// Empties the environment for as long as the guard lives (Accelerate's
/// `clear_environment()`); dropping the guard restores it exactly, undoing
/// whatever was set meanwhile.
pub fn clear_environment() -> EnvironmentGuard {
    let old: Vec<_> = std::env::vars_os().collect();
    for (key, _) in &old {
        // SAFETY: as in patch_environment.
        unsafe { std::env::remove_var(key) };
    }
    EnvironmentGuard {
        previous: Vec::new(),
        cleared: Some(old),
    }
}

impl EnvironmentGuard {
    /// Restores the environment now (what dropping the guard does).
    pub fn restore(self) {}
}

impl Drop for EnvironmentGuard {
    fn drop(&mut self) {
        // SAFETY: as in patch_environment.
        unsafe {
            if let Some(old) = self.cleared.take() {
                for (key, _) in std::env::vars_os().collect::<Vec<_>>() {
                    std::env::remove_var(key);
                }
                for (key, value) in old {
                    std::env::set_var(key, value);
                }
            }
            // Restored in reverse, so a name patched twice ends as before.
            for (key, value) in self.previous.drain(..).rev() {
                match value {
                    Some(value) => std::env::set_var(&key, value),
                    None => std::env::remove_var(&key),
                }
            }
        }
    }
}

/// The name that tells this process's machine from the others for
/// `save_on_each_node` and HYBRID_SHARD's groups: `HEARTH_NODE_NAME` when set, else the host name.
pub fn node_name() -> String {
    if let Some(name) = std::env::var("HEARTH_NODE_NAME")
        .ok()
        .filter(|n| !n.is_empty())
    {
        return name;
    }
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "localhost".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_torch_version_is_the_wheels_without_its_local_part() {
        let v = torch_version().to_string();
        assert!(v.starts_with("2.11"), "{v}");
        assert!(!v.contains('+'), "{v}");
    }

    #[test]
    fn bad_operations_and_versions_are_refused_by_name() {
        let e = is_torch_version("=>", "2.0").unwrap_err();
        assert!(e.to_string().contains("\"=>\""), "{e}");
        let e = is_torch_version(">=", "two").unwrap_err();
        assert!(e.to_string().contains("\"two\""), "{e}");
    }
}
