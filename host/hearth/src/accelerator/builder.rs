//! `AcceleratorBuilder`: the options an `Accelerator` is created with.

use super::Accelerator;
use crate::precision::{GradScalerConfig, MixedPrecision};
use hearth_comm::ProcessGroup;
use tch::Device;

/// Builds an [`Accelerator`].
///
/// Defaults: the first CUDA device of this process when one is available,
/// else the CPU; a single-process world; full precision; no accumulation.
/// Mixed precision, accumulation steps and the CPU flag not given here are
/// read from `HEARTH_MIXED_PRECISION`, `HEARTH_GRADIENT_ACCUMULATION_STEPS`
/// and `HEARTH_USE_CPU` (as Accelerate reads `ACCELERATE_*`); what is given
/// here wins.
///
/// ```no_run
/// use hearth::accelerator::Accelerator;
/// use hearth::precision::MixedPrecision;
/// let acc = Accelerator::builder()
///     .cpu(true)
///     .mixed_precision(MixedPrecision::Bf16)
///     .gradient_accumulation_steps(4)
///     .build()?;
/// assert!(acc.is_main_process());
/// # Ok::<(), hearth::accelerator::BuildError>(())
/// ```
#[derive(Default)]
pub struct AcceleratorBuilder {
    cpu: Option<bool>,
    device: Option<Device>,
    group: Option<Box<dyn ProcessGroup>>,
    timeout: Option<std::time::Duration>,
    backend: Option<hearth_comm::Backend>,
    init_method: Option<hearth_comm::InitMethod>,
    mixed_precision: Option<MixedPrecision>,
    gradient_accumulation_steps: Option<usize>,
    accumulation_plugin: Option<super::GradientAccumulationPlugin>,
    fp8: Option<crate::precision::Fp8RecipeKwargs>,
    split_batches: bool,
    even_batches: Option<bool>,
    dispatch_batches: bool,
    device_placement: Option<bool>,
    non_blocking: bool,
    scaler: GradScalerConfig,
    cpu_loss_scaling: bool,
    project: super::ProjectConfiguration,
    ddp: crate::parallel::DdpOptions,
    fsdp: Option<crate::parallel::FsdpPlugin>,
    /// Resolved settings (`hearth run`'s), over `fsdp` and the environment.
    fsdp_settings: Option<Option<crate::parallel::FsdpSettings>>,
    plugin_path: Option<hearth_plugins::SearchPath>,
    profile: Option<crate::profiling::ProfileKwargs>,
    log_with: Vec<String>,
    unchecked: bool,
}

/// How prepared data loaders share batches between processes
/// (Accelerate's `DataLoaderConfiguration`); see the builder's setters of
/// the same names. Default: whole batches per process, even batches, no
/// dispatching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataLoaderConfiguration {
    /// Each batch is split between the processes.
    pub split_batches: bool,
    /// Every process gets the same number of batches.
    pub even_batches: bool,
    /// The main process reads and sends each process its slice.
    pub dispatch_batches: bool,
    /// Batches are copied to the device without waiting for it (from
    /// pinned host memory to a GPU; nothing changes on the CPU).
    pub non_blocking: bool,
}

impl Default for DataLoaderConfiguration {
    fn default() -> Self {
        Self {
            split_batches: false,
            even_batches: true,
            dispatch_batches: false,
            non_blocking: false,
        }
    }
}

/// A bad option or environment variable.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// An environment variable holds something unusable.
    #[error("environment variable {name}={value:?}: {why}")]
    Env {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        why: String,
    },
    /// `gradient_accumulation_steps(0)`.
    #[error("gradient_accumulation_steps must be at least 1")]
    ZeroAccumulation,
    /// FP8 was asked for (see [`crate::precision::fp8_refusal`]).
    #[error("{0}")]
    Fp8(String),
    /// A bad `DdpOptions` (Accelerate's `DistributedDataParallelKwargs`).
    #[error("DistributedDataParallelKwargs: {0}")]
    Ddp(String),
    /// Both `gradient_accumulation_steps` and `gradient_accumulation_plugin`.
    #[error("gradient_accumulation_steps({steps}) and gradient_accumulation_plugin(..) were both given; give only the plugin, with num_steps = {steps}")]
    AccumulationTwice {
        /// The steps given to `gradient_accumulation_steps`.
        steps: usize,
    },
    /// The process group could not be joined.
    #[error("cannot join the process group")]
    Dist(#[from] hearth_comm::DistError),
    /// A bad FSDP setting.
    #[error(transparent)]
    Fsdp(#[from] crate::parallel::FsdpError),
}

fn env_var<T>(
    name: &'static str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, BuildError> {
    match std::env::var(name) {
        Ok(value) if !value.trim().is_empty() => parse(value.trim())
            .map(Some)
            .map_err(|why| BuildError::Env { name, value, why }),
        _ => Ok(None),
    }
}

fn parse_bool(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err("expected true/false (or 1/0)".into()),
    }
}

/// `HEARTH_GRADIENT_ACCUMULATION_STEPS`, if set (Accelerate's
/// `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`).
pub fn accumulation_steps_from_env() -> Result<Option<usize>, BuildError> {
    env_var("HEARTH_GRADIENT_ACCUMULATION_STEPS", |s| {
        s.parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| "expected a whole number of at least 1".to_string())
    })
}

impl AcceleratorBuilder {
    /// Forces the CPU even when a GPU is available (Accelerate's `cpu=True`).
    pub fn cpu(mut self, cpu: bool) -> Self {
        self.cpu = Some(cpu);
        self
    }

    /// Uses exactly this device (overrides `cpu`).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Runs in this process group (default: the one this process was
    /// started in, see [`hearth_comm::from_environment`]).
    pub fn process_group(mut self, group: Box<dyn ProcessGroup>) -> Self {
        self.group = Some(group);
        self
    }

    /// How long a collective waits before it fails (`InitProcessGroupKwargs`'
    /// timeout; by default PyTorch's: 30 minutes, 10 for NCCL).
    pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The collectives library of a world of several processes
    /// (Accelerate's `InitProcessGroupKwargs.backend`); by default NCCL
    /// when this process trains on a GPU, MPI on the CPU. See
    /// [`hearth_comm::choose_backend`] for what each launcher allows.
    pub fn backend(mut self, backend: hearth_comm::Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Where processes started without MPI find rank 0's rendezvous store
    /// (Accelerate's `InitProcessGroupKwargs.init_method`): `env://` (the
    /// default: `MASTER_ADDR` and `MASTER_PORT`) or `tcp://host:port`.
    pub fn init_method(mut self, method: hearth_comm::InitMethod) -> Self {
        self.init_method = Some(method);
        self
    }

    /// `no`, `bf16` or `fp16` (see [`MixedPrecision`]).
    pub fn mixed_precision(mut self, mode: MixedPrecision) -> Self {
        self.mixed_precision = Some(mode);
        self
    }

    /// FP8 training with `recipe` (Accelerate's `mixed_precision="fp8"`
    /// with `FP8RecipeKwargs`): accepted here, refused by
    /// [`build`](Self::build) with what it would need, since no device
    /// hearth runs on has an FP8 backend yet.
    pub fn fp8_recipe(mut self, recipe: crate::precision::Fp8RecipeKwargs) -> Self {
        self.fp8 = Some(recipe);
        self
    }

    /// What [`Accelerator::profile`] records when it is given no
    /// kwargs of its own (Accelerate's `ProfileKwargs` handler).
    pub fn profile_kwargs(mut self, kwargs: crate::profiling::ProfileKwargs) -> Self {
        self.profile = Some(kwargs);
        self
    }

    /// Micro-batches whose gradients add up before each optimizer step.
    pub fn gradient_accumulation_steps(mut self, steps: usize) -> Self {
        self.gradient_accumulation_steps = Some(steps);
        self
    }

    /// All the accumulation settings (Accelerate's
    /// `gradient_accumulation_plugin=`); not together with
    /// [`gradient_accumulation_steps`](Self::gradient_accumulation_steps)
    /// other than 1, as Accelerate refuses both.
    pub fn gradient_accumulation_plugin(
        mut self,
        plugin: super::GradientAccumulationPlugin,
    ) -> Self {
        self.accumulation_plugin = Some(plugin);
        self
    }

    /// Each batch a prepared loader reads is split between the processes
    /// (instead of each process reading whole batches); a prepared
    /// scheduler then steps once per optimizer step instead of
    /// `num_processes` times.
    pub fn split_batches(mut self, split: bool) -> Self {
        self.split_batches = split;
        self
    }

    /// Whether prepared loaders give every process the same number of
    /// batches by completing the last ones from the epoch's start (default true).
    pub fn even_batches(mut self, even: bool) -> Self {
        self.even_batches = Some(even);
        self
    }

    /// The main process reads every batch of prepared loaders and sends
    /// each process its slice (Accelerate's `dispatch_batches`), for
    /// datasets only one process can read. Off by default, where
    /// Accelerate turns it on for iterable datasets: a hearth
    /// [`IterableDataset`](crate::data::IterableDataset) gives the same
    /// stream for an epoch on every process, so each reads its own share
    /// without moving batches through the main process.
    pub fn dispatch_batches(mut self, dispatch: bool) -> Self {
        self.dispatch_batches = dispatch;
        self
    }

    /// Prepared loaders copy batches to the device with `non_blocking`
    /// (Accelerate's `DataLoaderConfiguration.non_blocking`; default off).
    pub fn non_blocking(mut self, non_blocking: bool) -> Self {
        self.non_blocking = non_blocking;
        self
    }

    /// Whether `prepare` puts models, and prepared loaders their batches,
    /// on the accelerator's device (Accelerate's `device_placement`;
    /// default true). Off, they stay where they are: place them yourself.
    pub fn device_placement(mut self, place: bool) -> Self {
        self.device_placement = Some(place);
        self
    }

    /// `split_batches`, `even_batches`, `dispatch_batches` and
    /// `non_blocking` at once (Accelerate's `dataloader_config`).
    pub fn dataloader_config(self, config: DataLoaderConfiguration) -> Self {
        self.split_batches(config.split_batches)
            .even_batches(config.even_batches)
            .dispatch_batches(config.dispatch_batches)
            .non_blocking(config.non_blocking)
    }

    /// Settings of the fp16 loss scaler (Accelerate's `GradScalerKwargs`).
    pub fn grad_scaler(mut self, config: GradScalerConfig) -> Self {
        self.scaler = config;
        self
    }

    /// Under fp16, scales the loss on the CPU too. Accelerate never does (on
    /// the CPU fp16 means float32 training); this exercises the fp16 step
    /// logic — unscale, skip on overflow, back off — without a GPU.
    pub fn cpu_loss_scaling(mut self, on: bool) -> Self {
        self.cpu_loss_scaling = on;
        self
    }

    /// Where checkpoints go and how they are named and rotated
    /// (Accelerate's `project_config`).
    pub fn project_config(mut self, project: super::ProjectConfiguration) -> Self {
        self.project = project;
        self
    }

    /// How gradients are averaged across processes (Accelerate's
    /// `DistributedDataParallelKwargs`: bucket size, compression).
    pub fn ddp(mut self, options: crate::parallel::DdpOptions) -> Self {
        self.ddp = options;
        self
    }

    /// Shards prepared models (Accelerate's `fsdp_plugin`): the fields
    /// left unset are read from `HEARTH_FSDP_*` variables, then defaulted.
    /// Without this, `HEARTH_USE_FSDP=true` turns FSDP on from the
    /// environment alone. See [`crate::parallel::FsdpPlugin`].
    pub fn fsdp(mut self, plugin: crate::parallel::FsdpPlugin) -> Self {
        self.fsdp = Some(plugin);
        self
    }

    /// The whole parallelism at once, resolved: its DDP options and its
    /// FSDP settings (`None`: DDP), as `hearth run` hands over what its
    /// config resolved with the environment. Neither `HEARTH_USE_FSDP` nor
    /// any `HEARTH_FSDP_*` variable is read again; wins over
    /// [`ddp`](Self::ddp) and [`fsdp`](Self::fsdp).
    pub fn strategy(mut self, strategy: crate::parallel::Strategy) -> Self {
        self.ddp = strategy.ddp;
        self.fsdp_settings = Some(strategy.fsdp);
        self
    }

    /// Where plugins (the FSDP wrap policy) are looked for; default: the
    /// standard search path (`HEARTH_PLUGIN_PATH`, the built-in set).
    pub fn plugin_path(mut self, path: hearth_plugins::SearchPath) -> Self {
        self.plugin_path = Some(path);
        self
    }

    /// Trackers by plugin name (Accelerate's `log_with`): found on the
    /// plugin path (built-ins last) and started by
    /// [`Accelerator::init_trackers_named`], on the main process only.
    pub fn log_with<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.log_with = names.into_iter().map(Into::into).collect();
        self
    }

    /// Whether the first synchronising backward pass checks that nothing
    /// the step needs was left out of `prepare` (default: on): with
    /// accumulation or a prepared scheduler, every trainable parameter of a
    /// prepared model must be in a prepared optimizer, and every prepared
    /// scheduler bound to one; on several processes, every parameter a
    /// prepared optimizer steps must belong to a prepared model (so its
    /// gradients are averaged). Turn it off when leaving something out is
    /// deliberate (an optimizer stepped by hand on every micro-batch, a
    /// parameter meant to differ between processes).
    pub fn check_prepared(mut self, on: bool) -> Self {
        self.unchecked = !on;
        self
    }

    /// Creates the accelerator.
    pub fn build(self) -> Result<Accelerator, BuildError> {
        hearth_ops::keep_freed_memory_for_reuse();
        use crate::parallel::FsdpPlugin;
        let fsdp = match (self.fsdp_settings, self.fsdp) {
            (Some(resolved), _) => resolved,
            (None, Some(plugin)) => Some(
                plugin
                    .or(FsdpPlugin::from_env()?)
                    .resolve("the FSDP plugin")?,
            ),
            (None, None) if FsdpPlugin::wanted_by_env()? => {
                Some(FsdpPlugin::from_env()?.resolve("the FSDP environment")?)
            }
            (None, None) => None,
        };
        let mixed_precision = match self.mixed_precision {
            Some(m) => m,
            None => env_var("HEARTH_MIXED_PRECISION", str::parse)?.unwrap_or_default(),
        };
        let steps = match self.gradient_accumulation_steps {
            Some(s) => s,
            None => accumulation_steps_from_env()?.unwrap_or(1),
        };
        let accumulation = match self.accumulation_plugin {
            Some(_) if steps != 1 && self.gradient_accumulation_steps.is_some() => {
                return Err(BuildError::AccumulationTwice { steps })
            }
            Some(plugin) => plugin,
            None => super::GradientAccumulationPlugin {
                num_steps: steps,
                ..Default::default()
            },
        };
        if accumulation.num_steps == 0 {
            return Err(BuildError::ZeroAccumulation);
        }
        let cpu = match self.cpu {
            Some(c) => c,
            None => env_var("HEARTH_USE_CPU", parse_bool)?.unwrap_or(false),
        };
        // The device first: the launcher's local rank picks the GPU, and
        // the device decides the default backend.
        let local_rank = match &self.group {
            Some(group) => group.local_process_index(),
            None => hearth_comm::LaunchEnv::from_env()
                .map(|env| env.local_rank)
                .unwrap_or(0),
        };
        let device = match self.device {
            Some(device) => device,
            None if cpu => Device::Cpu,
            None if hearth_ops::cuda::is_available() => {
                Device::Cuda(local_rank % hearth_ops::cuda::device_count())
            }
            None => Device::Cpu,
        };
        if self.fp8.is_some() {
            return Err(BuildError::Fp8(crate::precision::fp8_refusal(Some(device))));
        }
        self.ddp.validate().map_err(BuildError::Ddp)?;
        let group = match self.group {
            Some(group) => group,
            None => hearth_comm::from_environment(
                self.timeout,
                self.backend,
                match device {
                    Device::Cuda(index) => Some(index),
                    _ => None,
                },
                &self.init_method.clone().unwrap_or_default(),
            )?,
        };
        Ok(Accelerator::new(Settings {
            device,
            group,
            mixed_precision,
            accumulation,
            split_batches: self.split_batches,
            even_batches: self.even_batches.unwrap_or(true),
            dispatch_batches: self.dispatch_batches,
            device_placement: self.device_placement.unwrap_or(true),
            non_blocking: self.non_blocking,
            scaler: self.scaler,
            cpu_loss_scaling: self.cpu_loss_scaling,
            project: self.project,
            ddp: self.ddp,
            fsdp,
            plugin_path: self
                .plugin_path
                .unwrap_or_else(|| hearth_plugins::SearchPath::standard(&[], None)),
            profile: self.profile,
            log_with: self.log_with,
            check_prepared: !self.unchecked,
        }))
    }
}

/// What the builder decided.
pub(super) struct Settings {
    pub device: tch::Device,
    pub group: Box<dyn hearth_comm::ProcessGroup>,
    pub mixed_precision: crate::precision::MixedPrecision,
    pub accumulation: super::GradientAccumulationPlugin,
    pub split_batches: bool,
    pub even_batches: bool,
    pub dispatch_batches: bool,
    pub device_placement: bool,
    pub non_blocking: bool,
    pub scaler: crate::precision::GradScalerConfig,
    pub cpu_loss_scaling: bool,
    pub project: super::ProjectConfiguration,
    pub ddp: crate::parallel::DdpOptions,
    pub fsdp: Option<crate::parallel::FsdpSettings>,
    pub plugin_path: hearth_plugins::SearchPath,
    pub profile: Option<crate::profiling::ProfileKwargs>,
    pub log_with: Vec<String>,
    pub check_prepared: bool,
}
