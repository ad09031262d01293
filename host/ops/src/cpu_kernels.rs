//! Which code runs hearth's own CPU kernels (the fused GELU and
//! self-attention of `fused`): chosen once per process from what
//! the CPU has, libtorch's CPU level and `HEARTH_CPU_KERNELS`.

use std::ffi::c_char;
use std::sync::OnceLock;

use super::ffi;

/// The environment variable that forces a path: `auto` (the default),
/// `avx512`, `avx2` or `off`.
pub const CPU_KERNELS_VAR: &str = "HEARTH_CPU_KERNELS";

/// The code path of hearth's fused CPU functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuKernels {
    /// libtorch's own operators (`gelu`, `scaled_dot_product_attention`).
    Libtorch,
    /// hearth's AVX2 + FMA kernels (`host/ops/csrc/*_avx2.cpp`).
    Avx2,
    /// The same kernels with their attention's matrix products in AVX-512
    /// (`csrc/tile_avx512.cpp`): the same bits as [`CpuKernels::Avx2`], the
    /// attention 1.22× as fast on the bench GPT's heads.
    Avx512,
}

impl CpuKernels {
    /// The spelling `HEARTH_CPU_KERNELS` and `hearth env` use.
    pub fn as_str(self) -> &'static str {
        match self {
            CpuKernels::Libtorch => "off",
            CpuKernels::Avx2 => "avx2",
            CpuKernels::Avx512 => "avx512",
        }
    }

    /// Whether hearth's own kernels run (not libtorch's operators).
    pub fn runs_hearths_kernels(self) -> bool {
        self != CpuKernels::Libtorch
    }

    /// The path's number across the C ABI (`csrc/kernel_paths.h`).
    pub(super) fn code(self) -> i32 {
        match self {
            CpuKernels::Libtorch => 0,
            CpuKernels::Avx2 => 1,
            CpuKernels::Avx512 => 2,
        }
    }
}

/// A `HEARTH_CPU_KERNELS` this process cannot honour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuKernelsError {
    /// Not one of the spellings.
    #[error("{CPU_KERNELS_VAR}={0:?} is not a kernel path: use auto, avx512, avx2 or off")]
    Unknown(String),
    /// A path this CPU cannot run: the path, and what the CPU lacks.
    #[error("{CPU_KERNELS_VAR}={0}, but this CPU lacks {1}; use auto or off")]
    CpuLacks(&'static str, &'static str),
}

/// What the choice depends on, apart from the variable.
#[derive(Clone, Copy, Debug)]
pub struct CpuLevel<'a> {
    /// Whether the CPU has AVX2 and FMA.
    pub avx2_fma: bool,
    /// Whether it also has AVX-512F.
    pub avx512f: bool,
    /// libtorch's CPU level (`DEFAULT`, `AVX2`, `AVX512`, ...), which
    /// `ATEN_CPU_CAPABILITY` lowers.
    pub libtorch: &'a str,
}

/// The path for `requested` (`HEARTH_CPU_KERNELS`; `None` or `auto`: the
/// highest of hearth's paths that both the CPU and libtorch's own level
/// allow, so that `ATEN_CPU_CAPABILITY=avx2` holds hearth to AVX2 as well
/// and `ATEN_CPU_CAPABILITY=default` keeps every vector instruction out of
/// a run, hearth's included).
pub fn choose(requested: Option<&str>, cpu: CpuLevel) -> Result<CpuKernels, CpuKernelsError> {
    let level = cpu.libtorch.to_ascii_uppercase();
    let auto = if cpu.avx2_fma && cpu.avx512f && level.starts_with("AVX512") {
        CpuKernels::Avx512
    } else if cpu.avx2_fma && level != "DEFAULT" {
        CpuKernels::Avx2
    } else {
        CpuKernels::Libtorch
    };
    match requested.map(|r| r.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("auto") => Ok(auto),
        Some("off") => Ok(CpuKernels::Libtorch),
        Some("avx2") if cpu.avx2_fma => Ok(CpuKernels::Avx2),
        Some("avx2") => Err(CpuKernelsError::CpuLacks("avx2", "AVX2 or FMA")),
        Some("avx512") if cpu.avx2_fma && cpu.avx512f => Ok(CpuKernels::Avx512),
        Some("avx512") => Err(CpuKernelsError::CpuLacks(
            "avx512",
            "AVX-512F (or AVX2 and FMA)",
        )),
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
                avx512f: cpu_has_avx512f(),
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

/// Whether this CPU has AVX-512F besides (what the avx512 path needs).
pub fn cpu_has_avx512f() -> bool {
    // SAFETY: reads a cached CPU feature check.
    unsafe { ffi::hearth_cpu_has_avx512f() }
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
        avx512f: false,
        libtorch: "AVX2",
    };

    const AVX512_CPU: CpuLevel = CpuLevel {
        avx2_fma: true,
        avx512f: true,
        libtorch: "AVX512",
    };

    #[test]
    fn auto_takes_the_highest_path_cpu_and_libtorch_allow() {
        assert_eq!(choose(None, AVX2_CPU), Ok(CpuKernels::Avx2));
        assert_eq!(choose(Some("auto"), AVX512_CPU), Ok(CpuKernels::Avx512));
        // libtorch pinned to AVX2 on an AVX-512 CPU holds hearth to AVX2.
        let pinned_avx2 = CpuLevel {
            libtorch: "AVX2",
            ..AVX512_CPU
        };
        assert_eq!(choose(None, pinned_avx2), Ok(CpuKernels::Avx2));
        // libtorch at AVX-512 on a CPU without AVX-512F (not a real case,
        // but the CPU's own flags decide).
        let odd = CpuLevel {
            libtorch: "AVX512",
            ..AVX2_CPU
        };
        assert_eq!(choose(None, odd), Ok(CpuKernels::Avx2));
        for cpu in [AVX2_CPU, AVX512_CPU] {
            let pinned = CpuLevel {
                libtorch: "DEFAULT",
                ..cpu
            };
            assert_eq!(choose(None, pinned), Ok(CpuKernels::Libtorch));
        }
        let old = CpuLevel {
            avx2_fma: false,
            avx512f: false,
            libtorch: "DEFAULT",
        };
        assert_eq!(choose(None, old), Ok(CpuKernels::Libtorch));
    }

    #[test]
    fn a_forced_path_is_taken_or_refused_by_name() {
        assert_eq!(choose(Some("off"), AVX2_CPU), Ok(CpuKernels::Libtorch));
        let pinned = CpuLevel {
            libtorch: "DEFAULT",
            ..AVX512_CPU
        };
        assert_eq!(choose(Some("AVX2"), pinned), Ok(CpuKernels::Avx2));
        assert_eq!(choose(Some(" avx512 "), pinned), Ok(CpuKernels::Avx512));
        assert_eq!(choose(Some("avx2"), AVX512_CPU), Ok(CpuKernels::Avx2));
        let old = CpuLevel {
            avx2_fma: false,
            avx512f: false,
            libtorch: "DEFAULT",
        };
        let e = choose(Some("avx2"), old).unwrap_err();
        assert_eq!(
            e.to_string(),
            "HEARTH_CPU_KERNELS=avx2, but this CPU lacks AVX2 or FMA; use auto or off"
        );
        let e = choose(Some("avx512"), AVX2_CPU).unwrap_err();
        assert!(e.to_string().contains("lacks AVX-512F"), "{e}");
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
        let has512 = has && std::arch::is_x86_feature_detected!("avx512f");
        assert_eq!(cpu_has_avx512f(), has512);
        let level = libtorch_cpu_level();
        assert!(!level.is_empty());
        let expected = choose(
            std::env::var(CPU_KERNELS_VAR).ok().as_deref(),
            CpuLevel {
                avx2_fma: has,
                avx512f: has512,
                libtorch: &level,
            },
        );
        assert_eq!(cpu_kernels(), expected);
    }
}
