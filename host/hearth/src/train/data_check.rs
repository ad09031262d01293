//! `hearth data prepare`: the config's data made ready before a run —
//! documents tokenized into their cache — and a measure of how fast the
//! loader delivers training batches on one process.

use super::config::{Sampling, TrainConfig};
use super::error::TrainError;
use super::setup;
use super::stream::DataStream;
use serde::Serialize;
use std::time::Instant;

/// What preparing the data found and measured.
#[derive(Debug, Clone, Serialize)]
pub struct DataReport {
    /// Seconds to open the data (tokenizing documents when their cache is
    /// absent).
    pub prepare_seconds: f64,
    /// The vocabulary the model gets.
    pub vocab_size: i64,
    /// Tokens per input sequence.
    pub seq_len: i64,
    /// Numbered training windows (datasets read sequentially).
    pub windows: Option<usize>,
    /// Held-out batches of `[eval] batch-size` scored at the end.
    pub validation_batches: usize,
    /// Batches drawn to time the loader.
    pub batches: usize,
    /// Input tokens the loader delivered per second on one process.
    pub loader_tokens_per_sec: f64,
}

/// Opens `config`'s data as a run would on one process and draws
/// `batches` training batches of `[data] batch-size`, timed.
pub fn prepare_data(config: &TrainConfig, batches: usize) -> Result<DataReport, TrainError> {
    let started = Instant::now();
    let data = setup::dataset(config, None)?;
    let prepare_seconds = started.elapsed().as_secs_f64();
    let sequential = (config.data.sampling() == Sampling::Sequential)
        .then(|| config.data.shuffle.unwrap_or(false));
    let mut stream = DataStream::new(config.run.seed, 0, 1, sequential);
    stream.check(data.as_ref(), config.data.batch_size, &config.source)?;
    let batch_size = config.data.batch_size;
    let timer = Instant::now();
    let mut tokens = 0i64;
    for _ in 0..batches {
        tokens += stream.next_batch(data.as_ref(), batch_size).inputs.numel() as i64;
    }
    let seconds = timer.elapsed().as_secs_f64();
    Ok(DataReport {
        prepare_seconds,
        vocab_size: data.vocab_size(),
        seq_len: data.seq_len(),
        windows: data.windows().map(|w| w.count()),
        validation_batches: data.validation_batches(config.eval.batch_size).len(),
        batches,
        loader_tokens_per_sec: tokens as f64 / seconds.max(1e-9),
    })
}
