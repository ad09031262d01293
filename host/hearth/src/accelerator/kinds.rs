//! Accelerate's enums that hearth has no other home for, with Accelerate's
//! spellings: [`RngType`] and [`LoggerType`]. (`DistributedType` is
//! [`hearth_comm::DistributedType`]; `PrecisionType` is
//! [`crate::precision::MixedPrecision`].) Each parses Accelerate's string
//! values; a value for a device or service hearth does not have is refused
//! with what hearth has instead.

use std::fmt;
use std::str::FromStr;

pub(crate) use hearth_ops::spelling::parse_spelling;

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

/// Accelerate's values for devices hearth does not drive.
const OTHER_RNG_TYPES: [&str; 8] = ["mlu", "sdaa", "musa", "npu", "xla", "xpu", "hpu", "neuron"];

impl RngType {
    /// Accelerate's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Torch => "torch",
            Self::Cuda => "cuda",
            Self::Generator => "generator",
        }
    }
}

impl fmt::Display for RngType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RngType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_spelling(
            s,
            &[Self::Torch, Self::Cuda, Self::Generator],
            Self::as_str,
            &OTHER_RNG_TYPES,
            || {
                format!(
                "random generator type {s:?} is Accelerate's for a device hearth does not drive; hearth has torch, cuda and generator"
            )
            },
            || format!("unknown random generator type {s:?}; expected torch, cuda or generator"),
        )
    }
}

impl TryFrom<String> for RngType {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
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
}

/// Accelerate's trackers that talk to a service or library hearth has no
/// plugin for (a plugin can be written for any of them).
const OTHER_LOGGERS: [&str; 6] = ["aim", "wandb", "trackio", "comet_ml", "clearml", "swanlab"];

impl LoggerType {
    /// Accelerate's spelling, which is also the tracker plugin's name
    /// (`"all"` for every one).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::All => "all",
            Self::Tensorboard => "tensorboard",
            Self::Mlflow => "mlflow",
            Self::Dvclive => "dvclive",
        }
    }
}

impl fmt::Display for LoggerType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LoggerType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_spelling(
            s,
            &[Self::All, Self::Tensorboard, Self::Mlflow, Self::Dvclive],
            Self::as_str,
            &OTHER_LOGGERS,
            || {
                format!(
                    "hearth has no tracker plugin for {s:?} (Accelerate's talks to its service); \
                 write one against wit/ (see the README's \"Writing a plugin\"), or use \
                 tensorboard, mlflow, dvclive, jsonl or csv"
                )
            },
            || {
                format!(
                "unknown tracker {s:?}; expected all, tensorboard, mlflow or dvclive (or a tracker plugin's name)"
            )
            },
        )
    }
}

impl TryFrom<String> for LoggerType {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}
