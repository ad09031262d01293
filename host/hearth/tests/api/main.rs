//! The Accelerator API in one process: prepare, backward, accumulation,
//! precision, the process helpers and kwargs handlers against Accelerate's
//! own values, and training steps against PyTorch's.

mod accelerator;
mod accumulation;
mod data_loading;
mod frozen;
mod fused_graph;
mod precision;
mod profiling;
mod pytorch_parity;
mod trackers;
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

/// SGD with `lr` and `momentum`, nothing else.
pub(crate) fn sgd(lr: f64, momentum: f64) -> hearth::ops::SgdHyper {
    hearth::ops::SgdHyper {
        lr,
        momentum,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    }
}

/// PyTorch's `LambdaLR` with `1 - step / total` (floored at 0).
pub(crate) struct Linear {
    base: f64,
    total: f64,
}

/// A `Linear` schedule from `base` to zero over 10 steps, boxed for `prepare`.
pub(crate) fn linear_schedule(base: f64) -> Box<dyn hearth::accelerator::LrSchedule> {
    Box::new(Linear { base, total: 10.0 })
}

impl hearth::accelerator::LrSchedule for Linear {
    fn lrs(&mut self, step: u64) -> Result<Vec<f64>, hearth::plugins::PluginError> {
        Ok(vec![self.base * (1.0 - step as f64 / self.total).max(0.0)])
    }
}

/// Examples 0..n, one scalar tensor each.
pub(crate) fn ids(n: i64) -> Vec<tch::Tensor> {
    (0..n).map(tch::Tensor::from).collect()
}

/// A batch's values.
pub(crate) fn values(batch: &tch::Tensor) -> Vec<i64> {
    Vec::try_from(batch).unwrap()
}

/// A place in a world of 4 processes on 2 machines, without collectives.
pub(crate) struct Place {
    pub(crate) rank: usize,
}

impl hearth::comm::ProcessGroup for Place {
    fn process_index(&self) -> usize {
        self.rank
    }
    fn num_processes(&self) -> usize {
        4
    }
    fn local_process_index(&self) -> usize {
        self.rank % 2
    }
    fn num_local_processes(&self) -> usize {
        2
    }
    fn backend(&self) -> &'static str {
        "test"
    }
}
