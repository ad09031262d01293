//! `AcceleratedOptimizer`: an optimizer that steps only when gradients are
//! synchronised, and goes through the loss scaler under fp16.

use super::GradientState;
use crate::optim::Optimizer;
use crate::precision::GradScaler;
use std::sync::{Arc, Mutex};
use tch::{TchError, Tensor};

/// An optimizer prepared by the accelerator (Accelerate's
/// `AcceleratedOptimizer`). On micro-batches that do not end an
/// accumulation group, [`step`](Self::step) and
/// [`zero_grad`](Self::zero_grad) do nothing. Under fp16 the gradients are
/// unscaled before the step (once, even if clipping already did it) and a
/// step with inf/NaN gradients is skipped.
///
/// A prepared scheduler holds a handle to the optimizer prepared before it
/// (or with it), reads whether its step was skipped and sets its rates.
pub struct AcceleratedOptimizer {
    core: SharedOptimizer,
    state: GradientState,
    scaler: Option<Arc<Mutex<GradScaler>>>,
}

/// The part of a prepared optimizer its scheduler shares.
pub(super) type SharedOptimizer = Arc<Mutex<Core>>;

pub(super) struct Core {
    pub(super) inner: Box<dyn Optimizer>,
    found_inf: Option<Tensor>,
    pub(super) skipped: bool,
    /// Bytes of gradients and of optimizer state this process held at the
    /// last step.
    pub(super) held: Option<(u64, u64)>,
}

impl Core {
    /// Steps the inner optimizer and notes what this process held then.
    fn step(&mut self) -> Result<(), TchError> {
        self.skipped = false;
        let grads: u64 = self
            .inner
            .parameters()
            .iter()
            .map(Tensor::grad)
            .filter(Tensor::defined)
            .map(|g| (g.numel() * g.kind().elt_size_in_bytes()) as u64)
            .sum();
        self.inner.step()?;
        self.held = Some((grads, self.inner.local_state_bytes()));
        Ok(())
    }
}

impl AcceleratedOptimizer {
    pub(super) fn new(
        inner: Box<dyn Optimizer>,
        state: GradientState,
        scaler: Option<Arc<Mutex<GradScaler>>>,
    ) -> Self {
        let core = Core {
            inner,
            found_inf: None,
            skipped: false,
            held: None,
        };
        Self {
            core: Arc::new(Mutex::new(core)),
            state,
            scaler,
        }
    }

    pub(super) fn shared(&self) -> SharedOptimizer {
        self.core.clone()
    }

    fn core(&self) -> std::sync::MutexGuard<'_, Core> {
        super::lock(&self.core)
    }

    /// Steps the wrapped optimizer when gradients are synchronised.
    pub fn step(&mut self) -> Result<(), TchError> {
        if !self.state.sync_gradients() {
            return Ok(());
        }
        let _span = crate::profiling::span("hearth::optimizer_step");
        let Some(scaler) = self.scaler.clone() else {
            return self.core().step();
        };
        self.unscale_gradients()?;
        let mut core = self.core();
        let found_inf = core.found_inf.take().expect("unscaled just above");
        let skip = f64::try_from(found_inf.sum(tch::Kind::Float))? > 0.0;
        if !skip {
            core.step()?;
        }
        core.skipped = skip;
        let updated = scaler.lock().unwrap().update(&found_inf);
        updated
    }

    /// Drops the gradients when gradients are synchronised.
    pub fn zero_grad(&mut self) {
        if self.state.sync_gradients() {
            let mut core = self.core();
            core.found_inf = None;
            core.inner.zero_grad();
        }
    }

    /// True when the last optimizer step was skipped because the fp16
    /// gradients overflowed (Accelerate's `optimizer.step_was_skipped`).
    pub fn step_was_skipped(&self) -> bool {
        self.core().skipped
    }

    /// Divides the gradients by the loss scale, once per step; nothing
    /// without a scaler, and nothing on a micro-batch that does not end an
    /// accumulation group (the gradients are still adding up, scaled).
    /// Clipping calls it first.
    pub fn unscale_gradients(&mut self) -> Result<(), TchError> {
        let Some(scaler) = &self.scaler else {
            return Ok(());
        };
        if !self.state.sync_gradients() {
            return Ok(());
        }
        let mut core = self.core();
        if core.found_inf.is_none() {
            let grads: Vec<Tensor> = core.inner.parameters().iter().map(Tensor::grad).collect();
            let mut found_inf = scaler.lock().unwrap().unscale_(&grads)?;
            // A sharded optimizer sees its shards only: an overflow in any
            // process's shard skips the step everywhere.
            if let Some(group) = core.inner.process_group() {
                group
                    .all_reduce(&mut found_inf, hearth_comm::ReduceOp::Max)
                    .map_err(|e| TchError::Torch(e.to_string()))?;
            }
            core.found_inf = Some(found_inf);
        }
        Ok(())
    }

    /// The learning rate of each parameter group.
    pub fn lrs(&self) -> Vec<f64> {
        self.core().inner.lrs()
    }

    /// Sets the learning rate of each parameter group.
    pub fn set_lrs(&mut self, lrs: &[f64]) {
        self.core().inner.set_lrs(lrs)
    }

    /// The learning rate of the first group.
    pub fn lr(&self) -> f64 {
        self.core().inner.lr()
    }

    /// All parameters.
    pub fn parameters(&self) -> Vec<Tensor> {
        self.core().inner.parameters()
    }

    /// Runs `f` on the wrapped optimizer (for its state, say).
    pub fn with_inner<R>(&self, f: impl FnOnce(&mut dyn Optimizer) -> R) -> R {
        f(self.core().inner.as_mut())
    }

    /// Gives the wrapped optimizer back (Accelerate's unwrapping); `None`
    /// while a prepared scheduler still holds it.
    pub fn into_inner(self) -> Option<Box<dyn Optimizer>> {
        let core = Arc::try_unwrap(self.core).ok()?;
        Some(core.into_inner().unwrap_or_else(|p| p.into_inner()).inner)
    }
}
