//! The Accelerator API in one process: prepare, backward, accumulation,
//! precision, the process helpers and kwargs handlers against Accelerate's
//! own values, and training steps against PyTorch's.

mod accelerator;
mod fused_graph;
mod profiling;
mod pytorch_parity;
mod unprepared;

/// Tests that seed or draw from libtorch's global generator, or profile, run
/// one at a time (the test harness runs tests on several threads).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Process `rank` of `n` on one machine, for steps that need no
/// collective (it has none).
struct FakeWorld {
    rank: usize,
    n: usize,
}

impl hearth::comm::ProcessGroup for FakeWorld {
    fn process_index(&self) -> usize {
        self.rank
    }
    fn num_processes(&self) -> usize {
        self.n
    }
    fn local_process_index(&self) -> usize {
        self.rank
    }
    fn num_local_processes(&self) -> usize {
        self.n
    }
    fn backend(&self) -> &'static str {
        "fake"
    }
}
