//! Token datasets for language-model training.
//!
//! A dataset yields `[batch, time]` int64 inputs and next-token targets
//! (`-100` where no loss is taken), drawn from a seeded ChaCha stream so a
//! run is reproducible on any device. The prepared data loader (samplers,
//! sharding, resumable state) joins this module with the Accelerator.

mod batch;
mod random_tokens;
mod sort_digits;
mod text_file;

pub use batch::{Batch, GenerationSet, TokenDataset, IGNORE_INDEX};
pub use random_tokens::RandomTokens;
pub use sort_digits::SortDigits;
pub use text_file::{TextFile, TextFileError};
