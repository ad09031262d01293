//! The `Accelerator` itself.

use super::builder::AcceleratorBuilder;
use super::TrackerHub;
use crate::dist::ProcessGroup;
use crate::plugins::{Entries, RunInfo, TrackerPlugin};
use tch::{Device, Tensor};

/// Owns the device and the process group of a training process.
pub struct Accelerator {
    device: Device,
    group: Box<dyn ProcessGroup>,
    trackers: Option<TrackerHub>,
}

impl Accelerator {
    /// Starts building an accelerator; see [`AcceleratorBuilder`].
    pub fn builder() -> AcceleratorBuilder {
        AcceleratorBuilder::default()
    }

    pub(super) fn new(device: Device, group: Box<dyn ProcessGroup>) -> Self {
        Self {
            device,
            group,
            trackers: None,
        }
    }

    /// The device this process trains on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Index of this process among all processes.
    pub fn process_index(&self) -> usize {
        self.group.process_index()
    }

    /// Number of processes in the run.
    pub fn num_processes(&self) -> usize {
        self.group.num_processes()
    }

    /// Index of this process on its machine.
    pub fn local_process_index(&self) -> usize {
        self.group.local_process_index()
    }

    /// True on the process with index 0 (the one that logs and saves).
    pub fn is_main_process(&self) -> bool {
        self.process_index() == 0
    }

    /// True on the first process of each machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_process_index() == 0
    }

    /// The process group.
    pub fn process_group(&self) -> &dyn ProcessGroup {
        self.group.as_ref()
    }

    /// Prints once per machine (on the local main process), like
    /// `Accelerator.print`.
    pub fn print(&self, message: impl std::fmt::Display) {
        if self.is_local_main_process() {
            println!("{message}");
        }
    }

    /// Seeds libtorch's generators (CPU and every CUDA device); with
    /// `device_specific` each process adds its index so ranks differ.
    pub fn set_seed(&self, seed: u64, device_specific: bool) {
        let seed = if device_specific {
            seed + self.process_index() as u64
        } else {
            seed
        };
        tch::manual_seed(seed as i64);
        if tch::Cuda::is_available() {
            tch::Cuda::manual_seed_all(seed);
        }
    }

    /// Computes gradients of `loss` (Accelerate's `accelerator.backward`).
    pub fn backward(&self, loss: &Tensor) {
        loss.backward();
    }

    /// Clips the total L2 norm of the parameters' gradients to `max_norm` and
    /// returns the norm before clipping; see [`super::clip_grad_norm_`].
    pub fn clip_grad_norm_(
        &self,
        parameters: &[Tensor],
        max_norm: f64,
    ) -> Result<Tensor, tch::TchError> {
        super::clip_grad_norm_(parameters, max_norm)
    }

    /// Starts `trackers` for this run (Accelerate's `init_trackers`): on the
    /// main process they receive the run's `config` now and every
    /// [`log`](Self::log) later; on other processes they are dropped.
    pub fn init_trackers(
        &mut self,
        project: &str,
        run: &str,
        trackers: Vec<TrackerPlugin>,
        config: Entries,
    ) {
        if !self.is_main_process() || trackers.is_empty() {
            return;
        }
        let info = RunInfo {
            project: project.into(),
            run: run.into(),
            process_index: self.process_index() as u32,
            num_processes: self.num_processes() as u32,
        };
        self.trackers = Some(TrackerHub::start(trackers, info, config));
    }

    /// Logs `values` at `step` to every tracker, from the main process only
    /// (Accelerate's `accelerator.log(values, step)`). Never blocks on a tracker.
    pub fn log(&self, values: Entries, step: u64) {
        if let Some(hub) = &self.trackers {
            hub.log(step, values);
        }
    }

    /// Finishes the trackers (Accelerate's `end_training`) and waits for them.
    pub fn end_training(&mut self) {
        if let Some(hub) = self.trackers.take() {
            hub.finish();
        }
    }
}
