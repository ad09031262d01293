//! `GradientState`: what the accelerator, the prepared optimizer, scheduler
//! and data loader share about gradient accumulation (Accelerate's
//! singleton of the same name, here a cheap handle each of them holds),
//! and the [`GradientAccumulationPlugin`] it is made from.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// How gradients accumulate (Accelerate's `GradientAccumulationPlugin`,
/// given to [`AcceleratorBuilder::gradient_accumulation_plugin`](super::AcceleratorBuilder::gradient_accumulation_plugin)).
/// `Default` is Accelerate's: one step, the scheduler adjusted, syncing at
/// the end of each data loader, no communication on accumulating batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradientAccumulationPlugin {
    /// Micro-batches per optimizer step (≥ 1).
    pub num_steps: usize,
    /// Accepted for Accelerate's scripts, with Accelerate's effect: none.
    /// Accelerate means it to count the accumulating micro-batches in the
    /// scheduler's `_step_count`, but its `GradientState` reads the flag
    /// through `to_kwargs()`, which leaves out values equal to the default
    /// (`True`), and then defaults a missing flag to `False`: with either
    /// value its schedulers step, and count, once per optimizer step only
    /// (checked against Accelerate 1.15 live). A prepared scheduler here
    /// does the same, so a ported script trains the same rates.
    pub adjust_scheduler: bool,
    /// The last batch of a prepared loader's epoch ends an accumulation
    /// group (and restarts the count). Off: micro-batches are counted across
    /// epochs, and only every `num_steps`-th one syncs.
    pub sync_with_dataloader: bool,
    /// Gradients are averaged between processes on every micro-batch (no
    /// `no_sync`), while the optimizer still steps every `num_steps`: less
    /// memory held by sharded strategies, more communication.
    pub sync_each_batch: bool,
}

impl Default for GradientAccumulationPlugin {
    fn default() -> Self {
        Self {
            num_steps: 1,
            adjust_scheduler: true,
            sync_with_dataloader: true,
            sync_each_batch: false,
        }
    }
}

/// Shared accumulation state; clones see the same values.
#[derive(Debug, Clone)]
pub struct GradientState(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    plugin: GradientAccumulationPlugin,
    step: AtomicUsize,
    sync_gradients: AtomicBool,
    end_of_dataloader: AtomicBool,
    /// The loader's remainder, `usize::MAX` for none.
    remainder: AtomicUsize,
    /// `even_batches` for prepared loaders while `join_uneven_inputs`
    /// overrides it: 0 none, 1 false, 2 true.
    even_batches: std::sync::atomic::AtomicU8,
}

impl GradientState {
    /// A state that accumulates over `num_steps` micro-batches (≥ 1).
    pub fn new(num_steps: usize) -> Self {
        Self::with_plugin(GradientAccumulationPlugin {
            num_steps,
            ..Default::default()
        })
    }

    /// A state that accumulates as `plugin` says.
    pub fn with_plugin(mut plugin: GradientAccumulationPlugin) -> Self {
        plugin.num_steps = plugin.num_steps.max(1);
        Self(Arc::new(Inner {
            plugin,
            step: AtomicUsize::new(0),
            sync_gradients: AtomicBool::new(true),
            end_of_dataloader: AtomicBool::new(false),
            remainder: AtomicUsize::new(usize::MAX),
            even_batches: Default::default(),
        }))
    }

    /// Micro-batches per optimizer step.
    pub fn num_steps(&self) -> usize {
        self.0.plugin.num_steps
    }

    /// The accumulation settings.
    pub fn plugin(&self) -> GradientAccumulationPlugin {
        self.0.plugin
    }

    /// True when this micro-batch ends an accumulation group: gradients are
    /// synchronised and the prepared optimizer and scheduler step.
    pub fn sync_gradients(&self) -> bool {
        self.0.sync_gradients.load(Relaxed)
    }

    /// True while the batch being processed is the last of its epoch.
    pub fn end_of_dataloader(&self) -> bool {
        self.0.end_of_dataloader.load(Relaxed)
    }

    /// Real examples in the last global batch of the loader being read
    /// (see [`DataLoader::remainder`](crate::data::DataLoader::remainder)).
    pub fn remainder(&self) -> Option<usize> {
        Some(self.0.remainder.load(Relaxed)).filter(|&r| r != usize::MAX)
    }

    /// `even_batches` for epochs of prepared loaders begun now, when
    /// `join_uneven_inputs` overrides theirs.
    pub fn even_batches_override(&self) -> Option<bool> {
        match self.0.even_batches.load(Relaxed) {
            0 => None,
            v => Some(v == 2),
        }
    }

    /// Sets the override; returns the one before.
    pub(crate) fn set_even_batches_override(&self, even: Option<bool>) -> Option<bool> {
        let code = even.map_or(0, |e| 1 + u8::from(e));
        match self.0.even_batches.swap(code, Relaxed) {
            0 => None,
            v => Some(v == 2),
        }
    }

    pub(crate) fn set_remainder(&self, remainder: Option<usize>) {
        self.0
            .remainder
            .store(remainder.unwrap_or(usize::MAX), Relaxed);
    }

    pub(crate) fn set_sync_gradients(&self, sync: bool) {
        self.0.sync_gradients.store(sync, Relaxed);
    }

    /// The position inside the current accumulation group (saved with a
    /// checkpoint so a resumed run syncs on the same micro-batches).
    pub fn accumulation_position(&self) -> usize {
        self.0.step.load(Relaxed)
    }

    pub(crate) fn set_accumulation_position(&self, position: usize) {
        self.0.step.store(position, Relaxed);
    }

    pub(crate) fn set_end_of_dataloader(&self, end: bool) {
        self.0.end_of_dataloader.store(end, Relaxed);
    }

    /// Accelerate's `_do_sync`: the end of the data loader syncs (and
    /// restarts the count) unless `sync_with_dataloader` is off, else every
    /// `num_steps`-th micro-batch does.
    pub(crate) fn advance(&self) {
        let sync = if self.0.plugin.sync_with_dataloader && self.end_of_dataloader() {
            self.0.step.store(0, Relaxed);
            true
        } else {
            let step = self.0.step.fetch_add(1, Relaxed) + 1;
            step % self.0.plugin.num_steps == 0
        };
        self.set_sync_gradients(sync);
    }
}
