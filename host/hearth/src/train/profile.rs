//! Profiling a run (`[profile]` or `hearth run --profile DIR`): the
//! scheduled steps recorded by libtorch's profiler, one Chrome trace per
//! process, and the busiest operators printed by the main process.

use super::{RunOptions, TrainConfig, TrainError};
use crate::accelerator::Accelerator;
use crate::profiling::Profiler;
use std::path::{Path, PathBuf};

/// The profiler of a run and where its trace goes.
pub(super) struct RunProfile {
    profiler: Profiler,
    dir: PathBuf,
    /// The run's optimizer step that is the profiler's step 0.
    first_step: u64,
}

/// Rows of the operator table printed at the end.
const TABLE_ROWS: usize = 15;

impl RunProfile {
    /// Starts the profiler when the config has `[profile]` or the flag
    /// asks for it; the flag's folder wins over `output-trace-dir`.
    pub fn start(
        acc: &Accelerator,
        config: &TrainConfig,
        options: &RunOptions,
        run_dir: &Path,
        first_step: u64,
    ) -> Result<Option<Self>, TrainError> {
        if config.profile.is_none() && options.profile.is_none() {
            return Ok(None);
        }
        let section = config.profile.clone().unwrap_or_default();
        let dir = (options.profile.clone())
            .or_else(|| section.output_trace_dir.clone())
            .unwrap_or_else(|| run_dir.join("profile"));
        let kwargs = section.kwargs(dir.clone());
        let profiler = Profiler::start_with_metadata(&kwargs, acc.profiler_metadata())
            .map_err(TrainError::Profile)?;
        Ok(Some(Self {
            profiler,
            dir,
            first_step,
        }))
    }

    /// After each optimizer step.
    pub fn step(&mut self) -> Result<(), TrainError> {
        self.profiler.step().map_err(TrainError::Profile)
    }

    /// Stops, writes `profile_<rank>.json`, prints the table (main
    /// process) and waits for the other processes. Returns the trace's path.
    pub fn finish(self, acc: &Accelerator) -> Result<PathBuf, TrainError> {
        let schedule = self.profiler.schedule();
        let (trace, path) = (self.profiler)
            .stop_and_export(&self.dir, acc.process_index())
            .map_err(TrainError::Profile)?;
        if acc.is_main_process() {
            let table = trace.table(TABLE_ROWS).map_err(TrainError::Profile)?;
            // The trace ends at the step that stopped it; it holds the
            // `active` steps before (ProfilerStep#n counts from 0).
            let last = trace.step_num().saturating_sub(1);
            let first = (last + 1).saturating_sub(schedule.map_or(last + 1, |s| s.active));
            println!(
                "profile of optimizer steps {} to {} (ProfilerStep#{first} to #{last}) written to {} (open it in https://ui.perfetto.dev or chrome://tracing)\n{table}",
                self.first_step + first,
                self.first_step + last,
                path.display()
            );
        }
        acc.wait_for_everyone()?;
        Ok(path)
    }
}
