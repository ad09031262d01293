//! Process groups: who this process is among the processes of a run.
//!
//! Every API in hearth is rank-aware; a single process is a world of size 1.
//! The MPI (CPU) and NCCL (GPU) backends and the launcher join this module.

mod grad_sync;
mod mpi;
mod process_group;
mod single;

pub use grad_sync::{CommHook, DdpOptions, GradientSync, SyncStats};
pub use mpi::MpiGroup;
pub use process_group::{DistError, Pending, ProcessGroup, ReduceOp};
pub use single::SingleProcess;

/// How long a collective waits by default before it gives up (PyTorch's
/// `init_process_group` default, Accelerate's `InitProcessGroupKwargs`).
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1800);

/// The process group this process was started in: MPI when `mpirun`
/// started it (`OMPI_COMM_WORLD_SIZE` is set), else a world of one.
/// torchrun-style variables without `mpirun` are refused: the CPU backend
/// is MPI.
pub fn from_environment(timeout: std::time::Duration) -> Result<Box<dyn ProcessGroup>, DistError> {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return Ok(Box::new(MpiGroup::init(timeout)?));
    }
    match std::env::var("WORLD_SIZE").ok().and_then(|w| w.parse::<usize>().ok()) {
        Some(n) if n > 1 => Err(DistError::Unsupported {
            op: "init",
            backend: "mpi",
            message: format!(
                "WORLD_SIZE={n} is set but this process was not started by mpirun; hearth's CPU backend is MPI: start the job with `mpirun -n {n}`"
            ),
        }),
        _ => Ok(Box::new(SingleProcess)),
    }
}
