//! Process groups: who this process is among the processes of a run.
//!
//! Every API in hearth is rank-aware; a single process is a world of size 1.
//! The MPI (CPU) and NCCL (GPU) backends and the launcher join this module.

mod process_group;
mod single;

pub use process_group::ProcessGroup;
pub use single::SingleProcess;
