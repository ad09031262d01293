//! Several real processes under `mpirun` (Open MPI, installed by `make
//! setup`): this test binary starts itself as the ranks, each running a
//! child test (`child_*`) told its mode, and the parent test checks what
//! they wrote or printed.

use hearth_testkit as common;
use tch::Tensor;

/// The collectives and the failures of ranks.
mod collectives;
/// DDP against one process.
mod ddp;
/// DistributedDataParallelKwargs checked against PyTorch's DDP.
mod ddp_kwargs;
/// `join_uneven_inputs` checked against PyTorch's `Join`.
mod join;
/// Saving and resuming on several pretend machines.
mod machines;
/// A checkpoint of fewer processes loaded on more.
mod more_processes;
/// Accelerate's process helpers.
mod process_helpers;

/// A tensor's values as float64.
pub(crate) fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(tch::Kind::Double).view([-1])).unwrap()
}

/// The numbers `0..n` as a stream (an iterable dataset).
pub(crate) struct Count(pub(crate) i64);

impl hearth::data::IterableDataset for Count {
    type Item = Tensor;
    fn stream(&self, _: u64) -> Box<dyn Iterator<Item = Tensor> + '_> {
        Box::new((0..self.0).map(Tensor::from))
    }
}
