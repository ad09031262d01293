//! The GPU paths: fp16 with loss scaling, bf16 autocast, CUDA generator
//! state, NCCL, offloading, CUDA graphs. They need a CUDA device, so they
//! are ignored by default (all but the check that the CUDA graph library
//! loads); on a GPU machine run `cargo test --release -p hearth --test cuda
//! -- --include-ignored` (tests/gpu/checklist.sh does).

mod graphs;
#[cfg(feature = "cuda")]
mod nccl;
mod placement;
mod precision;

use hearth::accelerator::LrSchedule;
use hearth::models::GptConfig;
use hearth::plugins::PluginError;
use tch::Device;

/// The GPT the training tests use: 16 tokens, 8 positions, d=64, 2 layers.
const SMALL_GPT: GptConfig = GptConfig {
    vocab_size: 16,
    block_size: 8,
    d_model: 64,
    layers: 2,
    heads: 4,
};

fn cuda() -> Device {
    assert!(
        hearth::ops::cuda::is_available(),
        "this test needs a CUDA GPU"
    );
    Device::Cuda(0)
}

struct Constant;
impl LrSchedule for Constant {
    fn lrs(&mut self, _: u64) -> Result<Vec<f64>, PluginError> {
        Ok(vec![0.1])
    }
}
