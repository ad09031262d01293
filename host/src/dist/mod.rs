//! Process groups: who this process is among the processes of a run.
//!
//! Every API in hearth is rank-aware; a single process is a world of size 1.
//! The MPI (CPU) and NCCL (GPU) backends and the launcher join this module.

mod grad_sync;
mod launch_env;
mod launcher;
mod mpi;
mod process_group;
mod single;

pub use grad_sync::{CommHook, DdpOptions, GradientSync, SyncStats};
pub use launch_env::{LaunchEnv, LaunchEnvError, Launcher};
pub use launcher::{launch, LaunchError, LaunchMode, LaunchSpec};
pub use mpi::MpiGroup;
pub use process_group::{DistError, Pending, ProcessGroup, ReduceOp};
pub use single::SingleProcess;

/// How long a collective waits by default before it gives up (PyTorch's
/// `init_process_group` default, Accelerate's `InitProcessGroupKwargs`).
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1800);

/// The process group this process was started in (see [`LaunchEnv`]):
/// MPI when `mpirun` started it, or `srun` started several tasks (Open MPI
/// with PMIx: `srun --mpi=pmix`); a world of one when nothing did.
/// torchrun-style variables naming several processes are refused: their
/// backend is NCCL, not built yet; CPU jobs run under `mpirun`.
pub fn from_environment(timeout: std::time::Duration) -> Result<Box<dyn ProcessGroup>, DistError> {
    let env = LaunchEnv::from_env().map_err(|e| DistError::Unsupported {
        op: "init",
        backend: "launch",
        message: e.to_string(),
    })?;
    // mpirun always means MPI (even -n 1); srun only when it started several tasks.
    let joins_mpi =
        env.launcher == Launcher::Mpirun || (env.launcher == Launcher::Slurm && env.world_size > 1);
    match env.launcher {
        _ if joins_mpi => {
            let group = MpiGroup::init(timeout)?;
            if (group.process_index(), group.num_processes()) != (env.rank, env.world_size) {
                return Err(DistError::Unsupported {
                    op: "init",
                    backend: "mpi",
                    message: format!(
                        "{:?} started this process as rank {} of {}, but MPI sees rank {} of {}; under SLURM start the job with `srun --mpi=pmix` (Open MPI built with PMIx) or with mpirun",
                        env.launcher, env.rank, env.world_size, group.process_index(), group.num_processes()
                    ),
                });
            }
            Ok(Box::new(group))
        }
        Launcher::Torchrun if env.world_size > 1 => Err(DistError::Unsupported {
            op: "init",
            backend: "mpi",
            message: format!(
                "WORLD_SIZE={n} is set but this process was not started by mpirun; processes started with torchrun's variables need the NCCL backend (GPU, not built yet), and hearth's CPU backend is MPI: start the job with `hearth launch --cpu -n {n}` or `mpirun -n {n}`",
                n = env.world_size
            ),
        }),
        _ => Ok(Box::new(SingleProcess)),
    }
}
