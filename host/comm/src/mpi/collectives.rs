//! The [`ProcessGroup`] methods of [`MpiGroup`], each a non-blocking MPI
//! collective finished against the group's timeout (`group.rs`).

use super::group::*;
use crate::process_group::{
    check_gather_rows, scatter_rows, DistError, Pending, ProcessGroup, ReduceOp,
};
use mpi::datatype::PartitionMut;
use mpi::request::StaticScope;
use mpi::topology::Communicator;
use mpi::traits::*;
use mpi::Count;
use std::time::Instant;
use tch::Tensor;

impl ProcessGroup for MpiGroup {
    fn process_index(&self) -> usize {
        self.rank
    }
    fn num_processes(&self) -> usize {
        self.size
    }
    fn local_process_index(&self) -> usize {
        self.local_rank
    }
    fn num_local_processes(&self) -> usize {
        self.local_size
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce_start(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending<'_>, DistError> {
        self.start_reduction(tensor, op, false)
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        self.reduce_scatter_start(tensor, op)?.wait()
    }
    fn reduce_scatter_start(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending<'_>, DistError> {
        scatter_rows(self, "reduce_scatter", tensor)?;
        self.start_reduction(tensor, op, true)
    }

    fn all_gather_into(&self, tensor: &Tensor) -> Result<Tensor, DistError> {
        self.all_gather_into_start(tensor)?.wait()
    }

    fn all_gather_into_start(&self, tensor: &Tensor) -> Result<Pending<'_>, DistError> {
        let cpu = on_cpu("all_gather", tensor)?;
        let deadline = Instant::now() + self.timeout;
        let mut shape = vec![self.size as i64];
        shape.extend(cpu.size());
        let recv = HeldTensor::new(Tensor::empty(
            shape.as_slice(),
            (cpu.kind(), tch::Device::Cpu),
        ));
        let send = HeldTensor::new(cpu);
        // SAFETY: as in start_reduce: the tensors are taken back only after
        // the collective completed, when the result is waited for, and
        // leaked with the request if it never is.
        let request = unsafe {
            std::mem::ManuallyDrop::new(self.world.immediate_all_gather_into(
                StaticScope,
                &*send.get::<u8>(),
                recv.get::<u8>(),
            ))
        };
        Ok(Pending::new(move || {
            self.finish_by(
                "all_gather",
                std::mem::ManuallyDrop::into_inner(request),
                deadline,
            )?;
            // SAFETY: the collective completed.
            unsafe {
                drop(send.take());
                Ok(recv.take())
            }
        }))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, DistError> {
        let cpu = on_cpu("all_gather", tensor)?;
        let cpu = if cpu.dim() == 0 { cpu.view([1]) } else { cpu };
        let shape = cpu.size();
        check_gather_rows(self, &cpu)?;
        let bytes = hearth_ops::tensor::tensor_bytes(&cpu).to_vec();
        let parts = self.all_gather_bytes(&bytes)?;
        let row: i64 = shape[1..].iter().product();
        let element = cpu.kind().elt_size_in_bytes();
        let joined: Vec<u8> = parts.concat();
        let rows = (joined.len() / element) as i64 / row.max(1);
        let mut out_shape = shape.clone();
        out_shape[0] = if row == 0 { 0 } else { rows };
        Ok(Tensor::from_data_size(&joined, &out_shape, cpu.kind()))
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), DistError> {
        let cpu = on_cpu("broadcast", tensor)?;
        let bytes = hearth_ops::tensor::tensor_bytes(&cpu).to_vec();
        let expected = bytes.len();
        let got = self.broadcast_bytes(bytes, root)?;
        if got.len() != expected {
            return Err(DistError::Mismatch {
                op: "broadcast",
                rank: self.rank,
                message: format!(
                    "rank {root} sent {} bytes, this tensor has {expected} ({:?} {:?})",
                    got.len(),
                    cpu.kind(),
                    cpu.size()
                ),
            });
        }
        let value = Tensor::from_data_size(&got, &cpu.size(), cpu.kind());
        tch::no_grad(|| tensor.copy_(&value));
        Ok(())
    }

    fn duplicate(&self) -> Result<Box<dyn ProcessGroup>, DistError> {
        Ok(Box::new(Self {
            world: std::mem::ManuallyDrop::new(self.world.duplicate()),
            _universe: None,
            ..*self
        }))
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn ProcessGroup>, DistError> {
        let color = i32::try_from(color)
            .map_err(|_| unsupported("split", format!("color {color} is too large")))?;
        let key = i32::try_from(key)
            .map_err(|_| unsupported("split", format!("key {key} is too large")))?;
        let part = self
            .world
            .split_by_color_with_key(mpi::topology::Color::with_value(color), key)
            .ok_or_else(|| unsupported("split", "MPI gave this process no group".into()))?;
        Ok(Box::new(Self {
            rank: part.rank() as usize,
            size: part.size() as usize,
            world: std::mem::ManuallyDrop::new(part),
            _universe: None,
            ..*self
        }))
    }

    fn barrier(&self) -> Result<(), DistError> {
        let request = self.world.immediate_barrier();
        self.finish("barrier", request)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let counts = self.gather_counts("all_gather_bytes", bytes.len() as u64)?;
        let too_big = |n: &u64| *n > Count::MAX as u64;
        if counts.iter().any(too_big) || counts.iter().sum::<u64>() > isize::MAX as u64 {
            return Err(unsupported(
                "all_gather_bytes",
                format!("a process sends more than {} bytes", Count::MAX),
            ));
        }
        let counts: Vec<Count> = counts.iter().map(|&n| n as Count).collect();
        let displs: Vec<Count> = counts
            .iter()
            .scan(0, |at, &n| {
                let start = *at;
                *at += n;
                Some(start)
            })
            .collect();
        let total: usize = counts.iter().map(|&n| n as usize).sum();
        let send = Leaked::new(bytes.to_vec());
        let recv = Leaked::new(vec![0u8; total]);
        let counts_buf = Leaked::new(counts.clone());
        let displs_buf = Leaked::new(displs.clone());
        // SAFETY: as in start_reduce; the partition only borrows the
        // buffers and is itself leaked with them on a timeout.
        let joined = unsafe {
            let partition = Leaked::new(vec![PartitionMut::new(
                recv.get(),
                &*counts_buf.get(),
                &*displs_buf.get(),
            )]);
            let request = self.world.immediate_all_gather_varcount_into(
                StaticScope,
                &*send.get(),
                &mut partition.get()[0],
            );
            self.finish("all_gather_bytes", request)?;
            drop(partition.take());
            drop(send.take());
            drop(counts_buf.take());
            drop(displs_buf.take());
            recv.take()
        };
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&n, &at)| joined[at as usize..(at + n) as usize].to_vec())
            .collect())
    }

    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>, DistError> {
        if root >= self.size {
            return Err(unsupported(
                "broadcast",
                format!("root {root} is not a rank of this world of {}", self.size),
            ));
        }
        let root_process = self.world.process_at_rank(root as i32);
        let length = Leaked::new(vec![bytes.len() as u64]);
        // SAFETY: as in start_reduce.
        let length = unsafe {
            let request = root_process.immediate_broadcast_into(StaticScope, length.get());
            self.finish("broadcast", request)?;
            length.take()[0] as usize
        };
        let mut data = bytes;
        data.resize(length, 0);
        let buffer = Leaked::new(data);
        // SAFETY: as in start_reduce.
        unsafe {
            let request = root_process.immediate_broadcast_into(StaticScope, buffer.get());
            self.finish("broadcast", request)?;
            Ok(buffer.take())
        }
    }
}
