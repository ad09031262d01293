//! The Accelerator API in one process: prepare, backward, accumulation,
//! precision, the process helpers and kwargs handlers against Accelerate's
//! own values, and training steps against PyTorch's.

mod accelerator;
mod profiling;
mod pytorch_parity;
mod unprepared;

/// Tests that seed or draw from libtorch's global generator, or profile, run
/// one at a time (the test harness runs tests on several threads).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}
