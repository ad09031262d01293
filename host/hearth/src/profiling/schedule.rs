//! When a profiler records: torch.profiler's `schedule` and the actions
//! its `profile` takes between two steps' states.

/// Steps to skip, wait, warm up and record, repeated (Accelerate's
/// `ProfileKwargs.schedule_option`, the arguments of
/// `torch.profiler.schedule`). The profiler skips the first `skip_first`
/// steps, then waits `wait` steps, warms up for `warmup`, records
/// `active`, and starts again with `wait`, `repeat` times (0: until the
/// profiling ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScheduleOption {
    /// Steps without profiling at the start of each cycle.
    pub wait: u64,
    /// Steps profiled but thrown away, so that recording starts warm.
    pub warmup: u64,
    /// Steps recorded (at least 1); the last one ends a trace.
    pub active: u64,
    /// Cycles; 0 repeats until the profiling ends.
    pub repeat: u64,
    /// Steps skipped before the first cycle.
    pub skip_first: u64,
    /// Nonzero: the first cycle starts without its `wait` steps.
    pub skip_first_wait: u64,
}

/// What the profiler does during a step (torch's `ProfilerAction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfilerAction {
    /// Not profiling.
    None,
    /// Profiling, results to be discarded.
    Warmup,
    /// Recording.
    Record,
    /// Recording; the trace is ready when this step ends.
    RecordAndSave,
}

impl ScheduleOption {
    /// Refuses what torch.profiler.schedule refuses (`active` of 0).
    pub fn validate(&self) -> Result<(), String> {
        if self.active == 0 {
            return Err(format!(
                "active must be at least 1 (got wait={}, warmup={}, active=0, repeat={}, skip_first={})",
                self.wait, self.warmup, self.repeat, self.skip_first
            ));
        }
        Ok(())
    }

    /// The action at step `step` (torch.profiler.schedule's function).
    pub fn action(&self, step: u64) -> ProfilerAction {
        if step < self.skip_first {
            return ProfilerAction::None;
        }
        let mut step = step - self.skip_first;
        if self.skip_first_wait != 0 {
            step += self.wait;
        }
        let cycle = self.wait + self.warmup + self.active;
        if self.repeat > 0 && step / cycle >= self.repeat {
            return ProfilerAction::None;
        }
        let at = step % cycle;
        if at < self.wait {
            ProfilerAction::None
        } else if at < self.wait + self.warmup {
            ProfilerAction::Warmup
        } else if at < cycle - 1 {
            ProfilerAction::Record
        } else {
            ProfilerAction::RecordAndSave
        }
    }
}

/// One thing a transition does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Start Kineto up (warm-up).
    Prepare,
    /// Start recording.
    Start,
    /// Stop recording, keeping the result.
    Stop,
    /// Hand the result to `on_trace_ready`.
    TraceReady,
    /// A schedule torch warns about (e.g. a warm-up followed by nothing).
    Warn(&'static str),
}

/// What happens between a step with action `from` and one with `to`
/// (`None`: the profiling ends), as torch.profiler's `action_map` says.
pub fn transitions(from: ProfilerAction, to: Option<ProfilerAction>) -> &'static [Transition] {
    use ProfilerAction::*;
    use Transition::*;
    match (from, to) {
        (None, Some(Warmup)) => &[Prepare],
        (None, Some(Record | RecordAndSave)) => &[Prepare, Start],
        (Warmup, Some(None)) => &[
            Warn("Incorrect schedule: WARMUP followed by NONE"),
            Start,
            Stop,
        ],
        (Warmup, Some(Record | RecordAndSave)) => &[Start],
        (Record, Some(None)) => &[Warn("Incorrect schedule: RECORD followed by NONE"), Stop],
        (Record, Some(Warmup)) => &[Warn("Incorrect schedule: RECORD followed by WARMUP"), Stop],
        (RecordAndSave, Some(None)) => &[Stop, TraceReady],
        (RecordAndSave, Some(Warmup)) => &[Stop, TraceReady, Prepare],
        (RecordAndSave, Some(Record | RecordAndSave)) => &[Stop, TraceReady, Prepare, Start],
        (Warmup, Option::None) => &[Start, Stop],
        (Record | RecordAndSave, Option::None) => &[Stop, TraceReady],
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cycle_waits_warms_up_records_and_saves_on_its_last_step() {
        let s = ScheduleOption {
            wait: 1,
            warmup: 1,
            active: 2,
            repeat: 1,
            skip_first: 1,
            skip_first_wait: 0,
        };
        use ProfilerAction::*;
        let actions: Vec<_> = (0..7).map(|step| s.action(step)).collect();
        assert_eq!(
            actions,
            [None, None, Warmup, Record, RecordAndSave, None, None]
        );
        let unending = ScheduleOption { repeat: 0, ..s };
        assert_eq!(unending.action(8), RecordAndSave);
        let eager = ScheduleOption {
            skip_first_wait: 1,
            ..s
        };
        assert_eq!(eager.action(1), Warmup);
        assert!(ScheduleOption { active: 0, ..s }.validate().is_err());
    }
}
