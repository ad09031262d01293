//! `AcceleratorBuilder`: the options an `Accelerator` is created with.

use super::Accelerator;
use crate::dist::{ProcessGroup, SingleProcess};
use tch::Device;

/// Builds an [`Accelerator`].
///
/// Defaults: the first CUDA device of this process when one is available,
/// else the CPU; a single-process world.
///
/// ```no_run
/// let acc = hearth::accelerator::Accelerator::builder().cpu(true).build();
/// assert!(acc.is_main_process());
/// ```
#[derive(Default)]
pub struct AcceleratorBuilder {
    cpu: bool,
    device: Option<Device>,
    group: Option<Box<dyn ProcessGroup>>,
}

impl AcceleratorBuilder {
    /// Forces the CPU even when a GPU is available (Accelerate's `cpu=True`).
    pub fn cpu(mut self, cpu: bool) -> Self {
        self.cpu = cpu;
        self
    }

    /// Uses exactly this device (overrides `cpu`).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Runs in this process group (default: a world of one).
    pub fn process_group(mut self, group: Box<dyn ProcessGroup>) -> Self {
        self.group = Some(group);
        self
    }

    /// Creates the accelerator.
    pub fn build(self) -> Accelerator {
        let group = self.group.unwrap_or_else(|| Box::new(SingleProcess));
        let device = match self.device {
            Some(device) => device,
            None if self.cpu => Device::Cpu,
            None if tch::Cuda::is_available() => {
                Device::Cuda(group.local_process_index() % tch::Cuda::device_count() as usize)
            }
            None => Device::Cpu,
        };
        Accelerator::new(device, group)
    }
}
