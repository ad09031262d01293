//! Accelerate's enums that hearth has no other home for, with Accelerate's
//! spellings: [`RngType`] and [`LoggerType`]. (`DistributedType` is
//! [`hearth_comm::DistributedType`]; `PrecisionType` is
//! [`crate::precision::MixedPrecision`].) Each parses Accelerate's string
//! values; a value for a device or service hearth does not have is refused
//! with what hearth has instead.

/// Which random generators [`Accelerator::synchronize_rng_states`](super::Accelerator::synchronize_rng_states)
/// synchronises (Accelerate's `RNGType`: `"torch"`, `"cuda"`, `"generator"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum RngType {
    /// libtorch's CPU generator.
    Torch,
    /// This process's GPU generator.
    Cuda,
    /// A data loader's generator.
    Generator,
}

hearth_ops::spelled_enum! {
    RngType: "random generator type" {
        Torch = "torch",
        Cuda = "cuda",
        Generator = "generator",
    }
    refused |s| {
        "mlu" | "sdaa" | "musa" | "npu" | "xla" | "xpu" | "hpu" | "neuron" => format!(
            "random generator type {s:?} is Accelerate's for a device hearth does not drive; hearth has torch, cuda and generator"
        ),
    }
}

/// An experiment tracker by Accelerate's name (Accelerate's `LoggerType`):
/// each hearth has is a built-in tracker plugin of that name, and `All` is
/// every tracker plugin found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum LoggerType {
    /// Every tracker plugin on the search path.
    All,
    /// TensorBoard event files (the `tensorboard` plugin).
    Tensorboard,
    /// An MLflow file store (the `mlflow` plugin).
    Mlflow,
    /// DVCLive's files (the `dvclive` plugin).
    Dvclive,
    /// A Weights & Biases offline run, for `wandb sync` (the `wandb` plugin).
    Wandb,
}

hearth_ops::spelled_enum! {
    LoggerType: "tracker of Accelerate's (a tracker plugin's name goes in [[trackers]])" {
        All = "all",
        Tensorboard = "tensorboard",
        Mlflow = "mlflow",
        Dvclive = "dvclive",
        Wandb = "wandb",
    }
    // Accelerate's trackers that talk to a service or library hearth has no
    // plugin for (a plugin can be written for any of them).
    refused |s| {
        "aim" | "trackio" | "comet_ml" | "clearml" | "swanlab" => format!(
            "hearth has no tracker plugin for {s:?} (Accelerate's talks to its service); \
             write one against wit/ (see the book's plugin author's guide), or use \
             tensorboard, mlflow, dvclive, wandb, jsonl or csv"
        ),
    }
}
