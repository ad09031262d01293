//! `PreparedDataLoader`: a data loader sharded for this process that tells
//! the gradient state when its epoch ends and puts batches on the device.

use super::{GradientState, TensorTree};
use crate::data::{BatchSource, Batches, DataLoader, LoaderState};
use tch::Device;

/// A data loader prepared by the accelerator (Accelerate's
/// `DataLoaderShard`): it reads this process's share of each epoch, moves
/// each batch to the device, and marks the last batch of an epoch so that
/// accumulation syncs there.
pub struct PreparedDataLoader<S> {
    inner: DataLoader<S>,
    state: GradientState,
    device: Device,
}

impl<S: BatchSource> PreparedDataLoader<S>
where
    S::Item: TensorTree,
{
    pub(super) fn new(inner: DataLoader<S>, state: GradientState, device: Device) -> Self {
        Self {
            inner,
            state,
            device,
        }
    }

    /// Reads the current epoch (see [`DataLoader::iter`]).
    pub fn iter(&self) -> PreparedBatches<'_, S> {
        self.state.set_end_of_dataloader(false);
        self.state.set_remainder(self.inner.remainder());
        PreparedBatches {
            inner: self.inner.iter(),
            state: self.state.clone(),
            device: self.device,
        }
    }

    /// The wrapped loader (its options, shard and length).
    pub fn inner(&self) -> &DataLoader<S> {
        &self.inner
    }

    /// Where the loader stands, for checkpoints.
    pub fn state(&self) -> LoaderState {
        self.inner.state()
    }

    /// Continues from a saved state.
    pub fn load_state(&self, state: LoaderState) {
        self.inner.load_state(state)
    }

    /// Skips `n` batches at the start of the next epoch read only.
    pub fn skip_first_batches(&self, n: usize) {
        self.inner.skip_first_batches(n)
    }

    /// Gives the wrapped loader back.
    pub fn into_inner(self) -> DataLoader<S> {
        self.inner
    }
}

/// One epoch of a prepared loader. Dropping it (a loop left early) clears
/// the end-of-epoch mark, so later micro-batches accumulate normally.
pub struct PreparedBatches<'a, S: BatchSource> {
    inner: Batches<'a, S>,
    state: GradientState,
    device: Device,
}

impl<S: BatchSource> Iterator for PreparedBatches<'_, S>
where
    S::Item: TensorTree,
{
    type Item = S::Item;
    fn next(&mut self) -> Option<S::Item> {
        match self.inner.next() {
            Some(batch) => {
                self.state.set_end_of_dataloader(self.inner.at_end());
                Some(batch.to_device(self.device))
            }
            None => {
                self.state.set_end_of_dataloader(false);
                None
            }
        }
    }
}

impl<S: BatchSource> Drop for PreparedBatches<'_, S> {
    fn drop(&mut self) {
        self.state.set_end_of_dataloader(false);
    }
}
