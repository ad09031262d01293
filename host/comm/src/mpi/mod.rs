//! The MPI backend (Open MPI through the `mpi` crate): the CPU data plane
//! and the multi-node CPU path. Processes started by `mpirun` find their
//! place from MPI itself; the local rank comes from a shared-memory split
//! of the world.
//!
//! Every collective is non-blocking underneath and polled against the
//! group's timeout. MPI cannot cancel a collective, so after a timeout its
//! buffers are leaked (they stay valid for MPI to finish writing into) and
//! the group must not be used again: the caller stops the process.
//!
//! `group.rs` holds the group's life, its polling and roll call;
//! `collectives.rs` implements `ProcessGroup` with them; `ring.rs` is the
//! float32 reduce-scatter MPI's non-blocking one is slower than.

mod collectives;
mod group;
mod ring;

pub use group::MpiGroup;
