//! The process group of FSDP's HYBRID strategies: a model is sharded among
//! the processes of one machine and replicated across machines. Built from
//! two groups split off the world (torch's `DeviceMesh` of
//! `(replicate, shard)`): the shard group (the processes of this machine)
//! and the replica group (the processes holding the same shard on every
//! machine).

use super::{DistError, Pending, ProcessGroup, ReduceOp};
use tch::Tensor;

/// The processes that share this process's shards, with the copies of its
/// shard on other machines. Its rank and size are the shard group's: the
/// collectives run among the processes of this machine, except that a
/// reduce-scatter also combines the result across the replicas (so
/// gradients are averaged over every process) and a broadcast reaches
/// every machine (from replica 0).
pub struct HybridGroup {
    shard: Box<dyn ProcessGroup>,
    replicas: Box<dyn ProcessGroup>,
}

impl HybridGroup {
    /// Joins a shard group and a replica group.
    pub fn new(shard: Box<dyn ProcessGroup>, replicas: Box<dyn ProcessGroup>) -> Self {
        Self { shard, replicas }
    }

    /// Which copy of the shards this process holds (its machine's index).
    pub fn replica_index(&self) -> usize {
        self.replicas.process_index()
    }
}

impl ProcessGroup for HybridGroup {
    fn process_index(&self) -> usize {
        self.shard.process_index()
    }
    fn num_processes(&self) -> usize {
        self.shard.num_processes()
    }
    fn local_process_index(&self) -> usize {
        self.shard.local_process_index()
    }
    fn num_local_processes(&self) -> usize {
        self.shard.num_local_processes()
    }
    fn backend(&self) -> &'static str {
        self.shard.backend()
    }
    /// Among the shard group only: what sharding all-reduces (the squared
    /// norms of the shards, overflow flags) is the same on every replica.
    fn all_reduce_start(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending<'_>, DistError> {
        self.shard.all_reduce_start(tensor, op)
    }
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        self.reduce_scatter_start(tensor, op)?.wait()
    }
    /// The shard group's reduce-scatter, then its result combined with `op`
    /// across the replicas.
    fn reduce_scatter_start(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending<'_>, DistError> {
        let scattered = self.shard.reduce_scatter_start(tensor, op)?;
        let replicas = self.replicas.as_ref();
        Ok(Pending::new(move || {
            let mut part = scattered.wait()?;
            replicas.all_reduce(&mut part, op)?;
            Ok(part)
        }))
    }
    fn all_gather_into(&self, tensor: &Tensor) -> Result<Tensor, DistError> {
        self.shard.all_gather_into(tensor)
    }
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, DistError> {
        self.shard.all_gather(tensor)
    }
    /// `root` of the shard group on replica 0 to every process.
    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), DistError> {
        self.shard.broadcast(tensor, root)?;
        self.replicas.broadcast(tensor, 0)
    }
    fn duplicate(&self) -> Result<Box<dyn ProcessGroup>, DistError> {
        Ok(Box::new(Self {
            shard: self.shard.duplicate()?,
            replicas: self.replicas.duplicate()?,
        }))
    }
    fn split(&self, _: usize, _: usize) -> Result<Box<dyn ProcessGroup>, DistError> {
        Err(DistError::Unsupported {
            op: "split",
            backend: self.backend(),
            message: "a hybrid group is split already; split the world".into(),
        })
    }
    fn barrier(&self) -> Result<(), DistError> {
        self.shard.barrier()?;
        self.replicas.barrier()
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        self.shard.all_gather_bytes(bytes)
    }
    fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>, DistError> {
        let bytes = self.shard.broadcast_bytes(bytes, root)?;
        self.replicas.broadcast_bytes(bytes, 0)
    }
}
