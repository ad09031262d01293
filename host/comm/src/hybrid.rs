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

    /// Splits `world` by machine (`machine` is this process's machine's
    /// name): each machine's processes share the shards, and the processes
    /// of the same rank on every machine hold the same shard. Returns the
    /// group and every process's (machine index, rank on its machine).
    /// Every machine must run as many processes.
    pub fn by_machine(
        world: &dyn ProcessGroup,
        machine: &str,
    ) -> Result<(Self, Vec<(usize, usize)>), DistError> {
        let names = world.all_gather_bytes(machine.as_bytes())?;
        let mut machines: Vec<&[u8]> = Vec::new();
        let mut places: Vec<(usize, usize)> = Vec::with_capacity(names.len());
        for name in &names {
            let m = match machines.iter().position(|m| *m == name.as_slice()) {
                Some(m) => m,
                None => {
                    machines.push(name);
                    machines.len() - 1
                }
            };
            let index = places.iter().filter(|(n, _)| *n == m).count();
            places.push((m, index));
        }
        let count = |m: usize| places.iter().filter(|(n, _)| *n == m).count();
        if let Some(m) = (1..machines.len()).find(|&m| count(m) != count(0)) {
            return Err(DistError::Mismatch {
                op: "hybrid sharding",
                rank: world.process_index(),
                message: format!(
                    "every machine must run as many processes; machine `{}` runs {}, `{}` {} \
                     (machines are told apart by HEARTH_NODE_NAME or the host name)",
                    String::from_utf8_lossy(machines[0]),
                    count(0),
                    String::from_utf8_lossy(machines[m]),
                    count(m)
                ),
            });
        }
        let me = world.process_index();
        let (m, index) = places[me];
        let shard = world.split(m, me)?;
        let replicas = world.split(index, me)?;
        Ok((Self::new(shard, replicas), places))
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
    fn all_gather_into_start(&self, tensor: &Tensor) -> Result<Pending<'_>, DistError> {
        self.shard.all_gather_into_start(tensor)
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
