//! DDP's side of the gradient round (PyTorch's `DistributedDataParallel`),
//! in layers that only point down: [`bucket`] cuts gradients into buckets
//! and writes the reduced means back; `power_sgd` compresses a bucket into
//! low-rank factors; [`comm_hook`] sends a bucket under the configured hook
//! (full precision, 16 bits, PowerSGD); `options` holds the settings
//! (Accelerate's `DistributedDataParallelKwargs`) and the buffers kept equal
//! to rank 0's. The round that runs them is `super::GradientSync`.

pub(crate) mod bucket;
pub(crate) mod comm_hook;
mod options;
pub(crate) mod power_sgd;

pub use bucket::FIRST_BUCKET_MB;
pub use comm_hook::{CommHook, CommWrapper};
pub use options::{BufferBroadcast, DdpOptions};
pub use power_sgd::PowerSgdOptions;
