//! The launch config (Accelerate's `ClusterConfig` file): what
//! `write_basic_config` writes — `hearth config --launch` — and what
//! `hearth launch --config-file` reads for the settings its flags leave
//! out. JSON with Accelerate's keys, so one file serves both tools.

use crate::precision::MixedPrecision;
use hearth_comm::DistributedType;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A launch config, with Accelerate's keys and `write_basic_config`'s
/// values by default. Keys hearth has no use for (TPU, debug) are kept so
/// the file stays Accelerate's; keys it does not know are refused, naming
/// them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchConfig {
    /// `"LOCAL_MACHINE"`.
    pub compute_environment: String,
    /// Accelerate's debug checks (not used by hearth).
    #[serde(default)]
    pub debug: bool,
    /// `"NO"` for one process, `"MULTI_GPU"`, `"MULTI_CPU"` or `"FSDP"`.
    pub distributed_type: DistributedType,
    /// Accelerate's bf16 downcast on TPUs (not used by hearth).
    #[serde(default)]
    pub downcast_bf16: bool,
    /// Accelerate's CPU affinity per GPU (not used by hearth).
    #[serde(default)]
    pub enable_cpu_affinity: bool,
    /// This machine's index among `num_machines`.
    #[serde(default)]
    pub machine_rank: usize,
    /// The training function Accelerate's notebook launcher calls (not used).
    #[serde(default = "main_function")]
    pub main_training_function: String,
    /// `"no"`, `"bf16"` or `"fp16"` for every process.
    pub mixed_precision: MixedPrecision,
    /// Machines in the job.
    #[serde(default = "one")]
    pub num_machines: usize,
    /// Processes on each machine (hearth's `-n`).
    pub num_processes: usize,
    /// Rendezvous backend (`"static"`).
    #[serde(default = "static_backend")]
    pub rdzv_backend: String,
    /// Whether the machines share a network.
    #[serde(default)]
    pub same_network: bool,
    /// TPU settings (not used by hearth).
    #[serde(default)]
    pub tpu_use_cluster: bool,
    /// TPU settings (not used by hearth).
    #[serde(default)]
    pub tpu_use_sudo: bool,
    /// Train on CPUs even where GPUs are.
    #[serde(default)]
    pub use_cpu: bool,
    /// The machine of rank 0 (several machines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    /// The rendezvous port on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
}

fn main_function() -> String {
    "main".into()
}

fn one() -> usize {
    1
}

fn static_backend() -> String {
    "static".into()
}

/// A launch config that could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum LaunchConfigError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a launch config hearth reads.
    #[error("{path} is not a launch config hearth can use: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Where `write_basic_config` writes and `hearth launch` looks by default:
/// `$HEARTH_CONFIG_DIR/default_config.json`, else
/// `$XDG_CONFIG_HOME/hearth/`, else `~/.config/hearth/` (Accelerate's is
/// in the Hugging Face cache; hearth keeps its own so neither tool reads a
/// file the other wrote by surprise).
pub fn default_launch_config_path() -> PathBuf {
    let dir = std::env::var_os("HEARTH_CONFIG_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CONFIG_HOME").map(|d| PathBuf::from(d).join("hearth")))
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config").join("hearth"))
        })
        .unwrap_or_else(|| PathBuf::from(".hearth"));
    dir.join("default_config.json")
}

/// The config `write_basic_config` writes on this machine: one process per
/// GPU (`MULTI_GPU` with several), else one CPU process.
pub fn basic_config(mixed_precision: MixedPrecision) -> LaunchConfig {
    let gpus = hearth_ops::cuda::device_count();
    LaunchConfig {
        compute_environment: "LOCAL_MACHINE".into(),
        debug: false,
        distributed_type: if gpus > 1 {
            DistributedType::MultiGpu
        } else {
            DistributedType::No
        },
        downcast_bf16: false,
        enable_cpu_affinity: false,
        machine_rank: 0,
        main_training_function: main_function(),
        mixed_precision,
        num_machines: 1,
        num_processes: gpus.max(1),
        rdzv_backend: static_backend(),
        same_network: false,
        tpu_use_cluster: false,
        tpu_use_sudo: false,
        use_cpu: gpus == 0,
        main_process_ip: None,
        main_process_port: None,
    }
}

/// Writes [`basic_config`] to `save_location` (default:
/// [`default_launch_config_path`]), creating its folder (Accelerate's
/// `write_basic_config`). Like Accelerate's, it never replaces an existing
/// file: it returns `None` then, else the path written.
pub fn write_basic_config(
    mixed_precision: MixedPrecision,
    save_location: Option<&Path>,
) -> Result<Option<PathBuf>, LaunchConfigError> {
    let path = save_location
        .map(Path::to_path_buf)
        .unwrap_or_else(default_launch_config_path);
    if path.exists() {
        return Ok(None);
    }
    let io = |source| LaunchConfigError::Io {
        path: path.clone(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    // Accelerate's layout: two-space indent, its keys in sorted order (the
    // fields'), a final newline.
    let text = serde_json::to_string_pretty(&basic_config(mixed_precision))
        .expect("a launch config serialises")
        + "\n";
    hearth_ops::durable::write_atomically(&path, |f| std::io::Write::write_all(f, text.as_bytes()))
        .map_err(io)?;
    Ok(Some(path))
}

/// Reads the launch config at `path`.
pub fn read_launch_config(path: &Path) -> Result<LaunchConfig, LaunchConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| LaunchConfigError::Io {
        path: path.into(),
        source,
    })?;
    let config: LaunchConfig =
        serde_json::from_str(&text).map_err(|e| LaunchConfigError::Invalid {
            path: path.into(),
            message: format!(
                "{e} (hearth reads the JSON that `hearth config --launch` and Accelerate's write_basic_config write)"
            ),
        })?;
    if config.num_processes == 0 || config.num_machines == 0 {
        return Err(LaunchConfigError::Invalid {
            path: path.into(),
            message: "num_processes and num_machines must be at least 1".into(),
        });
    }
    Ok(config)
}
