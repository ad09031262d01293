//! The MPI group itself: joining MPI, polling a non-blocking collective
//! against the timeout, the roll call after one timed out, and the
//! reductions MPI lacks (16-bit sums).

use crate::process_group::{DistError, Pending, ReduceOp};
use crate::roll_call::{self, RollCall};
use mpi::collective::{Operation, SystemOperation, UserOperation};
use mpi::datatype::Equivalence;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// The tag of the roll call after a timed-out collective.
const ROLL_CALL_TAG: i32 = 0x4845;

/// A world of processes joined by MPI.
pub struct MpiGroup {
    /// MPI's world, or a duplicate of it (freed on drop unless MPI was
    /// finalised first).
    pub(super) world: std::mem::ManuallyDrop<SimpleCommunicator>,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) local_rank: usize,
    pub(super) local_size: usize,
    pub(super) timeout: Duration,
    /// Sums of IEEE half and bfloat16 values (MPI has neither type), so
    /// 16-bit gradients cross the wire at 16 bits. Leaked: MPI operations
    /// must not be freed after MPI is finalised, and there are two per process.
    pub(super) sum_f16: &'static UserOperation<'static>,
    pub(super) sum_bf16: &'static UserOperation<'static>,
    // Last: MPI is finalised when the universe drops, after the
    // communicators. Duplicates hold none.
    pub(super) _universe: Option<mpi::environment::Universe>,
}

/// Over MPI's own point-to-point messages (also NCCL's roll call when NCCL
/// was joined through MPI, whose world is otherwise idle).
impl RollCall for MpiGroup {
    /// After a collective timed out, which ranks are lost: each process
    /// sends every other in the group one byte (every process still alive
    /// there times out too, within about a step of the others) and waits
    /// `window` for theirs. Those whose byte did not come hang or are
    /// gone; returned as ranks of the world, as the launcher numbers them.
    ///
    /// `peers` are ranks of this group's communicator; as NCCL's rendezvous
    /// the group is MPI's world, whose ranks are the world's.
    fn silent_ranks(&self, window: Duration, peers: &[usize]) -> Vec<usize> {
        let deadline = Instant::now() + window;
        let mut waiting = Vec::new();
        for &peer in peers.iter().filter(|&&p| p != self.rank) {
            let process = self.world.process_at_rank(peer as i32);
            let (send, recv) = (Leaked::new(vec![1u8]), Leaked::new(vec![0u8]));
            // SAFETY: the buffers are leaked (never taken back), and a
            // request not completed by the deadline is forgotten, so MPI
            // never writes into freed memory.
            unsafe {
                std::mem::forget(process.immediate_send_with_tag(
                    StaticScope,
                    &*send.get(),
                    ROLL_CALL_TAG,
                ));
                let request =
                    process.immediate_receive_into_with_tag(StaticScope, recv.get(), ROLL_CALL_TAG);
                waiting.push((peer, request));
            }
        }
        while !waiting.is_empty() && Instant::now() < deadline {
            waiting = waiting
                .into_iter()
                .filter_map(|(peer, request)| request.test().err().map(|r| (peer, r)))
                .collect();
            std::thread::sleep(Duration::from_millis(1));
        }
        waiting
            .into_iter()
            .map(|(peer, request)| {
                std::mem::forget(request);
                self.world_rank(peer)
            })
            .collect()
    }
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        // After a timeout MPI cannot finish the collective, so finalising
        // (which waits for every process) would hang on the lost one.
        if crate::process_group::collectives_broken() {
            // Neither freed nor finalised: the process is ending, and MPI
            // would wait for the process that never came. mpirun sees it
            // end without finalising and stops the job.
            if let Some(universe) = self._universe.take() {
                std::mem::forget(universe);
            }
            return;
        }
        if !mpi::environment::is_finalized() {
            // SAFETY: dropped once, here; freeing MPI's world is a no-op.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.world) };
        }
    }
}

// SAFETY: MPI is initialised with `Threading::Serialized`; a group is owned
// by one accelerator and used through `&self` by one thread at a time
// (`ProcessGroup` is `Send`, not `Sync`), which that level allows.
unsafe impl Send for MpiGroup {}

/// A buffer handed to a non-blocking collective. It is freed only by
/// [`take`](Self::take) once the collective completed; dropped without it
/// (after a timeout) it leaks, so MPI can never write into freed memory.
pub(super) struct Leaked<T>(*mut [T]);

impl<T> Leaked<T> {
    pub(super) fn new(data: Vec<T>) -> Self {
        Self(Box::into_raw(data.into_boxed_slice()))
    }

    /// The buffer, for the collective.
    ///
    /// # Safety
    /// At most one collective at a time uses it, and the reference is not
    /// used after [`take`](Self::take).
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn get(&self) -> &'static mut [T] {
        &mut *self.0
    }

    /// The buffer back.
    ///
    /// # Safety
    /// The collective that used it completed.
    pub(super) unsafe fn take(self) -> Vec<T> {
        Box::from_raw(self.0).into_vec()
    }
}

/// A CPU tensor whose memory a non-blocking collective reads or writes in
/// place (no copy in or out). It is given back only by
/// [`take`](Self::take) once the collective completed; dropped without it
/// (after a timeout) the tensor leaks, so MPI can never write into freed
/// memory.
pub(super) struct HeldTensor(*mut Tensor);

impl HeldTensor {
    /// Holds `tensor` (contiguous, on the CPU).
    pub(super) fn new(tensor: Tensor) -> Self {
        debug_assert!(tensor.is_contiguous() && tensor.device() == Device::Cpu);
        Self(Box::into_raw(Box::new(tensor)))
    }

    /// The tensor's memory as elements of `T` (its own kind's size, or a
    /// kind of the same width read as bits), for the collective.
    ///
    /// # Safety
    /// As [`Leaked::get`]; `T` is a plain type its bytes may be read as.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn get<T>(&self) -> &'static mut [T] {
        let tensor = &*self.0;
        let bytes = tensor.numel() * tensor.kind().elt_size_in_bytes();
        let n = bytes / std::mem::size_of::<T>();
        if n == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(tensor.data_ptr() as *mut T, n)
    }

    /// The tensor back.
    ///
    /// # Safety
    /// The collective that used it completed.
    pub(super) unsafe fn take(self) -> Tensor {
        *Box::from_raw(self.0)
    }
}

impl MpiGroup {
    /// Initialises MPI (once per process) and joins its world; collectives
    /// give up after `timeout`.
    pub fn init(timeout: Duration) -> Result<Self, DistError> {
        let (universe, _) =
            mpi::initialize_with_threading(mpi::Threading::Serialized).ok_or_else(|| {
                DistError::Unsupported {
                    op: "init",
                    backend: "mpi",
                    message: "MPI is already initialised in this process".into(),
                }
            })?;
        let world = universe.world();
        let local = world.split_shared(world.rank());
        Ok(Self {
            rank: world.rank() as usize,
            size: world.size() as usize,
            local_rank: local.rank() as usize,
            local_size: local.size() as usize,
            world: std::mem::ManuallyDrop::new(world),
            timeout,
            sum_f16: Box::leak(Box::new(sum_of_16_bit(|a, b| {
                half::f16::from_f32(
                    half::f16::from_bits(a).to_f32() + half::f16::from_bits(b).to_f32(),
                )
                .to_bits()
            }))),
            sum_bf16: Box::leak(Box::new(sum_of_16_bit(|a, b| {
                half::bf16::from_f32(
                    half::bf16::from_bits(a).to_f32() + half::bf16::from_bits(b).to_f32(),
                )
                .to_bits()
            }))),
            _universe: Some(universe),
        })
    }

    /// Polls `request` until it completes or the timeout passes.
    pub(super) fn finish<D: ?Sized>(
        &self,
        op: &'static str,
        request: Request<'static, D, StaticScope>,
    ) -> Result<(), DistError> {
        self.finish_by(op, request, Instant::now() + self.timeout)
    }

    /// Polls `request` until it completes or `deadline` passes.
    pub(super) fn finish_by<D: ?Sized>(
        &self,
        op: &'static str,
        mut request: Request<'static, D, StaticScope>,
        deadline: Instant,
    ) -> Result<(), DistError> {
        // Open MPI moves a non-blocking collective on only while it is
        // tested: poll busily (yielding the core) for the first 50 ms, then
        // back off to a 1 ms sleep for collectives that wait on a slow rank.
        let busy_until = Instant::now() + Duration::from_millis(50);
        let mut pause = Duration::from_micros(5);
        loop {
            match request.test() {
                Ok(_) => return Ok(()),
                Err(pending) => request = pending,
            }
            // After a timeout (this collective's, on another group, or
            // one that started earlier) no process waits for the rest:
            // waiting out a second timeout would only delay the stop.
            if crate::process_group::collectives_broken() {
                std::mem::forget(request);
                return Err(DistError::Broken {
                    op,
                    rank: self.world_rank(self.rank),
                    silent: roll_call::silent_so_far(),
                });
            }
            if Instant::now() >= deadline {
                // Cannot be cancelled: forget it (its buffers are leaked).
                std::mem::forget(request);
                crate::process_group::mark_collectives_broken();
                // Later timeouts report the first roll call's answer: a
                // second one's bytes could go to the first's receives,
                // still posted.
                let window = roll_call::window(self.timeout);
                let others: Vec<usize> = (0..self.size).collect();
                let silent = roll_call::silent_once(|| self.silent_ranks(window, &others));
                return Err(DistError::Timeout {
                    op,
                    timeout: self.timeout,
                    rank: self.world_rank(self.rank),
                    world: SimpleCommunicator::world().size() as usize,
                    silent: Some(silent),
                });
            }
            if Instant::now() < busy_until {
                std::thread::yield_now();
                continue;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// The world rank of rank `rank` of this group.
    fn world_rank(&self, rank: usize) -> usize {
        let world = SimpleCommunicator::world().group();
        self.world
            .group()
            .translate_rank(rank as i32, &world)
            .map_or(rank, |r| r as usize)
    }

    /// Starts an all-reduce of `values` with `operation` (or, with
    /// `scatter`, a reduce-scatter: this process receives only its equal
    /// share); waiting gives `finish` of the reduced values.
    fn start_reduce<T, O>(
        &self,
        values: Tensor,
        operation: O,
        scatter: bool,
        finish: impl FnOnce(Tensor) -> Tensor + 'static,
    ) -> Pending<'_>
    where
        T: Equivalence + 'static,
        O: Operation + 'static,
    {
        let deadline = Instant::now() + self.timeout;
        let op = if scatter {
            "reduce_scatter"
        } else {
            "all_reduce"
        };
        let n = values.numel() as i64;
        let share = if scatter { n / self.size as i64 } else { n };
        let recv = HeldTensor::new(Tensor::empty([share], (values.kind(), Device::Cpu)));
        let send = HeldTensor::new(values);
        // SAFETY: one collective uses the tensors' memory; they are taken
        // back only after it completed, and leaked if it never does (the
        // request too: dropped unfinished, MPI's request would abort the
        // process).
        let request = unsafe {
            std::mem::ManuallyDrop::new(if scatter {
                self.world.immediate_reduce_scatter_block_into(
                    StaticScope,
                    &*send.get::<T>(),
                    recv.get::<T>(),
                    operation,
                )
            } else {
                self.world.immediate_all_reduce_into(
                    StaticScope,
                    &*send.get::<T>(),
                    recv.get::<T>(),
                    operation,
                )
            })
        };
        Pending::new(move || {
            self.finish_by(op, std::mem::ManuallyDrop::into_inner(request), deadline)?;
            // SAFETY: the collective completed.
            unsafe {
                drop(send.take());
                Ok(finish(recv.take()))
            }
        })
    }

    /// Starts an all-reduce (or with `scatter` a reduce-scatter) of a CPU
    /// tensor of any kind MPI can sum: 16-bit floats travel at 16 bits,
    /// each kind comes back as itself.
    pub(super) fn start_reduction(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
        scatter: bool,
    ) -> Result<Pending<'_>, DistError> {
        let name = if scatter {
            "reduce_scatter"
        } else {
            "all_reduce"
        };
        let cpu = on_cpu(name, tensor)?;
        let (mut shape, kind) = (cpu.size(), cpu.kind());
        if scatter {
            shape[0] /= self.size as i64;
        }
        let flat = cpu.view([-1]);
        let shape_of_share = shape.clone();
        let world = self.size as f64;
        // Each kind comes back as itself, the mean divided after the sum
        // (in place where the sum is already in the kind's own width):
        // float64 in float64, the others in float32.
        let back = move |reduced: Tensor| {
            let mut reduced = reduced.view(shape.as_slice());
            match (op, reduced.kind()) {
                (ReduceOp::Mean, Kind::Double | Kind::Float) if reduced.kind() == kind => {
                    let _ = reduced.g_div_scalar_(world);
                    reduced
                }
                (ReduceOp::Mean, _) => {
                    let wide = if kind == Kind::Double {
                        Kind::Double
                    } else {
                        Kind::Float
                    };
                    (reduced.to_kind(wide) / world).to_kind(kind)
                }
                _ => reduced.to_kind(kind),
            }
        };
        let system = match op {
            ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
            ReduceOp::Min => SystemOperation::min(),
        };
        Ok(match kind {
            Kind::Half | Kind::BFloat16 if matches!(op, ReduceOp::Sum | ReduceOp::Mean) => {
                // 16 bits on the wire, summed by the user operation.
                let sum = if kind == Kind::Half {
                    self.sum_f16
                } else {
                    self.sum_bf16
                };
                self.start_reduce::<u16, _>(
                    flat.view_dtype(Kind::Int16),
                    sum,
                    scatter,
                    move |bits: Tensor| back(bits.view_dtype(kind)),
                )
            }
            Kind::Float if scatter && matches!(op, ReduceOp::Sum | ReduceOp::Mean) => {
                self.ring_reduce_scatter(flat, op, shape_of_share)
            }
            Kind::Float | Kind::Half | Kind::BFloat16 => {
                self.start_reduce::<f32, _>(flat.to_kind(Kind::Float), system, scatter, back)
            }
            Kind::Double => self.start_reduce::<f64, _>(flat, system, scatter, back),
            Kind::Int64 if op != ReduceOp::Mean => {
                self.start_reduce::<i64, _>(flat, system, scatter, back)
            }
            Kind::Int if op != ReduceOp::Mean => {
                self.start_reduce::<i32, _>(flat, system, scatter, back)
            }
            kind => {
                return Err(unsupported(
                    name,
                    format!("{op:?} of a {kind:?} tensor is not supported; convert it to float32"),
                ))
            }
        })
    }

    /// Every process's count (one `u64` each).
    pub(super) fn gather_counts(
        &self,
        op: &'static str,
        count: u64,
    ) -> Result<Vec<u64>, DistError> {
        let send = Leaked::new(vec![count]);
        let recv = Leaked::new(vec![0u64; self.size]);
        // SAFETY: as in start_reduce.
        unsafe {
            let request =
                self.world
                    .immediate_all_gather_into(StaticScope, &*send.get(), recv.get());
            self.finish(op, request)?;
            drop(send.take());
            Ok(recv.take())
        }
    }
}

/// A commutative sum of 16-bit floats stored as bits, element by element.
fn sum_of_16_bit(add: fn(u16, u16) -> u16) -> UserOperation<'static> {
    UserOperation::commutative(move |read, write| {
        let read = read
            .downcast::<u16>()
            .expect("16-bit sums run on u16 buffers");
        let write = write
            .downcast::<u16>()
            .expect("16-bit sums run on u16 buffers");
        for (w, r) in write.iter_mut().zip(read) {
            *w = add(*r, *w);
        }
    })
}

pub(super) fn unsupported(op: &'static str, message: String) -> DistError {
    DistError::Unsupported {
        op,
        backend: "mpi",
        message,
    }
}

/// A contiguous CPU copy of `tensor`, or why the MPI backend cannot take it.
pub(super) fn on_cpu(op: &'static str, tensor: &Tensor) -> Result<Tensor, DistError> {
    if tensor.device() != Device::Cpu {
        return Err(unsupported(
            op,
            format!(
                "the tensor is on {:?}; MPI collectives take CPU tensors (NCCL serves CUDA)",
                tensor.device()
            ),
        ));
    }
    Ok(tensor.detach().contiguous())
}
