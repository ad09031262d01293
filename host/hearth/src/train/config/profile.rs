//! `[profile]`: record some training steps with libtorch's profiler and
//! write a Chrome trace per process (also turned on by `hearth run
//! --profile DIR`).

use super::{ConfigError, Invalid};
use crate::profiling::{ProfileKwargs, ProfilerActivity, ScheduleOption};
use serde::Deserialize;
use std::path::PathBuf;

/// The `[profile]` section: the schedule of `torch.profiler.schedule` (in
/// optimizer steps) and the recording options of Accelerate's
/// `ProfileKwargs`. Default: wait 5 steps, warm up 1, record 3, once.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ProfileSection {
    /// Where `profile_<rank>.json` goes (relative to the current
    /// directory); default: `profile/` in the run folder.
    pub output_trace_dir: Option<PathBuf>,
    /// `"cpu"`, `"cuda"`; default: the CPU, and CUDA on a GPU.
    pub activities: Option<Vec<String>>,
    /// Steps before the first cycle.
    #[serde(default)]
    pub skip_first: u64,
    /// Steps not profiled at the start of each cycle.
    #[serde(default = "default_wait")]
    pub wait: u64,
    /// Steps profiled and thrown away.
    #[serde(default = "default_warmup")]
    pub warmup: u64,
    /// Steps recorded.
    #[serde(default = "default_active")]
    pub active: u64,
    /// Cycles (0: every cycle until the run ends; each replaces the trace).
    #[serde(default = "default_repeat")]
    pub repeat: u64,
    /// Record operators' input shapes.
    #[serde(default)]
    pub record_shapes: bool,
    /// Record tensor memory (de)allocations.
    #[serde(default)]
    pub profile_memory: bool,
    /// Record source stacks (TorchScript only).
    #[serde(default)]
    pub with_stack: bool,
    /// Estimate FLOPs of matrix products.
    #[serde(default)]
    pub with_flops: bool,
    /// Record module hierarchy (TorchScript only).
    #[serde(default)]
    pub with_modules: bool,
}

impl Default for ProfileSection {
    fn default() -> Self {
        toml::from_str("").expect("every key has a default")
    }
}

fn default_wait() -> u64 {
    5
}
fn default_warmup() -> u64 {
    1
}
fn default_active() -> u64 {
    3
}
fn default_repeat() -> u64 {
    1
}

impl ProfileSection {
    /// The schedule, in optimizer steps.
    pub fn schedule(&self) -> ScheduleOption {
        ScheduleOption {
            wait: self.wait,
            warmup: self.warmup,
            active: self.active,
            repeat: self.repeat,
            skip_first: self.skip_first,
            skip_first_wait: 0,
        }
    }

    /// The profiler's settings, writing to `dir`.
    pub fn kwargs(&self, dir: PathBuf) -> ProfileKwargs {
        let activities = self.activities.as_ref().map(|names| {
            names
                .iter()
                .map(|n| n.parse().expect("validated"))
                .collect::<Vec<ProfilerActivity>>()
        });
        ProfileKwargs {
            activities,
            schedule_option: Some(self.schedule()),
            on_trace_ready: None,
            record_shapes: self.record_shapes,
            profile_memory: self.profile_memory,
            with_stack: self.with_stack,
            with_flops: self.with_flops,
            with_modules: self.with_modules,
            output_trace_dir: Some(dir),
        }
    }

    pub(super) fn validate(&self, invalid: &Invalid, steps: u64) -> Result<(), ConfigError> {
        for name in self.activities.iter().flatten() {
            name.parse::<ProfilerActivity>().map_err(|_| {
                invalid(
                    "profile.activities",
                    format!("{name:?} is not one of \"cpu\", \"cuda\""),
                )
            })?;
        }
        if self.active == 0 {
            return Err(invalid("profile.active", "must be at least 1".into()));
        }
        let first_recorded = self.skip_first + self.wait + self.warmup;
        if first_recorded >= steps {
            return Err(invalid(
                "profile",
                format!(
                    "the schedule records from step {} (skip-first {} + wait {} + warmup {}), but the run has only {steps} steps; lower them",
                    first_recorded + 1,
                    self.skip_first,
                    self.wait,
                    self.warmup
                ),
            ));
        }
        Ok(())
    }
}
