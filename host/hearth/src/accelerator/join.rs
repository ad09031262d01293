//! `Accelerator::join_uneven_inputs` (PyTorch's `Join` context with the DDP
//! models as joinables, as Accelerate enters it): processes that run out of
//! batches first keep taking part in the gradient rounds of those still
//! training, with zero gradients, until every process is done.

use super::Accelerator;
use hearth_comm::DistError;

/// Why [`Accelerator::join_uneven_inputs`] failed.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// A prepared model is sharded.
    #[error(
        "join_uneven_inputs: a prepared model is sharded (FSDP), and sharded models cannot \
         join (PyTorch's FSDP is not joinable either): give every process the same number of \
         batches, with even_batches = true (the default) on the prepared loaders"
    )]
    Sharded,
    /// A collective of the join failed (a process stopped, or hung past
    /// the timeout).
    #[error(
        "join_uneven_inputs: waiting for the other processes failed ({0}); a process stopped \
         or hung past the timeout, or `body` ran another collective (gather, reduce, …) a \
         different number of times on some process: run those the same number of times \
         everywhere"
    )]
    Dist(#[from] DistError),
}

impl Accelerator {
    /// Runs `body`, in which processes may run out of batches at different
    /// times (Accelerate's `join_uneven_inputs`; hearth's joinables are
    /// every model prepared for DDP). `even_batches`, when given, replaces
    /// that of the prepared loaders (those not dispatching) for the epochs
    /// begun inside, as Accelerate sets their samplers'; it defaults to the
    /// accelerator's.
    ///
    /// When the batches are uneven (`even_batches` false) and several
    /// processes train, a process whose `body` returns keeps taking part in
    /// the gradient averaging of the others' synchronising backward passes,
    /// with zero gradients (so their means are divided by every process, as
    /// PyTorch's `divide_by_initial_world_size` does), until all are done;
    /// then every process takes the parameters (and broadcast buffers) of
    /// the last to finish. Inside, buffers are not broadcast before forward
    /// passes. Only hearth's gradient averaging is matched: other
    /// collectives in `body` (`gather`, `reduce`, …) must be run the same
    /// number of times on every process.
    ///
    /// Accelerate does this on GPUs only (on CPUs it warns and does
    /// nothing); hearth joins on every backend. In a world of one it just
    /// runs `body`.
    pub fn join_uneven_inputs<R>(
        &self,
        even_batches: Option<bool>,
        body: impl FnOnce() -> R,
    ) -> Result<R, JoinError> {
        let group = self.process_group();
        if group.num_processes() == 1 {
            return Ok(body());
        }
        let uneven = !even_batches.unwrap_or(self.shard().even_batches);
        if uneven && self.data_parallel.shards() {
            return Err(JoinError::Sharded);
        }
        let state = self.gradient_state();
        let before = even_batches.map(|even| state.set_even_batches_override(Some(even)));
        // Restored even if `body` panics.
        struct Restore<'a>(&'a Accelerator, Option<Option<bool>>, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                if let Some(before) = self.1 {
                    self.0.gradient_state().set_even_batches_override(before);
                }
                self.0.data_parallel.set_joining(self.2);
            }
        }
        let was = self.data_parallel.set_joining(uneven);
        let _restore = Restore(self, before, was);
        let out = body();
        if uneven {
            // A model sharded inside `body` has the same units everywhere:
            // every process refuses here alike.
            if self.data_parallel.shards() {
                return Err(JoinError::Sharded);
            }
            self.data_parallel.join(group)?;
        }
        Ok(out)
    }
}
