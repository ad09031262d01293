//! What a run shows: the line that says what is about to train, then while
//! it trains an indicatif bar on a terminal and a `tracing` line every
//! `log-every` steps (what CI logs and pipes see).

use super::config::TrainConfig;
use crate::accelerator::Accelerator;
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Duration;

pub(crate) struct Progress {
    bar: ProgressBar,
    /// Off on every process but the main one.
    speaks: bool,
}

impl Progress {
    /// A bar over `steps` steps; hidden when `quiet` or not on a terminal.
    /// Only the main process (`main`) shows or logs anything.
    pub(crate) fn new(steps: u64, quiet: bool, main: bool) -> Self {
        let bar = if quiet || !main {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(steps)
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} ETA {eta} {msg}",
            )
            .expect("static template")
            .progress_chars("=> "),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        Self { bar, speaks: main }
    }

    pub(crate) fn advance(&self) {
        self.bar.inc(1);
    }

    /// Shows the latest numbers on the bar and logs them; with several
    /// processes, `slowest` is the rank whose steps took longest and its
    /// seconds per step.
    pub(crate) fn report(
        &self,
        step: u64,
        steps: u64,
        loss: f64,
        lr: f64,
        tokens_per_sec: f64,
        slowest: Option<(usize, f64)>,
    ) {
        if !self.speaks {
            return;
        }
        let slowest = slowest.map_or(String::new(), |(rank, secs)| {
            format!(" · slowest rank {rank} {:.0} ms/step", secs * 1e3)
        });
        self.bar.set_message(format!(
            "loss {loss:.4} · {tokens_per_sec:.0} tok/s · lr {lr:.2e}{slowest}"
        ));
        self.bar.suspend(|| {
            tracing::info!(
                "step {step}/{steps} loss {loss:.4} lr {lr:.2e} tokens/s {tokens_per_sec:.0}{slowest}"
            );
        });
    }

    /// Logs a line without tearing the bar.
    pub(crate) fn log(&self, line: impl std::fmt::Display) {
        if !self.speaks {
            return;
        }
        self.bar.suspend(|| tracing::info!("{line}"));
    }

    /// Logs a warning without tearing the bar.
    pub(crate) fn warn(&self, line: impl std::fmt::Display) {
        if self.speaks {
            self.bar.suspend(|| tracing::warn!("{line}"));
        }
    }

    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// What [`announce`] says of the job besides its config.
pub(crate) struct Shape {
    /// The model's parameters.
    pub parameters: i64,
    /// How many of them train and how many are frozen.
    pub trainable: crate::models::Trainable,
    /// Optimizer steps to train.
    pub steps: u64,
    /// Tokens per example.
    pub seq_len: i64,
    /// Whether the step runs as a CUDA graph.
    pub graphed: bool,
}

/// Prints (on the main process) what is about to train.
pub(crate) fn announce(acc: &Accelerator, config: &TrainConfig, job: Shape) {
    let accumulation = acc.gradient_accumulation_steps();
    acc.print(format!(
        "hearth run {}: {} with {} parameters{} on {}{}, {} steps of {}{} × {} tokens{}{}{}",
        config.run.name,
        config.model.kind.as_str(),
        job.parameters,
        match job.trainable.frozen {
            0 => String::new(),
            _ => format!(" ({})", job.trainable),
        },
        hearth_ops::spelling::device_name(acc.device()),
        match acc.process_group().backend() {
            "single" => String::new(),
            backend => match acc.num_processes() {
                1 => format!(" (1 process, {backend})"),
                n => format!(" ({n} processes, {backend})"),
            },
        },
        job.steps,
        if accumulation > 1 {
            format!("{accumulation} × ")
        } else {
            String::new()
        },
        config.data.batch_size,
        job.seq_len,
        match acc.mixed_precision() {
            crate::precision::MixedPrecision::No => String::new(),
            mode => format!(", mixed precision {mode}"),
        },
        match acc.fsdp_settings() {
            Some(f) => format!(
                ", FSDP {} ({}{})",
                f.sharding_strategy.as_str(),
                f.auto_wrap_policy,
                match f.mixed_precision_policy {
                    Some(p) => format!(
                        "; parameters in {}, gradients reduced in {}",
                        p.param_dtype.name(),
                        p.reduce_dtype.name()
                    ),
                    None => String::new(),
                }
            ),
            None => String::new(),
        },
        if job.graphed {
            format!(
                ", the step captured in a CUDA graph after {} eager steps",
                super::graphed::WARMUP_STEPS
            )
        } else {
            String::new()
        }
    ));
}
