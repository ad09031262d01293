//! Experiment trackers on their own thread, so a slow or faulty tracker
//! never stalls the training loop: `log` hands the values to a bounded queue
//! and returns at once — if the trackers fall [`QUEUE`] calls behind, new
//! values are dropped (counted, and said once) rather than waited for. Only
//! the main process logs (Accelerate's `log_with`).
//!
//! The thread takes what was logged in batches, at most [`BATCH_INTERVAL`]
//! apart (TensorBoard's own writer flushes every 120 s): woken once a step,
//! every call ran against caches the step had just evicted, and in a run
//! of the bench GPT each tracker call cost 150–400 µs of CPU instead of
//! the 10–40 µs a call costs back to back. The end of training takes what
//! is left at once.

use super::Accelerator;
use hearth_plugins::{Entries, RunInfo, TrackerPlugin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Logged steps that may wait for the tracker thread.
const QUEUE: usize = 4096;

/// How long the end of training waits for trackers to write what is queued
/// and finish, beyond one call deadline per tracker.
const FINISH_GRACE: Duration = Duration::from_secs(30);

/// How long the tracker thread lets logged values gather between batches.
const BATCH_INTERVAL: Duration = Duration::from_secs(1);

/// Values logged at a step, for every tracker or the one of that index.
type Logged = (Option<usize>, u64, Entries);

/// Set when the hub closes, so the thread's wait between batches ends.
#[derive(Default)]
struct Closing {
    closed: Mutex<bool>,
    signal: Condvar,
}

impl Closing {
    fn close(&self) {
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.signal.notify_all();
    }

    /// Waits `interval`, or less if the hub closes.
    fn wait(&self, interval: Duration) {
        let closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self
            .signal
            .wait_timeout_while(closed, interval, |closed| !*closed);
    }
}

/// The trackers of a run, driven from a worker thread.
pub struct TrackerHub {
    names: Vec<String>,
    queue: Option<SyncSender<Logged>>,
    done: Option<Receiver<Vec<TrackerPlugin>>>,
    closing: Arc<Closing>,
    finish_wait: Duration,
    dropped: AtomicU64,
}

impl TrackerHub {
    /// Starts every tracker with the run's info and config, on a new thread.
    pub fn start(mut trackers: Vec<TrackerPlugin>, run: RunInfo, config: Entries) -> Self {
        let names = trackers.iter().map(|t| t.name().to_string()).collect();
        // finish: one deadline per tracker for its last call, and the grace.
        let finish_wait = FINISH_GRACE
            + trackers
                .iter()
                .map(TrackerPlugin::call_timeout)
                .sum::<Duration>();
        let (queue, inbox) = sync_channel::<Logged>(QUEUE);
        let (done_tx, done) = channel();
        let closing = Arc::new(Closing::default());
        let closed = closing.clone();
        std::thread::Builder::new()
            .name("hearth-trackers".into())
            .spawn(move || {
                yield_to_training();
                for t in &mut trackers {
                    t.start(run.clone(), config.clone());
                }
                let mut deliver =
                    |(to, step, values): Logged| match to.and_then(|i| trackers.get_mut(i)) {
                        Some(one) => one.log(step, &values),
                        None => trackers.iter_mut().for_each(|t| t.log(step, &values)),
                    };
                // Ends when the hub closes the queue and it is drained. A
                // batch is what was queued when the thread woke: taken
                // whole before any of it is delivered, so a value logged
                // while the trackers write goes with the next batch.
                while let Ok(first) = inbox.recv() {
                    let batch: Vec<Logged> =
                        std::iter::once(first).chain(inbox.try_iter()).collect();
                    batch.into_iter().for_each(&mut deliver);
                    closed.wait(BATCH_INTERVAL);
                }
                trackers.iter_mut().for_each(TrackerPlugin::finish);
                let _ = done_tx.send(trackers);
            })
            .expect("spawn the tracker thread");
        Self {
            names,
            queue: Some(queue),
            done: Some(done),
            closing,
            finish_wait,
            dropped: AtomicU64::new(0),
        }
    }

    /// Names of the trackers.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Queues `values` for every tracker at `step`; never waits.
    pub fn log(&self, step: u64, values: Entries) {
        self.send((None, step, values));
    }

    /// Queues `values` at `step` for the tracker called `name` only (what
    /// [`Accelerator::get_tracker`](super::Accelerator::get_tracker)'s
    /// handle logs); false when there is none of that name.
    pub fn log_to(&self, name: &str, step: u64, values: Entries) -> bool {
        let Some(index) = self.names.iter().position(|n| n == name) else {
            return false;
        };
        self.send((Some(index), step, values));
        true
    }

    fn send(&self, logged: Logged) {
        let Some(queue) = &self.queue else { return };
        let (step, values) = (logged.1, logged.2.len() as u64);
        match queue.try_send(logged) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => {
                if self.dropped.fetch_add(values, Ordering::Relaxed) == 0 {
                    tracing::warn!(
                        "trackers ({}) are {QUEUE} calls behind; dropping values logged at step {step} and later \
                         until they catch up (training does not wait)",
                        self.names.join(", ")
                    );
                }
            }
        }
    }

    /// Logged values (name and value pairs) dropped because the trackers
    /// were too far behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Lets the trackers write what is queued and finish, waiting a bounded
    /// time; returns them (for their fault counts), or nothing if they did
    /// not finish in time (the thread is then left behind).
    pub fn finish(mut self) -> Vec<TrackerPlugin> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Vec<TrackerPlugin> {
        drop(self.queue.take()); // closes the queue: the worker drains it, then finishes
        self.closing.close();
        let Some(done) = self.done.take() else {
            return Vec::new();
        };
        if self.dropped() > 0 {
            tracing::warn!(
                "{} logged values were dropped because the trackers fell behind",
                self.dropped()
            );
        }
        match done.recv_timeout(self.finish_wait) {
            Ok(trackers) => trackers,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                tracing::warn!(
                    "the tracker thread stopped unexpectedly; tracker output may be incomplete"
                );
                Vec::new()
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    "trackers ({}) did not finish within {} s; their output may be incomplete",
                    self.names.join(", "),
                    self.finish_wait.as_secs()
                );
                Vec::new()
            }
        }
    }
}

/// Why [`Accelerator::init_trackers_named`] could not start the trackers.
#[derive(Debug, thiserror::Error)]
pub enum InitTrackersError {
    /// A named tracker is not on the plugin path, or would not load.
    #[error(transparent)]
    Plugin(#[from] hearth_plugins::PluginError),
    /// The config did not serialise.
    #[error("the trackers' config does not serialise: {0}")]
    Config(String),
}

/// `value` as entries: an object's keys joined with dots under `prefix`,
/// numbers, booleans and strings as themselves, arrays as JSON text; nulls
/// left out.
fn flatten(prefix: &str, value: &serde_json::Value, out: &mut Entries) {
    use hearth_plugins::Value as V;
    let entry = match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                let key = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                flatten(&key, v, out);
            }
            return;
        }
        serde_json::Value::Null => return,
        serde_json::Value::Bool(b) => V::Boolean(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => V::Int(i),
            None => V::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => V::Text(s.clone()),
        serde_json::Value::Array(_) => V::Text(value.to_string()),
    };
    out.push((prefix.to_string(), entry));
}

/// Lowers the calling thread to the lowest priority (nice 19): on a machine
/// whose cores all train (libtorch's threads), the trackers then take the
/// time training leaves rather than an equal share of a core. Their queue
/// still drains (CFS gives a nice-19 thread ~1.5 % of a contended core), so
/// nothing logged is lost; at the end `finish` waits for them.
fn yield_to_training() {
    #[cfg(target_os = "linux")]
    // SAFETY: setpriority on this thread's own id (Linux threads each have
    // their own nice value); a failure leaves the priority as it was.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
}

impl Drop for TrackerHub {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nice value of this process's thread called `name`, from /proc.
    fn nice_of_thread(name: &str) -> Option<i64> {
        for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim() == name {
                let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
                // Fields after the command's closing parenthesis; nice is
                // field 19 of stat, the 17th after it.
                let after = &stat[stat.rfind(')')? + 2..];
                return after.split_whitespace().nth(16)?.parse().ok();
            }
        }
        None
    }

    #[test]
    fn the_tracker_thread_runs_at_the_lowest_priority() {
        let run = RunInfo {
            project: "p".into(),
            run: "r".into(),
            process_index: 0,
            num_processes: 1,
        };
        let hub = TrackerHub::start(Vec::new(), run, Vec::new());
        // The thread lowers itself as it starts.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let nice = loop {
            match nice_of_thread("hearth-trackers") {
                Some(19) => break 19,
                other if std::time::Instant::now() > deadline => panic!("nice {other:?}"),
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        assert_eq!(nice, 19);
        drop(hub);
    }
}

/// The accelerator's tracker API (Accelerate's `init_trackers`, `log`,
/// `get_tracker`).
impl Accelerator {
    /// Starts `trackers` for this run (Accelerate's `init_trackers`): on the
    /// main process they receive the run's `config` now and every
    /// [`log`](Self::log) later; on other processes they are dropped.
    pub fn init_trackers(
        &mut self,
        project: &str,
        run: &str,
        trackers: Vec<TrackerPlugin>,
        config: Entries,
    ) {
        // Checkpoint hooks are told the run's configuration too.
        self.registered.config = config.clone();
        if !self.is_main_process() || trackers.is_empty() {
            return;
        }
        let info = RunInfo {
            project: project.into(),
            run: run.into(),
            process_index: self.process_index() as u32,
            num_processes: self.num_processes() as u32,
        };
        self.trackers = Some(TrackerHub::start(trackers, info, config));
    }

    /// Starts the trackers named with
    /// [`log_with`](super::AcceleratorBuilder::log_with) for `project`
    /// (Accelerate's `init_trackers(project_name, config)`). `config` is
    /// anything serde serialises to an object; nested keys are joined with
    /// dots (`optimizer.lr`), arrays kept as JSON text. Only the main
    /// process finds and loads the trackers and gives each its folder,
    /// `<logging dir>/trackers/<name>/`; elsewhere nothing happens.
    ///
    /// ```no_run
    /// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut acc = hearth::accelerator::Accelerator::builder().cpu(true).log_with(["jsonl"]).build()?;
    /// acc.init_trackers_named("my-project", &serde_json::json!({"lr": 1e-3, "model": {"layers": 2}}))?;
    /// acc.log_scalars(&[("loss", 1.25)], 1);
    /// acc.end_training()?;
    /// # Ok(()) }
    /// ```
    pub fn init_trackers_named(
        &mut self,
        project: &str,
        config: &impl serde::Serialize,
    ) -> Result<(), InitTrackersError> {
        let config =
            serde_json::to_value(config).map_err(|e| InitTrackersError::Config(e.to_string()))?;
        let mut entries = Vec::new();
        flatten("", &config, &mut entries);
        let trackers = if self.is_main_process() {
            let (names, path) = &self.log_with;
            let registry = hearth_plugins::Registry::discover(path)?;
            let logging_dir = self.project_configuration().logging_dir().join("trackers");
            names
                .iter()
                .map(|name| {
                    let found = registry.find(name)?;
                    hearth_plugins::load_tracker(&found.manifest, &logging_dir.join(name))
                })
                .collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let run = self
            .project_configuration()
            .logging_dir()
            .file_name()
            .map_or_else(|| project.to_string(), |n| n.to_string_lossy().into_owned());
        self.init_trackers(project, &run, trackers, entries);
        Ok(())
    }

    /// Logs named numbers at `step` (Accelerate's
    /// `accelerator.log({"loss": 1.25}, step)`): [`log`](Self::log) for
    /// plain pairs.
    pub fn log_scalars(&self, values: &[(&str, f64)], step: u64) {
        let entries = values
            .iter()
            .map(|(name, v)| (name.to_string(), hearth_plugins::Value::Float(*v)))
            .collect();
        self.log(entries, step);
    }

    /// Logs the fields of anything serde serialises to an object at
    /// `step`: a `#[derive(Serialize)] struct Metrics { loss: f64, accuracy:
    /// f64 }` logs `loss` and `accuracy`; nested keys are joined with dots,
    /// as in [`init_trackers_named`](Self::init_trackers_named)'s config.
    pub fn log_serialized(
        &self,
        values: &impl serde::Serialize,
        step: u64,
    ) -> Result<(), serde_json::Error> {
        if self.trackers.is_none() {
            return Ok(());
        }
        let mut entries = Vec::new();
        flatten("", &serde_json::to_value(values)?, &mut entries);
        self.log(entries, step);
        Ok(())
    }

    /// Each tracker's faults, restarts and lost values, once
    /// [`end_training`](Self::end_training) has finished them (empty before,
    /// on other processes, and when they did not finish in time).
    pub fn tracker_health(&self) -> &[hearth_plugins::TrackerHealth] {
        &self.tracker_health
    }

    /// Logs `values` at `step` to every tracker, from the main process only
    /// (Accelerate's `accelerator.log(values, step)`). Never blocks on a tracker.
    pub fn log(&self, values: Entries, step: u64) {
        let _span = crate::profiling::span("hearth::log");
        if let Some(hub) = &self.trackers {
            hub.log(step, values);
        }
    }

    /// The tracker called `name` (Accelerate's `get_tracker`): its handle
    /// logs to it alone. On a process other than the main one — where no
    /// tracker runs — a handle that does nothing, as Accelerate's blank
    /// tracker. Accelerate's `unwrap=True` hands out the tracker's own
    /// object; a plugin's lives in its sandbox, so there is none to give.
    pub fn get_tracker(&self, name: &str) -> Result<TrackerHandle<'_>, UnknownTracker> {
        if !self.is_main_process() {
            return Ok(TrackerHandle {
                name: name.into(),
                hub: None,
            });
        }
        let names = self.trackers.as_ref().map(|h| h.names()).unwrap_or(&[]);
        if !names.iter().any(|n| n == name) {
            return Err(UnknownTracker {
                name: name.into(),
                known: names.to_vec(),
            });
        }
        Ok(TrackerHandle {
            name: name.into(),
            hub: self.trackers.as_ref(),
        })
    }
}

/// One tracker of the run (see [`Accelerator::get_tracker`]).
pub struct TrackerHandle<'a> {
    name: String,
    hub: Option<&'a TrackerHub>,
}

impl TrackerHandle<'_> {
    /// The tracker's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Logs `values` at `step` to this tracker only; never waits (nothing
    /// on a process other than the main one).
    pub fn log(&self, values: Entries, step: u64) {
        if let Some(hub) = self.hub {
            hub.log_to(&self.name, step, values);
        }
    }
}

/// [`Accelerator::get_tracker`] asked for a tracker the run does not have.
#[derive(Debug, thiserror::Error)]
#[error("{name} is not one of the run's trackers ({}); trackers are started by init_trackers", if known.is_empty() { "it has none".to_string() } else { known.join(", ") })]
pub struct UnknownTracker {
    /// The name asked for.
    pub name: String,
    /// The run's trackers.
    pub known: Vec<String>,
}
