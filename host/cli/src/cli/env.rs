//! `hearth env`: versions, devices, backends and this process's place in
//! its job — what to paste into a bug report.

use super::Failure;
use hearth_comm::{environment, LaunchEnv, Launcher};

/// Arguments of `hearth env`.
#[derive(Debug, clap::Args)]
#[command(about = "Print versions, devices, available backends and this process's rank")]
pub(super) struct EnvArgs {
    /// One JSON object on one line.
    #[arg(long)]
    json: bool,
}

pub(super) fn execute(args: EnvArgs) -> Result<(), Failure> {
    let launch = LaunchEnv::from_env().map_err(Failure::bad_input)?;
    let cuda_devices = hearth_ops::cuda::device_count();
    let cuda_runtime = hearth_ops::cuda::runtime().to_string();
    let mpi_library = environment::mpi_library_version().unwrap_or_else(|| "unavailable".into());
    let nccl = nccl_status();
    let mut backends = vec!["single", "mpi"];
    if nccl == "available" {
        backends.push("nccl");
    }
    let gpus: Vec<serde_json::Value> = (0..cuda_devices)
        .map(|i| match hearth_ops::cuda_graph::device_properties(i) {
            Ok((name, (major, minor))) => {
                serde_json::json!({"index": i, "name": name, "compute_capability": format!("{major}.{minor}")})
            }
            Err(e) => serde_json::json!({"index": i, "error": e.to_string()}),
        })
        .collect();
    let (cuda_version, cudnn_version) = hearth_ops::cuda::versions().unzip();
    let cudnn_version = cudnn_version.flatten();
    let cuda_graphs = match hearth_ops::cuda_graph::available() {
        Ok(()) => "available".to_string(),
        Err(e) => e.to_string(),
    };
    // hearth's bfloat16 cross-entropy kernels, compiled for GPU 0 here.
    let gpu_cross_entropy = match cuda_devices {
        0 => "no CUDA device".to_string(),
        _ => match hearth_ops::cuda_loss::available(0) {
            Ok(()) => "available".to_string(),
            Err(e) => e.to_string(),
        },
    };
    let cpu = cpu_model();
    let kernels = cpu_kernels_report();
    let report = serde_json::json!({
        "hearth": env!("CARGO_PKG_VERSION"),
        "tch": "0.24.0",
        "cuda_available": cuda_devices > 0,
        "cuda_devices": cuda_devices,
        "cuda_runtime": cuda_runtime,
        "torch": hearth_comm::environment::torch_version().to_string(),
        "available": {
            "cuda": hearth_comm::environment::is_cuda_available(),
            "nccl": hearth_comm::environment::is_nccl_available(),
            "mpi": hearth_comm::environment::is_mpi_available(),
            "bf16": hearth_comm::environment::is_bf16_available(),
        },
        "cudnn_available": hearth_ops::cuda::cudnn_is_available(),
        "gpus": gpus,
        "cuda_version": cuda_version,
        "cudnn_version": cudnn_version,
        "cuda_graphs": cuda_graphs,
        "gpu_cross_entropy": gpu_cross_entropy,
        "backends": backends,
        "nccl": nccl,
        "mpi_library": mpi_library,
        "launch": launch,
        "cpu": {
            "model": cpu,
            "libtorch_level": kernels.libtorch_level,
            "avx2_fma": kernels.avx2_fma,
            "avx512f": kernels.avx512f,
            "kernels": kernels.path,
            "kernels_why": kernels.why,
            // The cores this process may run on (its affinity), and the
            // threads libtorch uses on them.
            "cores_usable": std::thread::available_parallelism().map_or(1, |n| n.get()),
            "threads": tch::get_num_threads(),
        },
    });
    if args.json {
        println!("{report}");
        return Ok(());
    }
    println!("hearth {}", env!("CARGO_PKG_VERSION"));
    println!(
        "tch 0.24.0, libtorch of PyTorch {}",
        hearth_comm::environment::torch_version()
    );
    println!("CUDA devices: {cuda_devices} (libtorch_cuda {cuda_runtime})");
    for gpu in &gpus {
        match (gpu["name"].as_str(), gpu["compute_capability"].as_str()) {
            (Some(name), Some(cc)) => {
                println!("  GPU {}: {name}, compute capability {cc}", gpu["index"])
            }
            _ => println!("  GPU {}: {}", gpu["index"], gpu["error"]),
        }
    }
    if let Some(cuda) = &cuda_version {
        println!(
            "CUDA runtime {cuda}, cuDNN {}; CUDA graphs: {cuda_graphs}; bf16 cross-entropy kernels: {gpu_cross_entropy}",
            cudnn_version.as_deref().unwrap_or("absent")
        );
    }
    println!(
        "CPU: {cpu}; libtorch's CPU level {}; hearth's CPU kernels: {} ({})",
        kernels.libtorch_level, kernels.path, kernels.why
    );
    println!("backends: {} (NCCL: {nccl})", backends.join(", "));
    println!("MPI library: {mpi_library}");
    println!(
        "this process: rank {} of {} (local {} of {}), {}{}",
        launch.rank,
        launch.world_size,
        launch.local_rank,
        launch.local_world_size,
        match launch.launcher {
            Launcher::Mpirun => "started by mpirun",
            Launcher::Torchrun => "started by torchrun (or its variables)",
            Launcher::Slurm => "started by SLURM's srun",
            Launcher::None => "started by no launcher",
        },
        launch
            .master
            .as_ref()
            .map(|m| format!(", rendezvous {m}"))
            .unwrap_or_default()
    );
    Ok(())
}

/// The CPU's model name as Linux reports it (`/proc/cpuinfo`), or
/// `unknown`.
fn cpu_model() -> String {
    hearth_comm::environment::proc_field("/proc/cpuinfo", "model name")
        .unwrap_or_else(|| "unknown".into())
}

/// `available`, or why NCCL cannot be used by this build on this machine.
fn nccl_status() -> String {
    #[cfg(feature = "cuda")]
    {
        hearth_comm::nccl_unavailable()
            .map_or_else(|| "available".into(), |why| format!("unavailable: {why}"))
    }
    #[cfg(not(feature = "cuda"))]
    {
        "not built (this hearth was built with `--no-default-features`; rebuild without it)".into()
    }
}

/// What `hearth env` says of hearth's CPU kernels.
struct CpuKernelsReport {
    /// libtorch's CPU level (`DEFAULT`, `AVX2`, `AVX512`, ...).
    libtorch_level: String,
    /// Whether the CPU has AVX2 and FMA.
    avx2_fma: bool,
    /// Whether it has AVX-512F besides.
    avx512f: bool,
    /// The path in use (`avx512`, `avx2`, `off`), or `invalid`.
    path: &'static str,
    /// Why that path.
    why: String,
}

/// ` (ATEN_CPU_CAPABILITY=...)` where that variable is set, else nothing:
/// libtorch's level can be below the CPU's without it (a libtorch built
/// without the higher kernels, a CPU lacking a flag libtorch needs).
fn pinned_by() -> String {
    std::env::var("ATEN_CPU_CAPABILITY")
        .map(|v| format!(" (ATEN_CPU_CAPABILITY={v})"))
        .unwrap_or_default()
}

fn cpu_kernels_report() -> CpuKernelsReport {
    use hearth_ops::cpu_kernels::{
        cpu_has_avx2_fma, cpu_has_avx512f, cpu_kernels, libtorch_cpu_level, CpuKernels,
        CPU_KERNELS_VAR,
    };
    let libtorch_level = libtorch_cpu_level();
    let avx2_fma = cpu_has_avx2_fma();
    let avx512f = cpu_has_avx512f();
    let requested = std::env::var(CPU_KERNELS_VAR).ok();
    let (path, why) = match (cpu_kernels(), requested.as_deref()) {
        (Err(e), _) => ("invalid", e.to_string()),
        (Ok(k), Some(r)) if !r.trim().eq_ignore_ascii_case("auto") && !r.trim().is_empty() => {
            (k.as_str(), format!("{CPU_KERNELS_VAR}={r}"))
        }
        (Ok(CpuKernels::Avx512), _) => (
            "avx512",
            "AVX-512F, AVX2 and FMA here: AVX2 kernels with AVX-512 attention tiles".to_string(),
        ),
        (Ok(CpuKernels::Avx2), _) if avx512f => (
            "avx2",
            format!(
                "libtorch's level is {libtorch_level}{}: AVX2 and FMA, as libtorch",
                pinned_by()
            ),
        ),
        (Ok(CpuKernels::Avx2), _) => ("avx2", "AVX2 and FMA here".to_string()),
        (Ok(CpuKernels::Libtorch), _) if !avx2_fma => (
            "off",
            "no AVX2 and FMA here: libtorch's operators for the fused chains (GELU, attention, RMSNorm, SwiGLU, rotary)".to_string(),
        ),
        (Ok(CpuKernels::Libtorch), _) => (
            "off",
            format!(
                "libtorch's level is {libtorch_level}{}: libtorch's operators for the fused chains (GELU, attention, RMSNorm, SwiGLU, rotary)",
                pinned_by()
            ),
        ),
    };
    CpuKernelsReport {
        libtorch_level,
        avx2_fma,
        avx512f,
        path,
        why,
    }
}
