//! `GradientState`: what the accelerator, the prepared optimizer, scheduler
//! and data loader share about gradient accumulation (Accelerate's
//! singleton of the same name, here a cheap handle each of them holds).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// Shared accumulation state; clones see the same values.
#[derive(Debug, Clone)]
pub struct GradientState(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    num_steps: usize,
    step: AtomicUsize,
    sync_gradients: AtomicBool,
    end_of_dataloader: AtomicBool,
    /// The loader's remainder, `usize::MAX` for none.
    remainder: AtomicUsize,
}

impl GradientState {
    /// A state that accumulates over `num_steps` micro-batches (≥ 1).
    pub fn new(num_steps: usize) -> Self {
        Self(Arc::new(Inner {
            num_steps: num_steps.max(1),
            step: AtomicUsize::new(0),
            sync_gradients: AtomicBool::new(true),
            end_of_dataloader: AtomicBool::new(false),
            remainder: AtomicUsize::new(usize::MAX),
        }))
    }

    /// Micro-batches per optimizer step.
    pub fn num_steps(&self) -> usize {
        self.0.num_steps
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

    /// Accelerate's `_do_sync`: the end of the data loader always syncs
    /// (and restarts the count), else every `num_steps`-th micro-batch does.
    pub(crate) fn advance(&self) {
        let sync = if self.end_of_dataloader() {
            self.0.step.store(0, Relaxed);
            true
        } else {
            let step = self.0.step.fetch_add(1, Relaxed) + 1;
            step % self.0.num_steps == 0
        };
        self.set_sync_gradients(sync);
    }
}
