//! Several processes under mpirun (this binary starts itself as the
//! ranks): collectives, DDP and its kwargs, join, sharding (FSDP/ZeRO)
//! against PyTorch, and checkpoints moved between numbers of processes.

mod fsdp_mixed_precision;
mod mpi;
mod sharding;
