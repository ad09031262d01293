//! What loading a big model can refuse (`BigModelError`) and the notes it leaves for the user.

use super::MapDevice;
use std::path::PathBuf;

/// What a big-model function said besides its result: Accelerate's
/// warnings and informational messages, word for word, and with `verbose`
/// the steps `infer_auto_device_map` took (Accelerate prints them). Each
/// warning and message is also logged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Notes {
    /// Warnings (Accelerate's `logger.warning` and `warnings.warn`).
    pub warnings: Vec<String>,
    /// Informational messages (Accelerate's `logger.info`).
    pub info: Vec<String>,
    /// With `verbose`: each line Accelerate would print.
    pub steps: Vec<String>,
}

impl Notes {
    pub(crate) fn warn(&mut self, message: String) {
        tracing::warn!("{message}");
        self.warnings.push(message);
    }

    pub(crate) fn info(&mut self, message: String) {
        tracing::info!("{message}");
        self.info.push(message);
    }
}

/// Why a big-model operation could not be done. Each names the thing to
/// fix.
#[derive(Debug, thiserror::Error)]
pub enum BigModelError {
    /// A size that is not `20GiB`, `500MB`, … or a number of bytes.
    #[error("{text:?} is not a size: write a number of bytes or a number with GiB, MiB, KiB (powers of 2) or GB, MB, KB (powers of 10), e.g. 20GiB")]
    BadSize {
        /// The text.
        text: String,
    },
    /// A device name that is neither a GPU index, `cpu` nor `disk`.
    #[error("unknown device `{name}`: devices are GPU indices (0, 1, …), `cpu` and `disk`")]
    UnknownDevice {
        /// The name.
        name: String,
    },
    /// A dtype name that is not one.
    #[error("unknown dtype {text:?}: use float32, float16, bfloat16, float64, float8_e4m3fn, float8_e5m2, int8 or uint8 (or fp32, fp16, bf16)")]
    UnknownDtype {
        /// The text.
        text: String,
    },
    /// A part of `--max-memory` that is not `DEVICE=SIZE`, or a device twice.
    #[error(
        "max_memory: {part:?} is not DEVICE=SIZE with each device once, e.g. 0=20GiB,cpu=64GiB"
    )]
    BadMaxMemory {
        /// The part.
        part: String,
    },
    /// The device that runs offloaded modules cannot hold the largest layer.
    #[error(
        "max_memory cannot run this model: its largest layer `{layer}` ({class}, {size} bytes) is offloaded and must \
         fit on {device} to run, which may hold {room} bytes; give {device} at least {size} bytes, or let {class} \
         split (leave it out of the no-split classes)"
    )]
    LargestLayerDoesNotFit {
        /// The layer's path.
        layer: String,
        /// Its class.
        class: String,
        /// Its bytes.
        size: u64,
        /// The device that would run it.
        device: MapDevice,
        /// What that device may hold.
        room: u64,
    },
    /// Tensors the device map gives no device.
    #[error("the device map gives no device to {}; map them, or one of the modules above them", tensors.join(", "))]
    Uncovered {
        /// The tensors.
        tensors: Vec<String>,
    },
    /// Something wrong with a checkpoint, a file of the offload folder, or
    /// a tensor's shape or dtype.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// A tensor the model does not have.
    #[error("the model has no parameter or buffer `{name}`")]
    NoSuchTensor {
        /// The name.
        name: String,
    },
    /// A device map naming a GPU this machine does not have.
    #[error("the device map sends `{module}` to GPU {index}, but this machine has {available} GPU(s); map it to an existing GPU, cpu or disk")]
    NoSuchGpu {
        /// The module.
        module: String,
        /// The GPU index.
        index: usize,
        /// GPUs present.
        available: usize,
    },
    /// Tied names a device map sends to different devices.
    #[error("tied parameters are one tensor, but the device map splits them: {names}; map their modules to one device")]
    SplitTie {
        /// Each name and its device.
        names: String,
    },
    /// A tensor mapped to the disk that the checkpoint does not hold.
    #[error(
        "{checkpoint}: tensor `{name}` is mapped to {device} by the device map, but the checkpoint does not hold it; \
         load a checkpoint of this model, or map the module to a device where it keeps its own values"
    )]
    MissingMapped {
        /// The checkpoint.
        checkpoint: PathBuf,
        /// The tensor.
        name: String,
        /// Where the map sends it.
        device: MapDevice,
    },
    /// A device map with the disk, and no folder to offload to.
    #[error("at least one of the model's modules is offloaded to disk ({module}); give an offload folder")]
    NoOffloadFolder {
        /// A module mapped to the disk.
        module: String,
    },
    /// Reading or writing the offload folder failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// libtorch failed (moving a tensor to a device that is not there).
    #[error("{what}: {message}")]
    Torch {
        /// What was being done.
        what: String,
        /// libtorch's message (its first line).
        message: String,
    },
    /// A unit of a dispatched model failed to run.
    #[error("running unit {unit} of the dispatched model failed: {message}")]
    Forward {
        /// The unit's index, and the modules it runs.
        unit: String,
        /// What failed.
        message: String,
    },
}

impl BigModelError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}
