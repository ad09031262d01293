//! The CUDA half of libtorch, loaded only on a machine with a GPU.
//!
//! libtorch_cuda registers its kernels and CUDA hooks from static
//! initialisers; nothing calls it by symbol, so linking it (what hearth's
//! build did, with `--no-as-needed`) maps ~450 MB of library into every
//! process, GPU or not: on the 2-core CPU machine a one-step run took 0.54 s
//! and peaked at 520 MiB with it, 0.38 s and 232 MiB without. hearth opens
//! it with `dlopen` instead, only when the NVIDIA driver (`libcuda.so.1`)
//! is there.
//!
//! It must be loaded before libtorch first asks for its CUDA hooks (which
//! it then caches for good; `at::manual_seed` is one such call), so it is
//! loaded from a constructor that runs before `main` in every program that
//! links hearth (`ops::BEFORE_MAIN`); [`runtime`], [`is_available`] and [`device_count`]
//! load it too, and every CUDA query in hearth goes through them (clippy.toml
//! forbids tch's own).

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

/// What became of libtorch's CUDA library in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaRuntime {
    /// libtorch_cuda is loaded (from this file).
    Loaded(PathBuf),
    /// The NVIDIA driver is absent, so libtorch_cuda was not loaded.
    NoDriver,
    /// The libtorch in use has no libtorch_cuda (a CPU-only build).
    CpuOnlyLibtorch,
    /// The driver is there but libtorch_cuda failed to load (dlerror's text).
    Failed(String),
}

impl std::fmt::Display for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Loaded(path) => write!(f, "loaded ({})", path.display()),
            Self::NoDriver => write!(f, "not loaded: no NVIDIA driver (libcuda.so.1)"),
            Self::CpuOnlyLibtorch => write!(f, "not loaded: this libtorch has no CUDA"),
            Self::Failed(why) => write!(f, "failed to load: {why}"),
        }
    }
}

/// Loads libtorch_cuda once if the driver is present; later calls return
/// what the first one did.
pub fn runtime() -> &'static CudaRuntime {
    static RUNTIME: OnceLock<CudaRuntime> = OnceLock::new();
    RUNTIME.get_or_init(load)
}

/// Whether CUDA can be used (a driver, libtorch_cuda and at least one GPU).
pub fn is_available() -> bool {
    matches!(runtime(), CudaRuntime::Loaded(_)) && {
        #[allow(clippy::disallowed_methods)]
        let available = tch::Cuda::is_available();
        available
    }
}

/// The number of GPUs this process sees (0 without CUDA).
pub fn device_count() -> usize {
    if !is_available() {
        return 0;
    }
    #[allow(clippy::disallowed_methods)]
    let count = tch::Cuda::device_count();
    count.max(0) as usize
}

/// Whether cuDNN can be used.
pub fn cudnn_is_available() -> bool {
    is_available() && {
        #[allow(clippy::disallowed_methods)]
        let cudnn = tch::Cuda::cudnn_is_available();
        cudnn
    }
}

/// The CUDA runtime and cuDNN versions libtorch_cuda was built with, as
/// `"13.0"` and `"9.19.0"` (cuDNN `None` when absent); `None` without CUDA.
pub fn versions() -> Option<(String, Option<String>)> {
    if !is_available() {
        return None;
    }
    let (mut cudart, mut cudnn) = (0, 0);
    // SAFETY: two out-pointers to locals; libtorch_cuda's hooks are registered.
    super::foreach::check(unsafe { super::ffi::hearth_cuda_versions(&mut cudart, &mut cudnn) })
        .ok()?;
    let runtime = format!("{}.{}", cudart / 1000, cudart % 1000 / 10);
    let cudnn = (cudnn > 0).then(|| {
        // cuDNN 9 numbers its versions major * 10000 + minor * 100 + patch.
        format!("{}.{}.{}", cudnn / 10000, cudnn % 10000 / 100, cudnn % 100)
    });
    Some((runtime, cudnn))
}

fn load() -> CudaRuntime {
    if dlopen("libcuda.so.1", libc::RTLD_LAZY | libc::RTLD_LOCAL).is_err() {
        return CudaRuntime::NoDriver;
    }
    let candidates = libtorch_folder()
        .map(|dir| dir.join("libtorch_cuda.so"))
        .into_iter()
        .chain(Some(PathBuf::from("libtorch_cuda.so")));
    let mut first_error = None;
    for path in candidates {
        if path.is_absolute() && !path.exists() {
            continue;
        }
        match dlopen(&path.to_string_lossy(), libc::RTLD_NOW | libc::RTLD_GLOBAL) {
            Ok(()) => return CudaRuntime::Loaded(path),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if !e.contains("No such file") && !e.contains("cannot open shared object") => {
            CudaRuntime::Failed(e)
        }
        _ => CudaRuntime::CpuOnlyLibtorch,
    }
}

/// The folder of the libtorch_cpu.so this process runs (from its maps),
/// where the wheel keeps libtorch_cuda.so beside it.
pub fn libtorch_folder() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(PathBuf::from)
        .find(|p| p.file_name().is_some_and(|n| n == "libtorch_cpu.so"))
        .and_then(|p| p.parent().map(PathBuf::from))
}

/// Opens a shared library for good (the handle is never closed).
fn dlopen(name: &str, flags: libc::c_int) -> Result<(), String> {
    let c_name = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: a valid C string; the handle is kept open for the process's
    // life, so the library's code and static objects stay mapped.
    let handle = unsafe { libc::dlopen(c_name.as_ptr(), flags) };
    if !handle.is_null() {
        return Ok(());
    }
    // SAFETY: dlerror returns a thread-local message or null.
    let error = unsafe { libc::dlerror() };
    Err(if error.is_null() {
        format!("dlopen({name}) failed")
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next dl call.
        unsafe { CStr::from_ptr(error) }
            .to_string_lossy()
            .into_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_cuda_is_loaded_only_with_a_driver() {
        let driver = dlopen("libcuda.so.1", libc::RTLD_LAZY | libc::RTLD_LOCAL).is_ok();
        let runtime = runtime();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let mapped = maps.contains("libtorch_cuda.so");
        if driver {
            assert!(matches!(runtime, CudaRuntime::Loaded(_)), "{runtime}");
            assert!(mapped);
        } else {
            assert_eq!(runtime, &CudaRuntime::NoDriver);
            assert!(!mapped, "libtorch_cuda.so is mapped without a driver");
            assert!(!is_available());
            assert_eq!(device_count(), 0);
        }
    }
}
