//! Experiment trackers on their own thread, so a slow or faulty tracker
//! never stalls the training loop: `log` hands the values to a bounded queue
//! and returns. Only the main process logs (Accelerate's `log_with`).

use crate::plugins::{Entries, RunInfo, TrackerPlugin};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::thread::JoinHandle;

/// Logged steps that may wait for the tracker thread before `log` blocks.
const QUEUE: usize = 4096;

enum Message {
    Log(u64, Entries),
    Finish,
}

/// The trackers of a run, driven from a worker thread.
pub struct TrackerHub {
    names: Vec<String>,
    queue: Option<SyncSender<Message>>,
    worker: Option<JoinHandle<Vec<TrackerPlugin>>>,
}

impl TrackerHub {
    /// Starts every tracker with the run's info and config, on a new thread.
    pub fn start(mut trackers: Vec<TrackerPlugin>, run: RunInfo, config: Entries) -> Self {
        let names = trackers.iter().map(|t| t.name().to_string()).collect();
        let (queue, inbox) = sync_channel::<Message>(QUEUE);
        let worker = std::thread::Builder::new()
            .name("hearth-trackers".into())
            .spawn(move || {
                for t in &mut trackers {
                    t.start(run.clone(), config.clone());
                }
                for message in inbox {
                    match message {
                        Message::Log(step, values) => {
                            trackers.iter_mut().for_each(|t| t.log(step, &values))
                        }
                        Message::Finish => break,
                    }
                }
                trackers.iter_mut().for_each(TrackerPlugin::finish);
                trackers
            })
            .expect("spawn the tracker thread");
        Self {
            names,
            queue: Some(queue),
            worker: Some(worker),
        }
    }

    /// Names of the trackers.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Queues `values` for every tracker at `step`.
    pub fn log(&self, step: u64, values: Entries) {
        if let Some(queue) = &self.queue {
            let _ = queue.send(Message::Log(step, values));
        }
    }

    /// Finishes every tracker and waits for them; returns them (for their fault counts).
    pub fn finish(mut self) -> Vec<TrackerPlugin> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Vec<TrackerPlugin> {
        if let Some(queue) = self.queue.take() {
            let _ = queue.send(Message::Finish);
        }
        match self.worker.take().map(JoinHandle::join) {
            Some(Ok(trackers)) => trackers,
            Some(Err(_)) => {
                tracing::warn!("the tracker thread panicked; tracker output may be incomplete");
                Vec::new()
            }
            None => Vec::new(),
        }
    }
}

impl Drop for TrackerHub {
    fn drop(&mut self) {
        self.shutdown();
    }
}
