//! The Accelerator API in one process: prepare, backward, accumulation,
//! precision, the process helpers and kwargs handlers against Accelerate's
//! own values, and training steps against PyTorch's.

mod accelerator;
mod pytorch_parity;
