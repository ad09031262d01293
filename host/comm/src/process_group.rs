//! The `ProcessGroup` trait every backend implements: who this process is,
//! and the collectives (on CPU tensors for MPI, CUDA tensors for NCCL), each
//! under a timeout.

use std::time::Duration;
use tch::Tensor;

/// How `all_reduce` combines the processes' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean (the sum divided by the number of processes).
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// Why a collective failed.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A collective did not complete in time: another process stopped or hangs.
    #[error("{op} did not complete within {timeout:?} on rank {rank} of {world}: {}; the process group cannot be used any more", lost_ranks(.silent.as_deref()))]
    Timeout {
        /// The collective.
        op: &'static str,
        /// The limit.
        timeout: Duration,
        /// This process.
        rank: usize,
        /// The number of processes.
        world: usize,
        /// The ranks (of the world) that did not answer a roll call after
        /// the timeout, when the backend could call one.
        silent: Option<Vec<usize>>,
    },
    /// A collective asked for after an earlier one of this process timed
    /// out: it fails at once instead of waiting out another timeout.
    #[error("{op} on rank {rank} was not waited for: an earlier collective of this process timed out{}; the process group cannot be used any more", lost_earlier(.silent.as_deref()))]
    Broken {
        /// The collective.
        op: &'static str,
        /// This process.
        rank: usize,
        /// What the earlier timeout's roll call found, if it called one.
        silent: Option<Vec<usize>>,
    },
    /// The backend cannot do this (a dtype, a device, a world it does not serve).
    #[error("{op} on the {backend} backend: {message}")]
    Unsupported {
        /// The collective.
        op: &'static str,
        /// The backend's name.
        backend: &'static str,
        /// What is not supported, and what to do.
        message: String,
    },
    /// The processes could not find each other before their communicator
    /// existed (the rendezvous store).
    #[error("rendezvous at {address}: {message}")]
    Rendezvous {
        /// `host:port` of the store.
        address: String,
        /// What failed, and what to check.
        message: String,
    },
    /// The processes disagree (a tensor of another shape, dtype or size).
    #[error("{op} on rank {rank}: {message}")]
    Mismatch {
        /// The collective.
        op: &'static str,
        /// This process.
        rank: usize,
        /// What differs.
        message: String,
    },
}

/// Set once a collective of this process timed out (any backend).
static BROKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a collective of this process timed out: its process groups
/// cannot be used any more, and the process must stop (a failure it could
/// otherwise go on from, such as a checkpoint, is then not one).
pub fn collectives_broken() -> bool {
    BROKEN.load(std::sync::atomic::Ordering::Relaxed)
}

/// Marks this process's collectives broken (see [`collectives_broken`]).
pub(crate) fn mark_collectives_broken() {
    BROKEN.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// What the earlier timeout's roll call found, after a colon.
fn lost_earlier(silent: Option<&[usize]>) -> String {
    silent.map_or_else(String::new, |s| format!(": {}", lost_ranks(Some(s))))
}

/// Who a timed-out collective waited for, in words.
fn lost_ranks(silent: Option<&[usize]>) -> String {
    match silent {
        None => "another process stopped, hangs or called a different collective".into(),
        Some([]) => "every other process answered a roll call afterwards, so one called a different collective or came late".into(),
        Some([rank]) => format!("rank {rank} did not answer (it hangs, or its process is gone)"),
        Some(ranks) => {
            let names: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
            format!("ranks {} did not answer (they hang, or their processes are gone)", names.join(", "))
        }
    }
}

/// A collective under way: [`wait`](Self::wait) finishes it. Dropped
/// without waiting, its buffers are leaked rather than freed under the
/// backend.
#[must_use = "a started collective does nothing useful until waited for"]
pub struct Pending<'g>(Box<dyn FnOnce() -> Result<Tensor, DistError> + 'g>);

impl<'g> Pending<'g> {
    /// A collective that `finish` completes.
    pub fn new(finish: impl FnOnce() -> Result<Tensor, DistError> + 'g) -> Self {
        Self(Box::new(finish))
    }

    /// A collective that already completed with `result`.
    pub fn ready(result: Tensor) -> Self {
        Self::new(move || Ok(result))
    }

    /// Waits for the collective (under the group's timeout) and returns
    /// its result.
    pub fn wait(self) -> Result<Tensor, DistError> {
        (self.0)()
    }
}

/// The processes of one training run and this process's place among them.
///
/// The collectives have world-of-one defaults (what a single process
/// computes), and a backend of more processes overrides them; a group that
/// has more members but no collectives refuses them.
pub trait ProcessGroup: Send {
    /// Index of this process in the world, `0..num_processes()`.
    fn process_index(&self) -> usize;
    /// Number of processes in the world.
    fn num_processes(&self) -> usize;
    /// Index of this process on its machine.
    fn local_process_index(&self) -> usize;
    /// Number of processes on this machine.
    fn num_local_processes(&self) -> usize;
    /// A short name of the backend (`"single"`, `"mpi"`, `"nccl"`).
    fn backend(&self) -> &'static str;

    /// Combines `tensor` across processes with `op`, in place (what
    /// [`all_reduce_start`](Self::all_reduce_start) gives, copied back).
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), DistError> {
        let reduced = self.all_reduce_start(tensor, op)?.wait()?;
        tch::no_grad(|| tensor.copy_(&reduced));
        Ok(())
    }

    /// Starts combining `tensor` across processes with `op` and returns at
    /// once; [`Pending::wait`] gives the result (a new tensor of the same
    /// shape and kind). Started collectives finish in the order they were
    /// started, and every process must start them in the same order.
    /// `tensor` must not change until then: a backend may read it in place
    /// (MPI's does). Work
    /// done between start and wait overlaps the communication where the
    /// backend allows (MPI and NCCL do); the default is a world of one's.
    fn all_reduce_start(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending<'_>, DistError> {
        let _ = op;
        self.only_one("all_reduce")?;
        Ok(Pending::ready(tensor.detach().copy()))
    }

    /// `tensor` combined across processes with `op`, then cut into
    /// `num_processes()` equal chunks along dimension 0: this process gets
    /// the chunk of its index (PyTorch's `reduce_scatter_tensor`). The first
    /// dimension must divide by the number of processes. The default
    /// reduces everything and keeps one chunk; backends override it to move
    /// only their share.
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        let rows = scatter_rows(self, "reduce_scatter", tensor)?;
        let mut all = tensor.detach().copy();
        self.all_reduce(&mut all, op)?;
        Ok(all.narrow(0, rows * self.process_index() as i64, rows))
    }

    /// [`reduce_scatter`](Self::reduce_scatter) started without waiting
    /// (as [`all_reduce_start`](Self::all_reduce_start)); the default
    /// completes it at once.
    fn reduce_scatter_start(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending<'_>, DistError> {
        Ok(Pending::ready(self.reduce_scatter(tensor, op)?))
    }

    /// Every process's `tensor`, which has the same shape and kind on
    /// every process, stacked along a new dimension 0 in rank order
    /// (PyTorch's `all_gather_into_tensor`). Unlike
    /// [`all_gather`](Self::all_gather) nothing is checked first: the
    /// caller guarantees the layout (sharding does, by construction). The
    /// default gathers through `all_gather`.
    fn all_gather_into(&self, tensor: &Tensor) -> Result<Tensor, DistError> {
        let mut shape = vec![self.num_processes() as i64];
        shape.extend(tensor.size());
        Ok(self
            .all_gather(&tensor.reshape([1, -1]))?
            .reshape(shape.as_slice()))
    }

    /// [`all_gather_into`](Self::all_gather_into) started without waiting
    /// (as [`all_reduce_start`](Self::all_reduce_start)): FULL_SHARD's
    /// prefetch. The default completes it at once.
    fn all_gather_into_start(&self, tensor: &Tensor) -> Result<Pending<'_>, DistError> {
        Ok(Pending::ready(self.all_gather_into(tensor)?))
    }

    /// Every process's `tensor` concatenated along dimension 0, in rank
    /// order; the sizes along dimension 0 may differ between processes,
    /// the other dimensions may not.
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, DistError> {
        self.only_one("all_gather")?;
        Ok(tensor.shallow_clone())
    }

    /// Overwrites `tensor` with `root`'s.
    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), DistError> {
        let _ = (tensor, root);
        self.only_one("broadcast")
    }

    /// A group of the same processes with a channel of its own, so that
    /// its collectives never interleave with this group's (torch's
    /// `new_group` over every rank; a loader that dispatches batches
    /// uses one). Every process must call it at the same point.
    fn duplicate(&self) -> Result<Box<dyn ProcessGroup>, DistError> {
        self.only_one("duplicate")?;
        Ok(Box::new(super::SingleProcess))
    }

    /// The processes that passed the same `color`, as a group of their
    /// own, ranked by `key` (MPI's `MPI_Comm_split`, torch's
    /// `new_subgroups_by_enumeration`). Every process must call it at the
    /// same point.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn ProcessGroup>, DistError> {
        let _ = (color, key);
        self.only_one("split")?;
        Ok(Box::new(super::SingleProcess))
    }

    /// Returns once every process has called it.
    fn barrier(&self) -> Result<(), DistError> {
        self.only_one("barrier")
    }

    /// Every process's `bytes`, in rank order (objects, serialised).
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        self.only_one("all_gather_bytes")?;
        Ok(vec![bytes.to_vec()])
    }

    /// `root`'s `bytes`, on every process.
    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>, DistError> {
        let _ = root;
        self.only_one("broadcast_bytes")?;
        Ok(bytes)
    }

    /// `Ok` in a world of one; a backend of more processes must override
    /// the collectives.
    #[doc(hidden)]
    fn only_one(&self, op: &'static str) -> Result<(), DistError> {
        if self.num_processes() == 1 {
            Ok(())
        } else {
            Err(DistError::Unsupported {
                op,
                backend: self.backend(),
                message: format!(
                    "this group of {} processes has no collectives",
                    self.num_processes()
                ),
            })
        }
    }
}

/// The rows of each process's chunk when `tensor` is scattered over
/// `group`, or why it cannot be.
pub(crate) fn scatter_rows(
    group: &(impl ProcessGroup + ?Sized),
    op: &'static str,
    tensor: &Tensor,
) -> Result<i64, DistError> {
    let world = group.num_processes() as i64;
    match tensor.size().first() {
        Some(&n) if n % world == 0 => Ok(n / world),
        _ => Err(DistError::Mismatch {
            op,
            rank: group.process_index(),
            message: format!(
                "a tensor of shape {:?} cannot be cut into {world} equal chunks along dimension 0",
                tensor.size()
            ),
        }),
    }
}

/// Checks, together with every other process, that all gather rows of the
/// same dtype and trailing dimensions as `rows` (only the number of rows may
/// differ); otherwise the collective would mix bytes of different layouts.
pub(crate) fn check_gather_rows(
    group: &(impl ProcessGroup + ?Sized),
    rows: &Tensor,
) -> Result<(), DistError> {
    let shape = rows.size();
    let header = format!("{:?} {:?}", rows.kind(), shape.get(1..).unwrap_or(&[]));
    let headers = group.all_gather_bytes(header.as_bytes())?;
    match headers
        .iter()
        .enumerate()
        .find(|(_, h)| h.as_slice() != header.as_bytes())
    {
        Some((r, other)) => Err(DistError::Mismatch {
            op: "all_gather",
            rank: group.process_index(),
            message: format!(
                "this process gathers {header}, rank {r} gathers {} (dtype and all but the first dimension must agree)",
                String::from_utf8_lossy(other)
            ),
        }),
        None => Ok(()),
    }
}
