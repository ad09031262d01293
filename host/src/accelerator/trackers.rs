//! Experiment trackers on their own thread, so a slow or faulty tracker
//! never stalls the training loop: `log` hands the values to a bounded queue
//! and returns at once — if the trackers fall [`QUEUE`] calls behind, new
//! values are dropped (counted, and said once) rather than waited for. Only
//! the main process logs (Accelerate's `log_with`).

use crate::plugins::{Entries, RunInfo, TrackerPlugin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, SyncSender, TrySendError};
use std::time::Duration;

/// Logged steps that may wait for the tracker thread.
const QUEUE: usize = 4096;

/// How long the end of training waits for trackers to write what is queued
/// and finish, beyond one call deadline per tracker.
const FINISH_GRACE: Duration = Duration::from_secs(30);

/// The trackers of a run, driven from a worker thread.
pub struct TrackerHub {
    names: Vec<String>,
    queue: Option<SyncSender<(u64, Entries)>>,
    done: Option<Receiver<Vec<TrackerPlugin>>>,
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
        let (queue, inbox) = sync_channel::<(u64, Entries)>(QUEUE);
        let (done_tx, done) = channel();
        std::thread::Builder::new()
            .name("hearth-trackers".into())
            .spawn(move || {
                for t in &mut trackers {
                    t.start(run.clone(), config.clone());
                }
                // Ends when the hub closes the queue and it is drained.
                for (step, values) in inbox {
                    trackers.iter_mut().for_each(|t| t.log(step, &values));
                }
                trackers.iter_mut().for_each(TrackerPlugin::finish);
                let _ = done_tx.send(trackers);
            })
            .expect("spawn the tracker thread");
        Self {
            names,
            queue: Some(queue),
            done: Some(done),
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
        let Some(queue) = &self.queue else { return };
        match queue.try_send((step, values)) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => {
                if self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(
                        "trackers ({}) are {QUEUE} calls behind; dropping values logged at step {step} and later \
                         until they catch up (training does not wait)",
                        self.names.join(", ")
                    );
                }
            }
        }
    }

    /// Values dropped because the trackers were too far behind.
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

impl Drop for TrackerHub {
    fn drop(&mut self) {
        self.shutdown();
    }
}
