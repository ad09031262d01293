//! The world of one process.

use super::ProcessGroup;

/// A process group with a single member: rank 0 of 1.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleProcess;

impl ProcessGroup for SingleProcess {
    fn process_index(&self) -> usize {
        0
    }
    fn num_processes(&self) -> usize {
        1
    }
    fn local_process_index(&self) -> usize {
        0
    }
    fn num_local_processes(&self) -> usize {
        1
    }
    fn backend(&self) -> &'static str {
        "single"
    }
}
