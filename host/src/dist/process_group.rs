//! The `ProcessGroup` trait every backend implements.

/// The processes of one training run and this process's place among them.
pub trait ProcessGroup: Send {
    /// Index of this process in the world, `0..num_processes()`.
    fn process_index(&self) -> usize;
    /// Number of processes in the world.
    fn num_processes(&self) -> usize;
    /// Index of this process on its machine.
    fn local_process_index(&self) -> usize;
    /// Number of processes on this machine.
    fn num_local_processes(&self) -> usize;
    /// A short name of the backend (`"single"`, `"mpi"`, `"nccl"`).
    fn backend(&self) -> &'static str;
}
