//! `ProfileKwargs` and the `Profiler` that records a trace with libtorch's profiler.

use super::schedule::{transitions, ProfilerAction, ScheduleOption, Transition};
use super::summary::ProfileTrace;
use hearth_ops::profiler::{self as kineto, KinetoConfig};
use hearth_ops::profiler::{span, Span};
use std::path::PathBuf;
use std::sync::Arc;

/// Called each time a trace is ready (Accelerate's `on_trace_ready`); the
/// profiler's [`trace`](Profiler::trace) is the new one.
pub type TraceHandler = Arc<dyn Fn(&Profiler) + Send + Sync>;

/// What [`crate::accelerator::Accelerator::profile`] records and where it
/// goes (Accelerate's `ProfileKwargs`). Default: CPU (and CUDA where a GPU
/// is) recorded from start to end, nothing written.
#[derive(Clone, Default)]
pub struct ProfileKwargs {
    /// What to record; `None`: the CPU, and CUDA where a GPU is.
    pub activities: Option<Vec<ProfilerActivity>>,
    /// Which steps are recorded; `None`: everything inside the block.
    pub schedule_option: Option<ScheduleOption>,
    /// Called with the profiler each time a recording cycle ends.
    pub on_trace_ready: Option<TraceHandler>,
    /// Record operators' input shapes.
    pub record_shapes: bool,
    /// Record tensor memory (de)allocations.
    pub profile_memory: bool,
    /// Record source stacks: libtorch has them for TorchScript code only,
    /// native Rust callers add none.
    pub with_stack: bool,
    /// Estimate FLOPs of matrix products and convolutions.
    pub with_flops: bool,
    /// Record module hierarchy: TorchScript modules only.
    pub with_modules: bool,
    /// Where the last trace goes, as `profile_<process index>.json`.
    pub output_trace_dir: Option<PathBuf>,
}

impl std::fmt::Debug for ProfileKwargs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProfileKwargs")
            .field("activities", &self.activities)
            .field("schedule_option", &self.schedule_option)
            .field(
                "on_trace_ready",
                &self.on_trace_ready.as_ref().map(|_| ".."),
            )
            .field("record_shapes", &self.record_shapes)
            .field("profile_memory", &self.profile_memory)
            .field("with_stack", &self.with_stack)
            .field("with_flops", &self.with_flops)
            .field("with_modules", &self.with_modules)
            .field("output_trace_dir", &self.output_trace_dir)
            .finish()
    }
}

/// A kind of work the profiler records (Accelerate's activity strings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfilerActivity {
    /// `"cpu"`: host operators and spans.
    Cpu,
    /// `"cuda"`: kernels, copies and CUDA runtime calls.
    Cuda,
}

hearth_ops::spelled_enum! {
    ProfilerActivity: "profiler activity" {
        Cpu = "cpu",
        Cuda = "cuda",
    }
}

/// Why profiling failed.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// A bad `schedule_option`.
    #[error("ProfileKwargs.schedule_option: {0}")]
    Schedule(String),
    /// A bad or unavailable activity.
    #[error("ProfileKwargs.activities: {0}")]
    Activity(String),
    /// libtorch's profiler refused or failed.
    #[error("libtorch's profiler: {0}")]
    Torch(#[from] tch::TchError),
    /// A trace file or its folder could not be written.
    #[error("writing the trace to {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `output_trace_dir` was set but no step was recorded.
    #[error("nothing was recorded to write to {dir}: the schedule {schedule:?} never recorded a step in the {steps} profiler steps taken (call Profiler::step once per step, or lower wait/skip_first)")]
    NothingRecorded {
        /// `output_trace_dir`.
        dir: PathBuf,
        /// The schedule.
        schedule: Option<ScheduleOption>,
        /// Profiler steps taken.
        steps: u64,
    },
    /// Waiting for the other processes after writing the trace failed.
    #[error("waiting for the other processes after profiling: {0}")]
    Dist(#[from] hearth_comm::DistError),
}

/// A running profiler (torch.profiler's `profile` object): call
/// [`step`](Self::step) at the end of every step when a schedule is set.
pub struct Profiler {
    config: KinetoConfig,
    schedule: Option<ScheduleOption>,
    on_trace_ready: Option<TraceHandler>,
    step_num: u64,
    action: ProfilerAction,
    recording: bool,
    last: Option<ProfileTrace>,
    traces: u64,
    step_span: Option<Span>,
    /// Top-level keys of every trace (JSON text values).
    metadata: Vec<(String, String)>,
}

impl Profiler {
    /// Starts profiling as `kwargs` says (torch.profiler's `__enter__`).
    pub fn start(kwargs: &ProfileKwargs) -> Result<Self, ProfileError> {
        Self::start_with_metadata(kwargs, Vec::new())
    }

    /// [`start`](Self::start), adding `metadata` (keys and JSON text) to
    /// the top of every trace, besides the options recorded (`record_shapes`:
    /// 1, ..., as torch.profiler adds them).
    pub fn start_with_metadata(
        kwargs: &ProfileKwargs,
        mut metadata: Vec<(String, String)>,
    ) -> Result<Self, ProfileError> {
        if let Some(s) = &kwargs.schedule_option {
            s.validate().map_err(ProfileError::Schedule)?;
            if s.warmup == 0 {
                tracing::warn!("Profiler won't be using warmup, this can skew profiler results");
            }
        }
        let gpu = hearth_ops::cuda::device_count() > 0;
        let activities = kwargs.activities.clone().unwrap_or_else(|| match gpu {
            true => vec![ProfilerActivity::Cpu, ProfilerActivity::Cuda],
            false => vec![ProfilerActivity::Cpu],
        });
        if activities.contains(&ProfilerActivity::Cuda) && !gpu {
            return Err(ProfileError::Activity(
                "\"cuda\" was asked for, but this machine has no CUDA device; use [\"cpu\"]".into(),
            ));
        }
        if activities.is_empty() {
            return Err(ProfileError::Activity(
                "no activity to record; use [\"cpu\"] or leave it unset".into(),
            ));
        }
        let config = KinetoConfig {
            cpu: activities.contains(&ProfilerActivity::Cpu),
            cuda: activities.contains(&ProfilerActivity::Cuda),
            record_shapes: kwargs.record_shapes,
            profile_memory: kwargs.profile_memory,
            with_stack: kwargs.with_stack,
            with_flops: kwargs.with_flops,
            with_modules: kwargs.with_modules,
        };
        let options = [
            ("profile_memory", kwargs.profile_memory),
            ("with_stack", kwargs.with_stack),
            ("record_shapes", kwargs.record_shapes),
            ("with_modules", kwargs.with_modules),
            ("with_flops", kwargs.with_flops),
        ];
        metadata.extend(
            (options.iter().filter(|(_, on)| *on)).map(|(key, _)| (key.to_string(), "1".into())),
        );
        let schedule = kwargs.schedule_option;
        let mut profiler = Self {
            config,
            schedule,
            on_trace_ready: kwargs.on_trace_ready.clone(),
            step_num: 0,
            action: Self::action_at(&schedule, 0),
            recording: false,
            last: None,
            traces: 0,
            step_span: None,
            metadata,
        };
        profiler.transit(ProfilerAction::None, Some(profiler.action))?;
        profiler.open_step_span();
        Ok(profiler)
    }

    fn action_at(schedule: &Option<ScheduleOption>, step: u64) -> ProfilerAction {
        schedule.map_or(ProfilerAction::Record, |s| s.action(step))
    }

    /// With a schedule, each step is a `ProfilerStep#<n>` span, as in torch.
    fn open_step_span(&mut self) {
        if self.schedule.is_some() {
            self.step_span = span(&format!("ProfilerStep#{}", self.step_num));
        }
    }

    /// Marks the end of a step: the schedule moves on, and a recording
    /// cycle that ends here becomes a trace (torch.profiler's `step()`).
    pub fn step(&mut self) -> Result<(), ProfileError> {
        self.step_span = None;
        let previous = self.action;
        self.step_num += 1;
        self.action = Self::action_at(&self.schedule, self.step_num);
        self.transit(previous, Some(self.action))?;
        self.open_step_span();
        Ok(())
    }

    /// Ends profiling (torch.profiler's `__exit__`) and returns the last
    /// trace, if anything was recorded.
    pub fn stop(mut self) -> Result<Option<ProfileTrace>, ProfileError> {
        self.step_span = None;
        self.transit(self.action, None)?;
        Ok(self.last.take())
    }

    /// Ends profiling and writes the last trace to `dir` as
    /// `profile_<process_index>.json` (what Accelerate's `profile` block
    /// does on leaving); an error when nothing was recorded.
    pub fn stop_and_export(
        self,
        dir: &std::path::Path,
        process_index: usize,
    ) -> Result<(ProfileTrace, PathBuf), ProfileError> {
        let (steps, schedule) = (self.step_num, self.schedule);
        let trace = self.stop()?.ok_or_else(|| ProfileError::NothingRecorded {
            dir: dir.to_path_buf(),
            schedule,
            steps,
        })?;
        let path = trace_path(dir, process_index);
        trace.export_chrome_trace(&path)?;
        Ok((trace, path))
    }

    /// Steps taken so far.
    pub fn step_num(&self) -> u64 {
        self.step_num
    }

    /// The newest trace (the one `on_trace_ready` is called for).
    pub fn trace(&self) -> Option<&ProfileTrace> {
        self.last.as_ref()
    }

    /// Traces completed so far.
    pub fn traces_ready(&self) -> u64 {
        self.traces
    }

    /// The schedule it follows.
    pub fn schedule(&self) -> Option<ScheduleOption> {
        self.schedule
    }

    fn transit(
        &mut self,
        from: ProfilerAction,
        to: Option<ProfilerAction>,
    ) -> Result<(), ProfileError> {
        for transition in transitions(from, to) {
            match transition {
                Transition::Prepare => kineto::prepare(&self.config)?,
                Transition::Start => {
                    kineto::enable(&self.config)?;
                    self.recording = true;
                    for (key, value) in &self.metadata {
                        kineto::add_metadata(key, value)?;
                    }
                }
                Transition::Stop => {
                    self.recording = false;
                    self.last = Some(ProfileTrace::new(kineto::disable()?, self.step_num));
                }
                Transition::TraceReady => {
                    self.traces += 1;
                    if let Some(handler) = self.on_trace_ready.clone() {
                        handler(self);
                    }
                }
                Transition::Warn(what) => tracing::warn!("{what}"),
            }
        }
        Ok(())
    }
}

impl Drop for Profiler {
    /// A profiler dropped while recording (an error or panic in the
    /// profiled block) stops libtorch's, so that the next one can start.
    fn drop(&mut self) {
        self.step_span = None;
        if self.recording {
            let _ = kineto::disable();
        }
    }
}

/// Where a process's trace goes in `dir` (Accelerate's
/// `profile_{process_index}.json`).
pub fn trace_path(dir: &std::path::Path, process_index: usize) -> PathBuf {
    dir.join(format!("profile_{process_index}.json"))
}
