//! `accelerate estimate-memory`: the memory to load a model, to train it
//! with Adam, and its largest layer, per dtype.

use super::sizes::calculate_maximum_sizes;
use crate::models::ModuleTree;
use serde::Serialize;

/// The dtypes `accelerate estimate-memory` knows (hearth adds `bfloat16`,
/// sized as `float16`).
pub const ESTIMATE_DTYPES: [&str; 5] = ["float32", "float16", "bfloat16", "int8", "int4"];

/// One row of the estimate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryEstimate {
    /// The dtype.
    pub dtype: String,
    /// Bytes of the largest layer in that dtype.
    pub largest_layer: f64,
    /// Bytes of the whole model in that dtype.
    pub total_size: f64,
    /// Peak bytes of training with Adam (a batch of one; `None` where
    /// Accelerate has no estimate: int8, int4).
    pub training: Option<u64>,
}

/// Accelerate's `estimate_training_usage`: the largest of the model, its
/// gradients, Adam's state and a step, for a float32 model of `bytes`
/// trained in `dtype` (float32, or mixed precision in float16/bfloat16).
fn training_usage(bytes: u64, dtype: &str) -> Option<u64> {
    let half = bytes / 2;
    match dtype {
        // model, gradients, optimizer (2×), step (4×)
        "float32" => Some(bytes.max(2 * bytes).max(4 * bytes)),
        // fp32 master weights, fp32 + fp16 gradients, 2× optimizer states
        "float16" | "bfloat16" => Some(bytes.max(bytes + half).max(2 * bytes)),
        _ => None,
    }
}

/// `accelerate estimate-memory`'s rows for `dtypes` (names from
/// [`ESTIMATE_DTYPES`]; others are skipped): the float32 sizes divided by
/// 2, 4 or 8 for float16/bfloat16, int8 and int4.
pub fn estimate_memory(tree: &ModuleTree, dtypes: &[String]) -> Vec<MemoryEstimate> {
    let (total, (largest, _)) = calculate_maximum_sizes(tree, &[]);
    dtypes
        .iter()
        .filter(|d| ESTIMATE_DTYPES.contains(&d.as_str()))
        .map(|dtype| {
            let divisor = match dtype.as_str() {
                "float16" | "bfloat16" => 2.0,
                "int8" => 4.0,
                "int4" => 8.0,
                _ => 1.0,
            };
            MemoryEstimate {
                dtype: dtype.clone(),
                largest_layer: largest as f64 / divisor,
                total_size: total as f64 / divisor,
                training: training_usage(total, dtype),
            }
        })
        .collect()
}
