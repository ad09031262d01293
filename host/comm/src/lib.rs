//! hearth's communication layer: who this process is among the processes
//! of a run, and how they talk.
//!
//! Every API in hearth is rank-aware; a single process is a world of size 1.
//! Backends: MPI (CPU tensors) and, with the `cuda` feature, NCCL (CUDA
//! tensors); the rendezvous store; which launcher started this process and
//! what it told it ([`LaunchEnv`], [`launch_id`]); what this machine and
//! build offer ([`environment`]). The strategies that use these groups
//! (DDP, sharding) are in `hearth::parallel`; `hearth launch` is in
//! `hearth::launch`.
#![warn(missing_docs)]

pub mod environment;
mod hybrid;
mod init_method;
mod join;
mod launch_env;
mod mpi;
#[cfg(feature = "cuda")]
mod nccl;
mod process_group;
mod roll_call;
mod single;
mod store;

pub use hybrid::HybridGroup;
pub use init_method::InitMethod;
pub use join::{choose_backend, from_environment, Backend, DistributedType, Join, NCCL_BUILT};
pub use launch_env::{
    launch_id, restart_count, LaunchEnv, LaunchEnvError, Launcher, LAUNCH_ID_VAR, RESTART_COUNT_VAR,
};
pub use mpi::MpiGroup;
#[cfg(feature = "cuda")]
pub use nccl::{nccl_unavailable, NcclGroup, NcclPlace};
pub use process_group::{collectives_broken, DistError, Pending, ProcessGroup, ReduceOp};
pub use single::SingleProcess;
pub use store::{new_job_token, store_port, TcpStore, JOB_TOKEN_VAR};

/// How long a collective waits by default before it gives up: PyTorch's
/// `init_process_group` default for its CPU backends (Accelerate's
/// `InitProcessGroupKwargs` leaves it to PyTorch).
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1800);

/// The default for NCCL, as PyTorch's since 2.2 (10 minutes).
pub const DEFAULT_NCCL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);
