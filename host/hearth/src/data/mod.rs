//! Data: the data loader (map-style and iterable datasets, a seedable
//! shuffle, sharding by process, skipping and resumable state) and the token
//! datasets behind `hearth run`.
//!
//! Token datasets yield `[batch, time]` int64 inputs and next-token targets
//! (`-100` where no loss is taken), drawn from a seeded ChaCha stream so a
//! run is reproducible on any device.

mod batch;
pub mod documents;
mod loader;
mod random_tokens;
mod sampler;
mod sort_digits;
mod text_file;
mod tokens;

pub use batch::{Batch, GenerationSet, TokenDataset, Windows, IGNORE_INDEX};
pub use loader::{
    BatchSource, Batches, CloneItem, Collate, DataLoader, Dataset, IterableDataset, LoaderHandle,
    LoaderOptions, LoaderState, MapStyle, Stream,
};
pub use random_tokens::RandomTokens;
pub use sampler::{batches, epoch_order, shard_batches, Shard};
pub use sort_digits::SortDigits;
pub use text_file::{TextFile, TextFileError};
pub use tokens::{DataError, TokenDtype, TokenFile, Tokens, TokensSpec};
