//! The NCCL backend (CUDA tensors), built with the `cuda` feature: hearth
//! creates and owns one communicator and one CUDA stream per process, on
//! the device this process trains on. The communicator's unique id reaches
//! the other ranks through the rendezvous store (torchrun's variables,
//! `hearth launch` on GPUs) or through MPI (`mpirun`).
//!
//! Ordering with libtorch: before each collective, the communicator's
//! stream waits for an event recorded on libtorch's default stream (so it
//! sees every tensor written before the call); the result is handed back
//! only once the collective's own event completed, polled against the
//! group's timeout. On a timeout or an NCCL error the communicator is
//! aborted (which frees stuck kernels) and the group refuses further use.
//!
//! CPU tensors are copied to this process's GPU and back, so host-side
//! helpers (triggers, objects, checkpoints) work unchanged.
//!
//! Loading: cudarc looks for `libnccl.so`; the pip NCCL wheel beside torch
//! ships only `libnccl.so.2`, so `build.rs` links a `libnccl.so` to it in
//! a folder on the binaries' rpath. Both the driver and NCCL are probed
//! before first use (cudarc panics when a library is missing).
//!
//! `group.rs` holds the communicator's life (init, state, abort, the
//! timeout and its roll call, drop); `collectives.rs` launches and
//! finishes the collectives and implements `ProcessGroup` with them.

mod collectives;
mod group;

pub use group::{nccl_unavailable, NcclGroup, NcclPlace};
