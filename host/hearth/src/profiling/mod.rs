//! Profiling with libtorch's own profiler (Kineto), driven as
//! torch.profiler drives it: Accelerate's `ProfileKwargs` and
//! `Accelerator.profile`, a schedule of steps, Chrome traces, and hearth's
//! own steps (forward, backward, optimizer, collectives, checkpoints,
//! plugin calls) as named spans in them.
//!
//! ```no_run
//! use hearth::profiling::{ProfileKwargs, ScheduleOption};
//! # let acc = hearth::accelerator::Accelerator::builder().build()?;
//! let kwargs = ProfileKwargs {
//!     schedule_option: Some(ScheduleOption { wait: 1, warmup: 1, active: 3, repeat: 1, ..Default::default() }),
//!     output_trace_dir: Some("traces".into()),
//!     ..Default::default()
//! };
//! acc.profile(Some(&kwargs), |prof| {
//!     for _ in 0..10 {
//!         // ... one training step ...
//!         prof.step()?;
//!     }
//!     Ok::<_, hearth::profiling::ProfileError>(())
//! })??;
//! // traces/profile_0.json holds steps 2 to 4.
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod profiler;
mod schedule;
mod summary;

pub use hearth_ops::profiler::{span, span_named, KinetoEvent, Span};
pub use profiler::*;
pub use schedule::{ProfilerAction, ScheduleOption};
pub use summary::{key_averages, table, OpAverage, ProfileTrace};
