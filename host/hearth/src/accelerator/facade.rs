//! The `Accelerator` itself.

use super::builder::AcceleratorBuilder;
use super::checkpointing::{ProjectConfiguration, Registered};
use super::optimizer::SharedOptimizer;
use super::prepare::{Prepare, PrepareError};
use super::{AcceleratedOptimizer, AcceleratedScheduler, GradientState, LrSchedule, TrackerHub};
use crate::data::Shard;
use crate::models::Model;
use crate::optim::Optimizer;
use crate::parallel::BackwardError;
use crate::precision::{GradScaler, MixedPrecision};
use hearth_comm::ProcessGroup;
use hearth_ops::{self as ops, AutocastGuard};
use std::sync::{Arc, Mutex};
use tch::{Device, TchError, Tensor};

/// Owns the device, the process group and the training settings of a
/// training process (Accelerate's `Accelerator`).
///
/// ```no_run
/// # use hearth::accelerator::Accelerator;
/// # use hearth::data::{DataLoader, Dataset};
/// # fn demo(model: hearth::models::Mlp, opt: hearth::optim::Sgd,
/// #         loader: DataLoader<hearth::data::MapStyle<Vec<(tch::Tensor, tch::Tensor)>>>) -> anyhow::Result<()> {
/// use hearth::models::Model;
/// let mut acc = Accelerator::builder().gradient_accumulation_steps(2).build()?;
/// let (model, mut opt, loader) = acc.prepare((model, opt, loader))?;
/// for (x, y) in loader.iter() {
///     acc.accumulate(|| -> anyhow::Result<()> {
///         let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
///         acc.backward(&loss)?;
///         opt.step()?;
///         opt.zero_grad();
///         Ok(())
///     })?;
/// }
/// # Ok(()) }
/// ```
pub struct Accelerator {
    pub(super) device: Device,
    pub(super) group: Box<dyn ProcessGroup>,
    pub(super) trackers: Option<TrackerHub>,
    /// What went wrong with each tracker, once `end_training` finished them.
    pub(super) tracker_health: Vec<hearth_plugins::TrackerHealth>,
    /// Trackers by name (`log_with`) and where they are found.
    pub(super) log_with: (Vec<String>, hearth_plugins::SearchPath),
    mixed_precision: MixedPrecision,
    pub(super) state: GradientState,
    split_batches: bool,
    even_batches: bool,
    pub(super) dispatch_batches: bool,
    /// Prepared models and loaders' batches go to the device.
    pub(super) device_placement: bool,
    /// Prepared loaders copy batches to the device without waiting.
    pub(super) non_blocking: bool,
    pub(super) scaler: Option<Arc<Mutex<GradScaler>>>,
    pub(super) optimizers: Vec<SharedOptimizer>,
    pub(super) registered: Registered,
    pub(super) project: ProjectConfiguration,
    pub(super) micro_steps: std::sync::atomic::AtomicU64,
    pub(super) pending_save: Option<PendingSave>,
    /// The last save of several writers, until every process agreed on it.
    pub(super) provisional: Option<super::checkpointing::Provisional>,
    /// A background save was started and its outcome not yet agreed by
    /// every process (see `wait_for_checkpoint_everywhere`).
    pub(super) unagreed_save: bool,
    /// The host buffers asynchronous saves copy the state into.
    pub(super) snapshot_buffers: super::checkpointing::SnapshotBuffers,
    pub(super) data_parallel: crate::parallel::data_parallel::DataParallel,
    /// Set by [`set_trigger`](Self::set_trigger), read by `check_trigger`.
    pub(super) trigger: std::sync::atomic::AtomicBool,
    /// The builder's `profile_kwargs`, for [`profile`](Self::profile).
    pub(super) profile_handler: Option<crate::profiling::ProfileKwargs>,
    /// The check for objects left out of `prepare` (`unprepared.rs`).
    pub(super) unprepared: super::unprepared::PreparedCheck,
}

/// A checkpoint being written in the background.
pub(super) type PendingSave =
    std::thread::JoinHandle<Result<std::path::PathBuf, crate::checkpoint::CheckpointError>>;

/// The random generators' states of a process (Accelerate saves them as
/// `random_states_<rank>.pkl`): the CPU generator and one per CUDA device.
#[derive(Debug)]
pub struct RngState {
    /// libtorch's default CPU generator.
    pub cpu: Tensor,
    /// The default generator of each CUDA device, by index.
    pub cuda: Vec<Tensor>,
}

impl Accelerator {
    /// Starts building an accelerator; see [`AcceleratorBuilder`].
    pub fn builder() -> AcceleratorBuilder {
        AcceleratorBuilder::default()
    }

    pub(super) fn new(s: super::builder::Settings) -> Self {
        let scales = s.scaler.enabled
            && (s.mixed_precision.scales_loss(s.device)
                || (s.cpu_loss_scaling && s.mixed_precision == MixedPrecision::Fp16));
        let scaler = scales.then(|| Arc::new(Mutex::new(GradScaler::new(s.scaler))));
        Self {
            device: s.device,
            group: s.group,
            trackers: None,
            tracker_health: Vec::new(),
            log_with: (s.log_with, s.plugin_path.clone()),
            mixed_precision: s.mixed_precision,
            state: GradientState::with_plugin(s.accumulation),
            split_batches: s.split_batches,
            even_batches: s.even_batches,
            dispatch_batches: s.dispatch_batches,
            device_placement: s.device_placement,
            non_blocking: s.non_blocking,
            scaler,
            optimizers: Vec::new(),
            registered: Registered::default(),
            project: s.project,
            micro_steps: Default::default(),
            pending_save: None,
            provisional: None,
            unagreed_save: false,
            snapshot_buffers: Default::default(),
            data_parallel: crate::parallel::data_parallel::DataParallel::new(
                crate::parallel::Strategy {
                    ddp: s.ddp,
                    fsdp: s.fsdp,
                },
                s.plugin_path,
            ),
            trigger: Default::default(),
            profile_handler: s.profile,
            unprepared: super::unprepared::PreparedCheck::new(s.check_prepared),
        }
    }

    /// Prepares models, optimizers, data loaders and schedulers for
    /// training — one, or several in a tuple, in any order — and returns
    /// them prepared, in the same order. A scheduler binds to the optimizer
    /// prepared last (in the same call or before). Preparing twice is
    /// harmless.
    pub fn prepare<T: Prepare>(&mut self, objects: T) -> Result<T::Prepared, PrepareError> {
        objects.prepare_with(self)
    }

    pub(super) fn wrap_optimizer(
        &mut self,
        inner: Box<dyn Optimizer>,
    ) -> Result<AcceleratedOptimizer, PrepareError> {
        let inner = self
            .data_parallel
            .wrap_optimizer(self.group.as_ref(), inner)
            .map_err(PrepareError::Sharding)?;
        let opt = AcceleratedOptimizer::new(inner, self.state.clone(), self.scaler.clone());
        self.remember_optimizer(&opt);
        Ok(opt)
    }

    pub(super) fn remember_optimizer(&mut self, opt: &AcceleratedOptimizer) {
        let shared = opt.shared();
        self.optimizers.retain(|o| !Arc::ptr_eq(o, &shared));
        self.optimizers.push(shared);
    }

    pub(super) fn wrap_scheduler(
        &mut self,
        schedule: Box<dyn LrSchedule>,
    ) -> Result<AcceleratedScheduler, PrepareError> {
        let steps = if self.split_batches {
            1
        } else {
            self.num_processes() as u64
        };
        let scheduler = AcceleratedScheduler::new(
            schedule,
            self.optimizers.last().cloned(),
            self.state.clone(),
            steps,
        )
        .map_err(PrepareError::Scheduler)?;
        self.remember_scheduler(scheduler.shared());
        Ok(scheduler)
    }

    /// Whether `prepare` puts models, and prepared loaders their batches,
    /// on the device (Accelerate's `device_placement`; default true).
    pub fn device_placement(&self) -> bool {
        self.device_placement
    }

    /// How prepared data loaders share batches between processes.
    pub fn shard(&self) -> Shard {
        Shard {
            process_index: self.process_index(),
            num_processes: self.num_processes(),
            split_batches: self.split_batches,
            even_batches: self.even_batches,
        }
    }

    /// The accumulation state shared with prepared objects.
    pub fn gradient_state(&self) -> &GradientState {
        &self.state
    }

    /// Micro-batches per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.state.num_steps()
    }

    /// Micro-batches run through [`accumulate`](Self::accumulate) so far
    /// (restored by `load_state`; Accelerate's `accelerator.step`).
    pub fn step(&self) -> u64 {
        self.micro_steps.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// True when the current micro-batch ends an accumulation group.
    pub fn sync_gradients(&self) -> bool {
        self.state.sync_gradients()
    }

    /// The mixed-precision mode.
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.mixed_precision
    }

    /// Runs one micro-batch's work (Accelerate's `with accumulate(model)`):
    /// first decides whether it ends an accumulation group — every
    /// `gradient_accumulation_steps`-th micro-batch and the last batch of a
    /// prepared loader's epoch do — then runs `f`, without gradient
    /// synchronisation between processes when it does not.
    pub fn accumulate<R>(&self, f: impl FnOnce() -> R) -> R {
        self.state.advance();
        self.micro_steps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // sync_each_batch: every micro-batch communicates; the optimizer
        // still steps on sync_gradients only.
        if self.state.sync_gradients() || self.state.plugin().sync_each_batch {
            f()
        } else {
            self.no_sync(f)
        }
    }

    /// Runs `f` without averaging gradients between processes in its
    /// backward passes (DDP's `no_sync`): they add up locally until a
    /// backward outside it.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        self.data_parallel.no_sync(f)
    }

    /// Runs `f` with gradient averaging on for its backward passes even
    /// inside `no_sync` (Accelerate's `trigger_sync_in_backward`).
    pub fn trigger_sync_in_backward<R>(&self, f: impl FnOnce() -> R) -> R {
        self.data_parallel.forced_sync(f)
    }

    /// Autocast for this accelerator's mixed precision while the guard
    /// lives (`accelerator.autocast()`); `None` in full precision.
    pub fn autocast(&self) -> Option<AutocastGuard> {
        let kind = self.mixed_precision.autocast_kind(self.device)?;
        Some(AutocastGuard::new(self.device, kind).expect("autocast kinds are valid"))
    }

    /// Autocast as `kwargs` say while the guard lives (Accelerate's
    /// `accelerator.autocast(autocast_handler=AutocastKwargs(..))`):
    /// `enabled: false` turns it off inside, also within an outer
    /// `autocast()`; `None` in full precision, as Accelerate's is a no-op
    /// there.
    pub fn autocast_with(&self, kwargs: &AutocastKwargs) -> Option<AutocastGuard> {
        let kind = self.mixed_precision.autocast_kind(self.device)?;
        Some(
            AutocastGuard::with(self.device, kind, kwargs.enabled, kwargs.cache_enabled)
                .expect("autocast kinds are valid"),
        )
    }

    /// The device this process trains on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Index of this process among all processes.
    pub fn process_index(&self) -> usize {
        self.group.process_index()
    }

    /// Number of processes in the run.
    pub fn num_processes(&self) -> usize {
        self.group.num_processes()
    }

    /// Index of this process on its machine.
    pub fn local_process_index(&self) -> usize {
        self.group.local_process_index()
    }

    /// True on the process with index 0 (the one that logs and saves).
    pub fn is_main_process(&self) -> bool {
        self.process_index() == 0
    }

    /// True on the first process of each machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_process_index() == 0
    }

    /// The process group.
    pub fn process_group(&self) -> &dyn ProcessGroup {
        self.group.as_ref()
    }

    /// Prints once per machine (on the local main process), like
    /// `Accelerator.print`.
    pub fn print(&self, message: impl std::fmt::Display) {
        if self.is_local_main_process() {
            println!("{message}");
        }
    }

    /// Seeds libtorch's generators (CPU and every CUDA device); with
    /// `device_specific` each process adds its index so ranks differ; with
    /// `deterministic`, turns on `torch.use_deterministic_algorithms`
    /// (Accelerate's `set_seed(seed, device_specific, deterministic)`).
    pub fn set_seed(&self, seed: u64, device_specific: bool, deterministic: bool) {
        let seed = if device_specific {
            seed.wrapping_add(self.process_index() as u64)
        } else {
            seed
        };
        tch::manual_seed(seed as i64);
        if hearth_ops::cuda::is_available() {
            tch::Cuda::manual_seed_all(seed);
        }
        if deterministic {
            hearth_ops::use_deterministic_algorithms(true)
                .expect("turning deterministic algorithms on cannot fail");
        }
    }

    /// The states of the random generators (CPU and each CUDA device).
    pub fn rng_state(&self) -> Result<RngState, TchError> {
        let cuda = (0..cuda_devices())
            .map(|i| ops::rng_state(Device::Cuda(i)))
            .collect::<Result<_, _>>()?;
        Ok(RngState {
            cpu: ops::rng_state(Device::Cpu)?,
            cuda,
        })
    }

    /// Restores generator states saved by [`rng_state`](Self::rng_state).
    pub fn set_rng_state(&self, state: &RngState) -> Result<(), TchError> {
        ops::set_rng_state(Device::Cpu, &state.cpu)?;
        for (i, s) in state.cuda.iter().enumerate().take(cuda_devices()) {
            ops::set_rng_state(Device::Cuda(i), s)?;
        }
        Ok(())
    }

    /// Computes gradients of `loss` divided by the accumulation steps
    /// (Accelerate's `accelerator.backward`; a short last group at the end
    /// of an epoch is divided the same way, as there). Under fp16 the loss
    /// is multiplied by the scaler's scale first. With several processes
    /// the gradients of prepared models are averaged across them, each
    /// bucket as soon as backward has produced its gradients, except inside
    /// [`no_sync`](Self::no_sync) (which
    /// [`accumulate`](Self::accumulate) uses between sync steps).
    pub fn backward(&self, loss: &Tensor) -> Result<(), BackwardError> {
        let _span = crate::profiling::span("hearth::backward");
        self.check_prepared()?;
        let steps = self.state.num_steps();
        let loss = if steps > 1 {
            loss / steps as f64
        } else {
            loss.shallow_clone()
        };
        self.data_parallel
            .backward(self.group.as_ref(), || match &self.scaler {
                Some(scaler) => scaler.lock().unwrap().scale(&loss).f_backward(),
                None => loss.f_backward(),
            })
    }

    /// Clips the total `norm_type` norm of `optimizer`'s gradients (2.0:
    /// L2, Accelerate's default; 1.0; `f64::INFINITY`: the largest absolute
    /// value) to `max_norm`, unscaling them first under fp16, and returns
    /// the norm before clipping. Accelerate takes the parameters; hearth takes the prepared
    /// optimizer that holds them, which is what it must unscale. On a
    /// micro-batch that does not end an accumulation group the gradients
    /// are still adding up: nothing is clipped and the norm is `None`
    /// (Accelerate's examples clip under `if accelerator.sync_gradients`).
    pub fn clip_grad_norm_(
        &self,
        optimizer: &mut AcceleratedOptimizer,
        max_norm: f64,
        norm_type: f64,
    ) -> Result<Option<Tensor>, TchError> {
        if !self.sync_gradients() {
            return Ok(None);
        }
        let _span = crate::profiling::span("hearth::clip_grad_norm");
        optimizer.unscale_gradients()?;
        optimizer
            .with_inner(|inner| {
                super::grad::clip_grad_norm_across(
                    &inner.parameters(),
                    max_norm,
                    norm_type,
                    inner.process_group(),
                    &inner.shard_mask(),
                )
            })
            .map(Some)
    }

    /// Clamps every gradient of `optimizer` to `[-clip_value, clip_value]`
    /// (unscaling first under fp16); nothing on a micro-batch that does not
    /// end an accumulation group.
    pub fn clip_grad_value_(
        &self,
        optimizer: &mut AcceleratedOptimizer,
        clip_value: f64,
    ) -> Result<(), TchError> {
        if !self.sync_gradients() {
            return Ok(());
        }
        optimizer.unscale_gradients()?;
        for p in optimizer.parameters() {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.f_clamp_(-clip_value, clip_value)?;
            }
        }
        Ok(())
    }

    /// True when the last optimizer step of any prepared optimizer was
    /// skipped because fp16 gradients overflowed.
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.optimizers.iter().any(|o| super::lock(o).skipped)
    }

    /// The current fp16 loss scale, when there is a scaler.
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(|s| s.lock().unwrap().get_scale())
    }

    /// Accelerate's `prepare_model(model, evaluation_mode=...)`: with
    /// `evaluation_mode` false the same as [`prepare`](Self::prepare); true,
    /// the model is placed on the device, runs under the mixed precision and
    /// is saved with the others, but is neither data-parallel nor sharded:
    /// its parameters are not broadcast from rank 0 and its gradients are
    /// not averaged (a model that is only evaluated).
    pub fn prepare_model<M: Model + 'static>(
        &mut self,
        model: M,
        evaluation_mode: bool,
    ) -> Result<crate::accelerator::PreparedModel<M>, PrepareError> {
        super::prepare::prepare_model_as(model, self, evaluation_mode)
    }

    /// Accelerate's `free_memory`: drops `objects` (prepared models,
    /// optimizers…), forgets every prepared model, optimizer, scheduler and
    /// data loader (later saves hold none of them, gradients are no longer
    /// averaged), resets the step counter and the accumulation position to
    /// 0, and releases cached GPU memory and an async save's buffers.
    /// Objects given to `register_for_checkpointing` stay, as in Accelerate.
    pub fn free_memory<T>(&mut self, objects: T) -> Result<(), TchError> {
        drop(objects);
        self.optimizers.clear();
        let registered = &mut self.registered;
        registered.models.clear();
        registered.buffers.clear();
        registered.shards.clear();
        registered.schedulers.clear();
        registered.loaders.clear();
        self.data_parallel.forget();
        self.micro_steps
            .store(0, std::sync::atomic::Ordering::Relaxed);
        self.state.set_accumulation_position(0);
        self.snapshot_buffers.clear();
        ops::empty_device_cache()
    }

    /// Accelerate's `clear`: the same as [`free_memory`](Self::free_memory).
    pub fn clear<T>(&mut self, objects: T) -> Result<(), TchError> {
        self.free_memory(objects)
    }

    /// Finishes the trackers (Accelerate's `end_training`) and waits for
    /// them and for a checkpoint being written in the background, whose
    /// failure it returns.
    pub fn end_training(&mut self) -> Result<(), crate::checkpoint::CheckpointError> {
        if let Some(hub) = self.trackers.take() {
            let dropped = hub.dropped();
            self.tracker_health = hub
                .finish()
                .iter()
                .map(|t| {
                    let mut health = t.health();
                    // Values the hub's full queue never handed over.
                    health.values_dropped += dropped;
                    health
                })
                .collect();
        }
        // Every process calls it: the last save is agreed (and, of several
        // writers, settled) on all of them.
        let waited = self.wait_for_checkpoint_everywhere();
        self.snapshot_buffers.clear();
        waited
    }
}

impl Drop for Accelerator {
    /// Waits for a checkpoint being written in the background; a failure
    /// nobody asked about is logged.
    fn drop(&mut self) {
        if let Err(e) = self.wait_for_checkpoint() {
            tracing::error!("the last checkpoint was not written: {e}");
        }
        if let Some(p) = self.provisional.take() {
            tracing::warn!(
                "{} was never agreed by every machine (end_training was not called)",
                p.dest.display()
            );
        }
    }
}

/// How an [`Accelerator::autocast_with`] block runs autocast (Accelerate's
/// `AutocastKwargs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutocastKwargs {
    /// Autocast on inside the block (true).
    pub enabled: bool,
    /// Whether casts of leaf tensors are cached inside; `None` leaves the
    /// setting as it is (Accelerate's default).
    pub cache_enabled: Option<bool>,
}

impl Default for AutocastKwargs {
    fn default() -> Self {
        Self {
            enabled: true,
            cache_enabled: None,
        }
    }
}

fn cuda_devices() -> usize {
    hearth_ops::cuda::device_count()
}
