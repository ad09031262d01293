//! `AcceleratedScheduler`: a learning-rate schedule that advances only when
//! the optimizer really stepped.

use super::optimizer::SharedOptimizer;
use super::GradientState;
use hearth_plugins::{PluginError, SchedulerPlugin};
use std::sync::{Arc, Mutex};

/// A learning-rate schedule: the rate of each parameter group after `step`
/// scheduler steps (PyTorch's convention: step 0 is the rate before any).
/// The built-in schedules are Wasm plugins ([`SchedulerPlugin`]); a Rust
/// closure-like schedule can implement this too.
pub trait LrSchedule: Send {
    /// Rates per parameter group after `step` scheduler steps.
    fn lrs(&mut self, step: u64) -> Result<Vec<f64>, PluginError>;
    /// Feeds a metric (reduce-on-plateau uses it; others ignore it).
    fn observe(&mut self, _metric: f64) -> Result<(), PluginError> {
        Ok(())
    }
    /// The schedule's own state, for checkpoints.
    fn save(&mut self) -> Result<Vec<u8>, PluginError> {
        Ok(Vec::new())
    }
    /// Restores what [`save`](Self::save) returned.
    fn load(&mut self, _state: &[u8]) -> Result<(), PluginError> {
        Ok(())
    }
}

impl LrSchedule for SchedulerPlugin {
    fn lrs(&mut self, step: u64) -> Result<Vec<f64>, PluginError> {
        SchedulerPlugin::lrs(self, step)
    }
    fn observe(&mut self, metric: f64) -> Result<(), PluginError> {
        SchedulerPlugin::observe(self, metric)
    }
    fn save(&mut self) -> Result<Vec<u8>, PluginError> {
        SchedulerPlugin::save(self)
    }
    fn load(&mut self, state: &[u8]) -> Result<(), PluginError> {
        SchedulerPlugin::load(self, state)
    }
}

/// A schedule prepared by the accelerator (Accelerate's
/// `AcceleratedScheduler`), bound to the optimizer prepared before it or in
/// the same `prepare` call: preparing sets that optimizer's rates to the
/// schedule's first ones. [`step`](Self::step) does nothing on
/// micro-batches that do not end an accumulation group or when the fp16
/// optimizer step was skipped; otherwise it advances `num_processes` steps
/// (one with `split_batches`, where each process sees the batches the
/// schedule was written for) and sets the optimizer's rates.
pub struct AcceleratedScheduler {
    core: SharedScheduler,
    state: GradientState,
    steps_per_step: u64,
}

/// The part of a prepared scheduler the accelerator keeps for checkpoints.
pub(super) type SharedScheduler = Arc<Mutex<SchedulerCore>>;

pub(super) struct SchedulerCore {
    schedule: Box<dyn LrSchedule>,
    optimizer: Option<SharedOptimizer>,
    step: u64,
    last_lrs: Vec<f64>,
}

impl SchedulerCore {
    /// True when an optimizer was prepared for it to set the rates of.
    pub(super) fn is_bound(&self) -> bool {
        self.optimizer.is_some()
    }

    /// Sets the optimizer's rates to the schedule's at the current step.
    fn apply(&mut self) -> Result<(), PluginError> {
        let lrs = self.schedule.lrs(self.step)?;
        let bad = |message: String| PluginError::Runtime {
            name: "learning-rate schedule".into(),
            message,
        };
        if let Some(lr) = lrs.iter().find(|lr| !lr.is_finite() || **lr < 0.0) {
            return Err(bad(format!(
                "returned the rate {lr} at step {}; a rate must be a finite number of at least 0",
                self.step
            )));
        }
        if let Some(opt) = &self.optimizer {
            let mut core = super::lock(opt);
            let groups = core.inner.lrs().len();
            if lrs.len() == groups {
                core.inner.set_lrs(&lrs);
            } else if let [lr] = lrs[..] {
                core.inner.set_lr(lr);
            } else {
                return Err(bad(format!(
                    "returned {} rates at step {} for an optimizer of {groups} parameter groups; \
                     return one rate per group, or one for all",
                    lrs.len(),
                    self.step
                )));
            }
        }
        self.last_lrs = lrs;
        Ok(())
    }

    /// The step count and the schedule's own state, for checkpoints.
    pub(super) fn state(&mut self) -> Result<(u64, Vec<u8>), PluginError> {
        Ok((self.step, self.schedule.save()?))
    }

    /// Restores what [`state`](Self::state) returned and sets the
    /// optimizer's rates to match.
    pub(super) fn load_state(&mut self, step: u64, state: &[u8]) -> Result<(), PluginError> {
        self.schedule.load(state)?;
        self.step = step;
        self.apply()
    }
}

impl AcceleratedScheduler {
    pub(super) fn new(
        schedule: Box<dyn LrSchedule>,
        optimizer: Option<SharedOptimizer>,
        state: GradientState,
        steps_per_step: u64,
    ) -> Result<Self, PluginError> {
        let mut core = SchedulerCore {
            schedule,
            optimizer,
            step: 0,
            last_lrs: Vec::new(),
        };
        core.apply()?;
        Ok(Self {
            core: Arc::new(Mutex::new(core)),
            state,
            steps_per_step,
        })
    }

    pub(super) fn shared(&self) -> SharedScheduler {
        self.core.clone()
    }

    fn core(&self) -> std::sync::MutexGuard<'_, SchedulerCore> {
        super::lock(&self.core)
    }

    /// Advances the schedule after the optimizer stepped (call it after
    /// `optimizer.step()` on every micro-batch, as with Accelerate).
    pub fn step(&mut self) -> Result<(), PluginError> {
        if !self.state.sync_gradients() {
            return Ok(());
        }
        let mut core = self.core();
        if let Some(opt) = &core.optimizer {
            if super::lock(opt).skipped {
                return Ok(());
            }
        }
        core.step += self.steps_per_step;
        core.apply()
    }

    /// Feeds an evaluation metric to the schedule and sets the rates it
    /// gives now (reduce-on-plateau lowers them at once, as PyTorch's
    /// `ReduceLROnPlateau.step(metric)` does).
    pub fn observe(&mut self, metric: f64) -> Result<(), PluginError> {
        let mut core = self.core();
        core.schedule.observe(metric)?;
        core.apply()
    }

    /// The rates set last (PyTorch's `get_last_lr`).
    pub fn last_lrs(&self) -> Vec<f64> {
        self.core().last_lrs.clone()
    }

    /// Scheduler steps taken so far.
    pub fn steps(&self) -> u64 {
        self.core().step
    }

    /// The step count and the schedule's own state, for checkpoints.
    pub fn state(&mut self) -> Result<(u64, Vec<u8>), PluginError> {
        self.core().state()
    }

    /// Restores what [`state`](Self::state) returned and sets the
    /// optimizer's rates to match.
    pub fn load_state(&mut self, step: u64, state: &[u8]) -> Result<(), PluginError> {
        self.core().load_state(step, state)
    }
}
