//! The collectives of [`NcclGroup`]: each launched on the group's stream
//! after libtorch's work, finished by polling its event against the
//! group's timeout, its tensors kept until the event completed; and the
//! [`ProcessGroup`] methods built on them. The communicator's life (init,
//! state, abort, timeouts) is in `group.rs`.

use super::group::*;
use crate::process_group::{
    check_gather_rows, scatter_rows, DistError, Pending, ProcessGroup, ReduceOp,
};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;
use cudarc::nccl::result as nc;
use cudarc::nccl::sys as ncsys;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// A collective launched on the group's stream: its completion event and
/// the tensors it reads and writes. The tensors are freed only once the
/// event is known to have completed; dropped before that (a timeout, an
/// error, a `Pending` never waited for), they are leaked, so libtorch never
/// reuses memory a running kernel still touches.
struct Launched {
    done: cusys::CUevent,
    /// Whether `done` was recorded after the collective.
    recorded: bool,
    keep: Option<Vec<Tensor>>,
}

impl Drop for Launched {
    fn drop(&mut self) {
        // SAFETY: an event this group created, destroyed once (CUDA defers
        // the release of an event still pending).
        unsafe {
            if let Some(keep) = self.keep.take() {
                if self.recorded && cu::event::query(self.done).is_ok() {
                    drop(keep);
                } else {
                    std::mem::forget(keep);
                }
            }
            let _ = cu::event::destroy(self.done);
        }
    }
}

/// Launching collectives on the group's stream and finishing them.
impl NcclGroup {
    /// `tensor` as a contiguous tensor on this group's device (a CPU
    /// tensor is copied there), or why it cannot be used.
    fn on_device(&self, op: &'static str, tensor: &Tensor) -> Result<Tensor, DistError> {
        if self.aborted.get() {
            return Err(aborted(op));
        }
        let device = Device::Cuda(self.place.device);
        match tensor.device() {
            Device::Cpu => Ok(tensor.detach().to_device(device).contiguous()),
            d if d == device => Ok(tensor.detach().contiguous()),
            d => Err(unsupported(
                op,
                format!("the tensor is on {d:?}, this process's communicator on {device:?}; move it with .to_device(accelerator.device())"),
            )),
        }
    }

    /// Launches `call` on the group's stream after everything libtorch
    /// queued so far, and records its completion; `deadline` bounds the
    /// launch too.
    fn launch(
        &self,
        op: &'static str,
        keep: Vec<Tensor>,
        deadline: Instant,
        call: impl FnOnce(ncsys::cudaStream_t) -> Result<nc::NcclStatus, nc::NcclError>,
    ) -> Result<Launched, DistError> {
        // A timeout on another group (or backend) stops this process too.
        if self.aborted.get() || crate::process_group::collectives_broken() {
            return Err(aborted(op));
        }
        let flags = cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        // SAFETY: handles owned by this group; the events are destroyed
        // once done with (CUDA defers it until they complete).
        unsafe {
            cu::ctx::set_current(self.context).map_err(|e| driver_failed(op, e))?;
            let done = cu::event::create(flags).map_err(|e| driver_failed(op, e))?;
            // From here on an early return leaks `keep` (see Launched).
            let mut launched = Launched {
                done,
                recorded: false,
                keep: Some(keep),
            };
            let ready = cu::event::create(flags).map_err(|e| driver_failed(op, e))?;
            let ordered = cu::event::record(ready, cu::stream::null()).and_then(|()| {
                cu::stream::wait_event(
                    self.stream,
                    ready,
                    cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            });
            let _ = cu::event::destroy(ready);
            ordered.map_err(|e| driver_failed(op, e))?;
            if let Err(e) = call(self.stream as ncsys::cudaStream_t) {
                self.abort();
                return Err(nccl_failed(op, e));
            }
            self.settle(op, deadline)?;
            cu::event::record(done, self.stream).map_err(|e| driver_failed(op, e))?;
            launched.recorded = true;
            Ok(launched)
        }
    }

    /// Polls `launched` until it completed, an NCCL error, an abort, or
    /// `deadline`.
    fn finish(
        &self,
        op: &'static str,
        mut launched: Launched,
        deadline: Instant,
    ) -> Result<(), DistError> {
        let busy_until = Instant::now() + Duration::from_millis(50);
        let mut pause = Duration::from_micros(5);
        loop {
            // SAFETY: an event this group created.
            match unsafe { cu::event::query(launched.done) } {
                Ok(()) => break,
                Err(cu::DriverError(cusys::CUresult::CUDA_ERROR_NOT_READY)) => {}
                Err(e) => return Err(driver_failed(op, e)),
            }
            self.in_progress(op)?;
            if Instant::now() >= deadline {
                return Err(self.timed_out(op));
            }
            if Instant::now() < busy_until {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
        // Completed: the tensors may go (dropping `launched` frees them).
        if self.aborted.get() {
            // Kernels an abort stopped early completed with partial data.
            return Err(aborted(op));
        }
        drop(launched.keep.take());
        Ok(())
    }

    fn run(
        &self,
        op: &'static str,
        keep: Vec<Tensor>,
        call: impl FnOnce(ncsys::cudaStream_t) -> Result<nc::NcclStatus, nc::NcclError>,
    ) -> Result<(), DistError> {
        let deadline = Instant::now() + self.timeout;
        let launched = self.launch(op, keep, deadline, call)?;
        self.finish(op, launched, deadline)
    }

    fn kind_of(&self, op: &'static str, kind: Kind) -> Result<ncsys::ncclDataType_t, DistError> {
        nccl_type(kind).ok_or_else(|| {
            unsupported(
                op,
                format!("NCCL has no {kind:?} type; convert the tensor to float32"),
            )
        })
    }

    /// Every process's `tensor` (all the same shape), stacked along
    /// dimension 0 in rank order.
    fn gather_equal(&self, op: &'static str, tensor: &Tensor) -> Result<Tensor, DistError> {
        let deadline = Instant::now() + self.timeout;
        let (launched, recv) = self.start_gather(op, tensor, deadline)?;
        self.finish(op, launched, deadline)?;
        Ok(recv)
    }

    /// Launches [`gather_equal`](Self::gather_equal)'s all-gather on the
    /// group's stream; returns it and the tensor it fills.
    fn start_gather(
        &self,
        op: &'static str,
        tensor: &Tensor,
        deadline: Instant,
    ) -> Result<(Launched, Tensor), DistError> {
        let send = self.on_device(op, tensor)?;
        let send = if send.dim() == 0 {
            send.view([1])
        } else {
            send
        };
        let dtype = self.kind_of(op, send.kind())?;
        let mut shape = send.size();
        shape[0] *= self.place.world_size as i64;
        let recv = Tensor::empty(shape.as_slice(), (send.kind(), send.device()));
        let count = send.numel();
        let (s, r) = (send.data_ptr(), recv.data_ptr());
        let comm = self.comm;
        let launched = self.launch(
            op,
            vec![send, recv.shallow_clone()],
            deadline,
            |stream| unsafe { nc::all_gather(s, r, count, dtype, comm, stream) },
        )?;
        Ok((launched, recv))
    }

    /// `tensor` on every process as `root` has it.
    fn broadcast_device(
        &self,
        op: &'static str,
        tensor: &Tensor,
        root: usize,
    ) -> Result<Tensor, DistError> {
        if root >= self.place.world_size {
            return Err(unsupported(
                op,
                format!(
                    "root {root} is not a rank of this world of {}",
                    self.place.world_size
                ),
            ));
        }
        let buffer = self.on_device(op, tensor)?.copy();
        let dtype = self.kind_of(op, buffer.kind())?;
        let (count, ptr, comm) = (buffer.numel(), buffer.data_ptr(), self.comm);
        self.run(op, vec![buffer.shallow_clone()], |stream| unsafe {
            nc::broadcast(ptr, ptr, count, dtype, root as i32, comm, stream)
        })?;
        Ok(buffer)
    }

    /// Starts a reduction of `tensor` (all-reduce, or with `scatter` a
    /// reduce-scatter), returning the launched work and its output.
    fn start_reduction(
        &self,
        op_name: &'static str,
        tensor: &Tensor,
        op: ReduceOp,
        scatter: bool,
        deadline: Instant,
    ) -> Result<(Launched, Tensor), DistError> {
        let send = self.on_device(op_name, tensor)?;
        let dtype = self.kind_of(op_name, send.kind())?;
        let red = nccl_op(op, send.kind()).ok_or_else(|| {
            unsupported(
                op_name,
                format!(
                    "{op:?} of a {:?} tensor is not supported; convert it to float32",
                    send.kind()
                ),
            )
        })?;
        let mut shape = send.size();
        if scatter {
            shape[0] /= self.place.world_size as i64;
        }
        let recv = Tensor::empty(shape.as_slice(), (send.kind(), send.device()));
        let (s, r, comm) = (send.data_ptr(), recv.data_ptr(), self.comm);
        let count = recv.numel();
        let launched = self.launch(
            op_name,
            vec![send, recv.shallow_clone()],
            deadline,
            |stream| unsafe {
                if scatter {
                    nc::reduce_scatter(s, r, count, dtype, red, comm, stream)
                } else {
                    nc::all_reduce(s, r, count, dtype, red, comm, stream)
                }
            },
        )?;
        Ok((launched, recv))
    }
}

/// The result on the device the input came from.
fn back_to(result: Tensor, like: &Tensor) -> Tensor {
    if like.device() == result.device() {
        result
    } else {
        result.to_device(like.device())
    }
}

impl ProcessGroup for NcclGroup {
    fn process_index(&self) -> usize {
        self.place.rank
    }
    fn num_processes(&self) -> usize {
        self.place.world_size
    }
    fn local_process_index(&self) -> usize {
        self.place.local_rank
    }
    fn num_local_processes(&self) -> usize {
        self.place.local_world_size
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce_start(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending<'_>, DistError> {
        let deadline = Instant::now() + self.timeout;
        let (launched, out) = self.start_reduction("all_reduce", tensor, op, false, deadline)?;
        let like = tensor.shallow_clone();
        Ok(Pending::new(move || {
            self.finish("all_reduce", launched, deadline)?;
            Ok(back_to(out, &like))
        }))
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        scatter_rows(self, "reduce_scatter", tensor)?;
        let deadline = Instant::now() + self.timeout;
        let (launched, out) = self.start_reduction("reduce_scatter", tensor, op, true, deadline)?;
        self.finish("reduce_scatter", launched, deadline)?;
        Ok(back_to(out, tensor))
    }

    fn reduce_scatter_start(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending<'_>, DistError> {
        scatter_rows(self, "reduce_scatter", tensor)?;
        let deadline = Instant::now() + self.timeout;
        let (launched, out) = self.start_reduction("reduce_scatter", tensor, op, true, deadline)?;
        let like = tensor.shallow_clone();
        Ok(Pending::new(move || {
            self.finish("reduce_scatter", launched, deadline)?;
            Ok(back_to(out, &like))
        }))
    }

    fn all_gather_into(&self, tensor: &Tensor) -> Result<Tensor, DistError> {
        self.all_gather_into_start(tensor)?.wait()
    }

    fn all_gather_into_start(&self, tensor: &Tensor) -> Result<Pending<'_>, DistError> {
        let mut shape = vec![self.place.world_size as i64];
        shape.extend(tensor.size());
        let deadline = Instant::now() + self.timeout;
        let (launched, all) =
            self.start_gather("all_gather", &tensor.reshape([1, -1]), deadline)?;
        let like = tensor.shallow_clone();
        Ok(Pending::new(move || {
            self.finish("all_gather", launched, deadline)?;
            Ok(back_to(all.reshape(shape.as_slice()), &like))
        }))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, DistError> {
        let rows = if tensor.dim() == 0 {
            tensor.view([1])
        } else {
            tensor.shallow_clone()
        };
        let shape = rows.size();
        check_gather_rows(self, &rows)?;
        let counts = self.gather_equal("all_gather", &Tensor::from_slice(&[shape[0]]))?;
        let counts = Vec::<i64>::try_from(counts.to_device(Device::Cpu)).expect("int64 counts");
        let longest = counts.iter().copied().max().unwrap_or(0);
        let mut padded_shape = shape.clone();
        padded_shape[0] = longest;
        let padded = if shape[0] == longest {
            rows
        } else {
            let p = Tensor::zeros(padded_shape.as_slice(), (rows.kind(), rows.device()));
            tch::no_grad(|| p.narrow(0, 0, shape[0]).copy_(&rows));
            p
        };
        let all = self.gather_equal("all_gather", &padded)?;
        let parts: Vec<Tensor> = counts
            .iter()
            .enumerate()
            .map(|(r, &n)| all.narrow(0, r as i64 * longest, n))
            .collect();
        Ok(back_to(Tensor::cat(&parts, 0), tensor))
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), DistError> {
        // Every process must hold the same kind and size as the root, or
        // NCCL would wait for bytes that never come: check first, together.
        let mine = format!("{:?} {:?}", tensor.kind(), tensor.size());
        let roots = self.broadcast_bytes(mine.clone().into_bytes(), root)?;
        let differs = i64::from(roots != mine.as_bytes());
        let mut any = Tensor::from_slice(&[differs]);
        self.all_reduce(&mut any, ReduceOp::Max)?;
        if any.int64_value(&[0]) != 0 {
            return Err(DistError::Mismatch {
                op: "broadcast",
                rank: self.place.rank,
                message: format!(
                    "rank {root} broadcasts {}, this process holds {mine} (some process's tensor differs)",
                    String::from_utf8_lossy(&roots)
                ),
            });
        }
        let value = self.broadcast_device("broadcast", tensor, root)?;
        tch::no_grad(|| tensor.copy_(&value));
        Ok(())
    }

    fn duplicate(&self) -> Result<Box<dyn ProcessGroup>, DistError> {
        // A new communicator whose unique id travels over this one.
        let share = |id: Option<Vec<u8>>| self.broadcast_bytes(id.unwrap_or_default(), 0);
        let everyone: Vec<usize> = (0..self.place.world_size).collect();
        let group = NcclGroup::init(self.place, self.timeout, share)?;
        Ok(Box::new(group.made_from(self, &everyone)))
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn ProcessGroup>, DistError> {
        // Who shares this process's color, in key order; the first of them
        // makes the new communicator's unique id, which travels over this one.
        let mine = serde_json::to_vec(&(color, key, self.place.rank)).expect("numbers serialise");
        let mut members: Vec<(usize, usize, usize)> = Vec::new();
        for bytes in self.all_gather_bytes(&mine)? {
            let member: (usize, usize, usize) =
                serde_json::from_slice(&bytes).map_err(|e| DistError::Mismatch {
                    op: "split",
                    rank: self.place.rank,
                    message: format!("a process sent an unreadable color: {e}"),
                })?;
            if member.0 == color {
                members.push(member);
            }
        }
        members.sort_by_key(|&(_, key, rank)| (key, rank));
        let rank = members
            .iter()
            .position(|m| m.2 == self.place.rank)
            .expect("this process is among its color");
        let leader = members[0].2;
        let place = NcclPlace {
            rank,
            world_size: members.len(),
            ..self.place
        };
        let share = |id: Option<Vec<u8>>| {
            let ids = self.all_gather_bytes(&id.unwrap_or_default())?;
            Ok(ids[leader].clone())
        };
        let parent_ranks: Vec<usize> = members.iter().map(|m| m.2).collect();
        let group = NcclGroup::init(place, self.timeout, share)?;
        Ok(Box::new(group.made_from(self, &parent_ranks)))
    }

    fn barrier(&self) -> Result<(), DistError> {
        let mut one = Tensor::ones([1], (Kind::Float, Device::Cuda(self.place.device)));
        self.all_reduce(&mut one, ReduceOp::Sum)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let op = "all_gather_bytes";
        let lengths = self.gather_equal(op, &Tensor::from_slice(&[bytes.len() as i64]))?;
        let lengths = Vec::<i64>::try_from(lengths.to_device(Device::Cpu)).expect("int64 lengths");
        let longest = lengths.iter().copied().max().unwrap_or(0).max(1) as usize;
        let mut mine = bytes.to_vec();
        mine.resize(longest, 0);
        let all = self.gather_equal(op, &Tensor::from_slice(&mine))?;
        let all = Vec::<u8>::try_from(all.to_device(Device::Cpu)).expect("uint8 bytes");
        Ok(lengths
            .iter()
            .enumerate()
            .map(|(r, &n)| all[r * longest..r * longest + n as usize].to_vec())
            .collect())
    }

    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>, DistError> {
        let op = "broadcast_bytes";
        let length = self.broadcast_device(op, &Tensor::from_slice(&[bytes.len() as i64]), root)?;
        let length = length.to_device(Device::Cpu).int64_value(&[0]) as usize;
        let mut data = bytes;
        data.resize(length.max(1), 0);
        let got = self.broadcast_device(op, &Tensor::from_slice(&data), root)?;
        let mut got = Vec::<u8>::try_from(got.to_device(Device::Cpu)).expect("uint8 bytes");
        got.truncate(length);
        Ok(got)
    }
}
