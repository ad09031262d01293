//! `[distributed]`: how the processes of a multi-process run talk
//! (Accelerate's `InitProcessGroupKwargs` and `DistributedDataParallelKwargs`,
//! and `ProjectConfiguration.save_on_each_node`). A process that was not
//! started as one of several (no mpirun, srun or torchrun variables) ignores it.

use super::{ConfigError, Invalid};
use crate::parallel::{CommHook, CommWrapper, DdpOptions, PowerSgdOptions};
use hearth_comm::Backend;
use serde::Deserialize;

/// The `[distributed]` section.
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DistributedSection {
    /// `mpi` or `nccl` (default: NCCL on a GPU, MPI on the CPU).
    pub backend: Option<Backend>,
    /// `env://` (default) or `tcp://host:port`: where processes started
    /// without MPI find rank 0's rendezvous store.
    pub init_method: Option<String>,
    /// Seconds a collective may wait for the other processes before the run
    /// fails, naming the rank that gave up (default as PyTorch: 1800, 600
    /// with NCCL).
    pub timeout: Option<f64>,
    /// Gradients are averaged in buckets of about this many MiB (default 25,
    /// with a first bucket of at most 1 MiB).
    pub bucket_cap_mb: Option<f64>,
    /// `no` (default), `fp16`, `bf16` or `power_sgd`: how gradients are
    /// compressed on the wire.
    pub comm_hook: Option<CommHook>,
    /// `no` (default), `fp16` or `bf16`: the comm hook runs on the
    /// gradients cast to 16 bits (Accelerate's `comm_wrapper`).
    pub comm_wrapper: Option<CommWrapper>,
    /// PowerSGD's settings, PyTorch's `PowerSGDState` arguments as
    /// Accelerate's `comm_state_option` spells them
    /// (`matrix_approximation_rank`, `start_powerSGD_iter`, …).
    pub comm_state_option: Option<PowerSgdOptions>,
    /// Rank 0's buffers (BatchNorm statistics) are sent to every process
    /// before each training forward pass (default true, as DDP's
    /// `broadcast_buffers`).
    pub broadcast_buffers: Option<bool>,
    /// Parameters may go without a gradient (DDP's
    /// `find_unused_parameters`; default false: an error naming them).
    #[serde(default)]
    pub find_unused_parameters: bool,
    /// The model uses the same parameters every step (DDP's
    /// `static_graph`; allows unused parameters too).
    #[serde(default)]
    pub static_graph: bool,
    /// Gradients are views into the all-reduced buckets (DDP's
    /// `gradient_as_bucket_view`; default false).
    #[serde(default)]
    pub gradient_as_bucket_view: bool,
    /// Every machine writes the whole checkpoint in its own `checkpoints/`
    /// (for machines without a shared file system); default: rank 0 only.
    #[serde(default)]
    pub save_on_each_node: bool,
}

impl DistributedSection {
    /// The gradient averaging settings, defaults filled in.
    pub fn ddp(&self) -> DdpOptions {
        let default = DdpOptions::default();
        DdpOptions {
            bucket_cap_mb: self.bucket_cap_mb.unwrap_or(default.bucket_cap_mb),
            comm_hook: self.comm_hook.unwrap_or(default.comm_hook),
            comm_wrapper: self.comm_wrapper.unwrap_or(default.comm_wrapper),
            comm_state_option: self.comm_state_option.unwrap_or(default.comm_state_option),
            broadcast_buffers: self.broadcast_buffers.unwrap_or(default.broadcast_buffers),
            find_unused_parameters: self.find_unused_parameters,
            static_graph: self.static_graph,
            gradient_as_bucket_view: self.gradient_as_bucket_view,
        }
    }

    /// The init method, when the config sets one (validated).
    pub fn init_method(&self) -> Option<hearth_comm::InitMethod> {
        (self.init_method.as_ref()).map(|m| m.parse().expect("validated with the config"))
    }

    /// The collective timeout, when the config sets one.
    pub fn timeout(&self) -> Option<std::time::Duration> {
        self.timeout.map(std::time::Duration::from_secs_f64)
    }

    pub(super) fn validate(&self, invalid: &Invalid) -> Result<(), ConfigError> {
        if let Some(method) = &self.init_method {
            method
                .parse::<hearth_comm::InitMethod>()
                .map_err(|why| invalid("distributed.init-method", why))?;
        }
        if let Some(t) = self
            .timeout
            .filter(|t| !(t.is_finite() && *t > 0.0 && *t < 1e9))
        {
            return Err(invalid(
                "distributed.timeout",
                format!("must be a number of seconds above 0 and below 1e9, not {t}"),
            ));
        }
        if let Some(mb) = self
            .bucket_cap_mb
            .filter(|mb| !(mb.is_finite() && *mb > 0.0))
        {
            return Err(invalid(
                "distributed.bucket-cap-mb",
                format!("must be a positive number of MiB, not {mb}"),
            ));
        }
        self.ddp()
            .validate()
            .map_err(|why| invalid("distributed", why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ddp_flags_come_from_the_section() {
        let section: DistributedSection = toml::from_str(
            "find-unused-parameters = true\nstatic-graph = true\ngradient-as-bucket-view = true",
        )
        .unwrap();
        let ddp = section.ddp();
        assert!(ddp.find_unused_parameters && ddp.static_graph && ddp.gradient_as_bucket_view);
        let ddp = DistributedSection::default().ddp();
        assert!(!ddp.find_unused_parameters && !ddp.static_graph && !ddp.gradient_as_bucket_view);
        assert!(!ddp.allows_unused_parameters());
    }

    #[test]
    fn power_sgd_and_its_state_come_from_the_section() {
        let section: DistributedSection = toml::from_str(
            "comm-hook = \"power_sgd\"\ncomm-wrapper = \"fp16\"\n\
             [comm-state-option]\nmatrix_approximation_rank = 2\nstart_powerSGD_iter = 3\n",
        )
        .unwrap();
        let ddp = section.ddp();
        assert_eq!(ddp.comm_hook, CommHook::PowerSgd);
        assert_eq!(ddp.comm_wrapper, CommWrapper::Fp16);
        assert_eq!(ddp.comm_state_option.matrix_approximation_rank, 2);
        assert_eq!(ddp.comm_state_option.start_power_sgd_iter, 3);
        assert!(
            ddp.comm_state_option.use_error_feedback,
            "PyTorch's default"
        );
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            path: "job.toml".into(),
            key: key.into(),
            message,
        };
        assert!(section.validate(&invalid).is_ok());
        for (toml, needle) in [
            ("comm-hook = \"batched_power_sgd\"", "batched_powerSGD_hook"),
            ("comm-wrapper = \"bf16\"", "comm_hook is no"),
            (
                "comm-hook = \"fp16\"\n[comm-state-option]\nrandom_seed = 3",
                "comm_hook is not power_sgd",
            ),
            (
                "comm-hook = \"power_sgd\"\n[comm-state-option]\nstart_powerSGD_iter = 1",
                "start_powerSGD_iter",
            ),
        ] {
            let section: DistributedSection = toml::from_str(toml).unwrap();
            let e = section.validate(&invalid).unwrap_err().to_string();
            assert!(
                e.contains("distributed") && e.contains(needle),
                "{toml}: {e}"
            );
        }
        let e = toml::from_str::<DistributedSection>("[comm-state-option]\nrank = 2")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank"),
            "an unknown field is refused by name: {e}"
        );
    }

    #[test]
    fn a_bad_init_method_is_refused_naming_the_key() {
        let section: DistributedSection =
            toml::from_str("init-method = \"file:///tmp/x\"").unwrap();
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            path: "job.toml".into(),
            key: key.into(),
            message,
        };
        let e = section.validate(&invalid).unwrap_err().to_string();
        assert!(
            e.contains("distributed.init-method") && e.contains("tcp://HOST:PORT"),
            "{e}"
        );
        let section: DistributedSection =
            toml::from_str("init-method = \"tcp://10.0.0.7:23456\"").unwrap();
        assert!(section.validate(&invalid).is_ok());
        assert_eq!(
            section.init_method().unwrap().to_string(),
            "tcp://10.0.0.7:23456"
        );
    }
}
