//! Which code runs hearth's own CPU kernels (the fused GELU and
//! self-attention of `fused`): chosen once per process from what
//! the CPU has, libtorch's CPU level and `HEARTH_CPU_KERNELS`.

use std::ffi::c_char;
use std::sync::OnceLock;

use super::ffi;

/// The environment variable that forces a path: `auto` (the default),
/// `avx2` or `off`.
pub const CPU_KERNELS_VAR: &str = "HEARTH_CPU_KERNELS";

/// The code path of hearth's fused CPU functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuKernels {
    /// libtorch's own operators (`gelu`, `scaled_dot_product_attention`).
    Libtorch,
    /// hearth's AVX2 + FMA kernels (`host/ops/csrc/*_avx2.cpp`), which also run
    /// on CPUs with AVX-512.
    Avx2,
}

impl CpuKernels {
    /// The spelling `HEARTH_CPU_KERNELS` and `hearth env` use.
    pub fn as_str(self) -> &'static str {
        match self {
            CpuKernels::Libtorch => "off",
            CpuKernels::Avx2 => "avx2",
        }
    }

    /// The path's number across the C ABI (`csrc/kernel_paths.h`).
    pub(super) fn code(self) -> i32 {
        match self {
            CpuKernels::Libtorch => 0,
            CpuKernels::Avx2 => 1,
        }
    }
}

/// A `HEARTH_CPU_KERNELS` this process cannot honour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuKernelsError {
    /// Not one of the spellings.
    #[error("{CPU_KERNELS_VAR}={0:?} is not a kernel path: use auto, avx2 or off")]
    Unknown(String),
    /// AVX-512 asked for: hearth has no AVX-512 kernels.
    #[error("{CPU_KERNELS_VAR}=avx512: hearth has no AVX-512 kernels (its AVX2 kernels run on AVX-512 CPUs); use auto, avx2 or off")]
    NoAvx512,
    /// A path this CPU cannot run.
    #[error("{CPU_KERNELS_VAR}=avx2, but this CPU lacks AVX2 or FMA; use auto or off")]
    CpuLacks,
}

/// What the choice depends on, apart from the variable.
#[derive(Clone, Copy, Debug)]
pub struct CpuLevel<'a> {
    /// Whether the CPU has AVX2 and FMA.
    pub avx2_fma: bool,
    /// libtorch's CPU level (`DEFAULT`, `AVX2`, `AVX512`, ...), which
    /// `ATEN_CPU_CAPABILITY` lowers.
    pub libtorch: &'a str,
}

/// The path for `requested` (`HEARTH_CPU_KERNELS`; `None` or `auto`: the
/// AVX2 kernels where the CPU has AVX2 and FMA and libtorch's own level is
/// not pinned below AVX2, so that `ATEN_CPU_CAPABILITY=default` keeps every
/// vector instruction out of a run, hearth's included).
pub fn choose(requested: Option<&str>, cpu: CpuLevel) -> Result<CpuKernels, CpuKernelsError> {
    let auto = if cpu.avx2_fma && !cpu.libtorch.eq_ignore_ascii_case("DEFAULT") {
        CpuKernels::Avx2
    } else {
        CpuKernels::Libtorch
    };
    match requested.map(|r| r.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("auto") => Ok(auto),
        Some("off") => Ok(CpuKernels::Libtorch),
        Some("avx2") if cpu.avx2_fma => Ok(CpuKernels::Avx2),
        Some("avx2") => Err(CpuKernelsError::CpuLacks),
        Some("avx512") => Err(CpuKernelsError::NoAvx512),
        Some(_) => Err(CpuKernelsError::Unknown(requested.unwrap_or("").into())),
    }
}

/// This process's path: [`choose`] of `HEARTH_CPU_KERNELS` and this CPU,
/// read once.
pub fn cpu_kernels() -> Result<CpuKernels, CpuKernelsError> {
    static CHOSEN: OnceLock<Result<CpuKernels, CpuKernelsError>> = OnceLock::new();
    CHOSEN
        .get_or_init(|| {
            let requested = std::env::var(CPU_KERNELS_VAR).ok();
            let libtorch = libtorch_cpu_level();
            let cpu = CpuLevel {
                avx2_fma: cpu_has_avx2_fma(),
                libtorch: &libtorch,
            };
            choose(requested.as_deref(), cpu)
        })
        .clone()
}

/// Whether this CPU has AVX2 and FMA (what hearth's kernels need).
pub fn cpu_has_avx2_fma() -> bool {
    // SAFETY: reads a cached CPU feature check.
    unsafe { ffi::hearth_cpu_has_avx2_fma() }
}

/// libtorch's CPU level, as `torch.backends.cpu.get_cpu_capability()`
/// says it: `DEFAULT`, `AVX2`, `AVX512`, ...
pub fn libtorch_cpu_level() -> String {
    let mut buf = [0 as c_char; 64];
    // SAFETY: writes at most buf.len() bytes, NUL-terminated.
    unsafe { ffi::hearth_cpu_capability(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated above.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const AVX2_CPU: CpuLevel = CpuLevel {
        avx2_fma: true,
        libtorch: "AVX2",
    };

    #[test]
    fn auto_takes_the_kernels_where_cpu_and_libtorch_allow() {
        assert_eq!(choose(None, AVX2_CPU), Ok(CpuKernels::Avx2));
        let avx512 = CpuLevel {
            libtorch: "AVX512",
            ..AVX2_CPU
        };
        assert_eq!(choose(Some("auto"), avx512), Ok(CpuKernels::Avx2));
        let pinned = CpuLevel {
            libtorch: "DEFAULT",
            ..AVX2_CPU
        };
        assert_eq!(choose(None, pinned), Ok(CpuKernels::Libtorch));
        let old = CpuLevel {
            avx2_fma: false,
            libtorch: "DEFAULT",
        };
        assert_eq!(choose(None, old), Ok(CpuKernels::Libtorch));
    }

    #[test]
    fn a_forced_path_is_taken_or_refused_by_name() {
        assert_eq!(choose(Some("off"), AVX2_CPU), Ok(CpuKernels::Libtorch));
        let pinned = CpuLevel {
            libtorch: "DEFAULT",
            ..AVX2_CPU
        };
        assert_eq!(choose(Some("AVX2"), pinned), Ok(CpuKernels::Avx2));
        let old = CpuLevel {
            avx2_fma: false,
            libtorch: "DEFAULT",
        };
        assert_eq!(choose(Some("avx2"), old), Err(CpuKernelsError::CpuLacks));
        let e = choose(Some("avx512"), AVX2_CPU).unwrap_err();
        assert!(e.to_string().contains("no AVX-512 kernels"), "{e}");
        let e = choose(Some("fast"), AVX2_CPU).unwrap_err();
        assert!(e.to_string().contains("\"fast\""), "{e}");
    }

    /// What the process chose agrees with Rust's own CPU feature detection
    /// and with libtorch's level.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn this_process_follows_the_cpu_and_libtorch() {
        let has = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        assert_eq!(cpu_has_avx2_fma(), has);
        let level = libtorch_cpu_level();
        assert!(!level.is_empty());
        let expected = choose(
            std::env::var(CPU_KERNELS_VAR).ok().as_deref(),
            CpuLevel {
                avx2_fma: has,
                libtorch: &level,
            },
        );
        assert_eq!(cpu_kernels(), expected);
    }
}
