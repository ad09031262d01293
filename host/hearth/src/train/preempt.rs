//! A polite stop: what SLURM (`--signal`), Kubernetes and spot instances
//! send before they kill — SIGTERM, SIGUSR1 — makes `hearth run` finish the
//! step it is in, agree with the other processes on the step to stop at (a
//! signal may reach only some of them), save a checkpoint through the usual
//! atomic path, and exit with [`PREEMPTED_EXIT`]: resume me. A second
//! signal, or the grace period running out, exits at once; the checkpoint
//! being written is then abandoned whole, and the previous one stays
//! intact.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A second signal this soon after the first, and the same one, is the
/// same stop delivered twice (a scheduler signals every process, and
/// `hearth launch` passes its own on), not a demand to stop at once.
const SAME_STOP: Duration = Duration::from_secs(3);

/// Processes of a run over several agree on a stop every this many steps
/// (one small collective each time); one process checks every step.
pub const AGREE_EVERY: u64 = 10;

/// The exit status of a run stopped by a signal once its checkpoint is
/// saved: 75 (EX_TEMPFAIL, "try again later"). `hearth launch
/// --max-restarts` and a SLURM requeue script take it as "resume me".
pub const PREEMPTED_EXIT: i32 = 75;

/// The signals a run may take as a polite stop, by name.
pub const SIGNALS: [(&str, i32); 4] = [
    ("SIGTERM", libc::SIGTERM),
    ("SIGUSR1", libc::SIGUSR1),
    ("SIGUSR2", libc::SIGUSR2),
    ("SIGINT", libc::SIGINT),
];

/// The number of the signal called `name`.
pub fn signal_number(name: &str) -> Option<i32> {
    SIGNALS.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// The name of signal `number`.
pub fn signal_name(number: i32) -> &'static str {
    SIGNALS
        .iter()
        .find(|(_, s)| *s == number)
        .map_or("a signal", |(n, _)| n)
}

/// The signals this process takes as a polite stop, and the first one it
/// got. Dropped, it stops handling them (its grace timer with it).
pub struct Preemption {
    received: Arc<AtomicI32>,
    handle: signal_hook::iterator::Handle,
    disarmed: Arc<AtomicBool>,
}

impl Drop for Preemption {
    fn drop(&mut self) {
        self.disarmed.store(true, Ordering::SeqCst);
        self.handle.close();
    }
}

impl Preemption {
    /// Handles `signals` from now on (a thread of its own waits for them):
    /// the first is recorded, and after it `grace` passes at most before
    /// the process exits at once; a second exits at once.
    pub fn install(signals: &[i32], grace: Duration) -> std::io::Result<Self> {
        let received = Arc::new(AtomicI32::new(0));
        let disarmed = Arc::new(AtomicBool::new(false));
        let mut waiting = signal_hook::iterator::Signals::new(signals)?;
        let handle = waiting.handle();
        let first = Arc::clone(&received);
        let off = Arc::clone(&disarmed);
        std::thread::Builder::new()
            .name("hearth-signals".into())
            .spawn(move || {
                let mut since: Option<Instant> = None;
                for signal in waiting.forever() {
                    let name = signal_name(signal);
                    let before = first.load(Ordering::SeqCst);
                    if before != 0 {
                        let repeat = before == signal && since.is_some_and(|t| t.elapsed() < SAME_STOP);
                        if repeat {
                            continue;
                        }
                        eprintln!("hearth: {name} again: stopping at once (the last complete checkpoint stays)");
                        std::process::exit(128 + signal);
                    }
                    first.store(signal, Ordering::SeqCst);
                    since = Some(Instant::now());
                    tracing::warn!(
                        "{name}: finishing this step, then saving a checkpoint and stopping \
                         (a second signal, or {} s, stops at once)",
                        grace.as_secs()
                    );
                    let off = Arc::clone(&off);
                    std::thread::spawn(move || {
                        std::thread::sleep(grace);
                        if off.load(Ordering::SeqCst) {
                            return; // the run ended (a library's caller goes on)
                        }
                        eprintln!(
                            "hearth: the {} s grace after {name} ran out: stopping at once (the last complete checkpoint stays)",
                            grace.as_secs()
                        );
                        std::process::exit(128 + signal);
                    });
                }
            })?;
        Ok(Self {
            received,
            handle,
            disarmed,
        })
    }

    /// The signal this process got, if it got one.
    pub fn received(&self) -> Option<i32> {
        match self.received.load(Ordering::SeqCst) {
            0 => None,
            signal => Some(signal),
        }
    }
}

/// The polite stop `[run] save-on-signal` asks for (none for `[]`), with
/// `[run] signal-grace-seconds`.
pub(super) fn from_config(
    save_on_signal: &[String],
    grace_seconds: u64,
) -> Result<Option<Preemption>, super::TrainError> {
    let signals: Vec<i32> = save_on_signal
        .iter()
        .filter_map(|n| signal_number(n))
        .collect();
    if signals.is_empty() {
        return Ok(None);
    }
    let grace = Duration::from_secs(grace_seconds);
    Preemption::install(&signals, grace)
        .map(Some)
        .map_err(|source| super::TrainError::Io {
            path: "signal handlers".into(),
            source,
        })
}

/// The signal that stops the run after step `step`, agreed by every
/// process (the largest signal number any of them got: one collective of
/// one number every [`AGREE_EVERY`] steps when there are several), or none.
pub(super) fn agreed_signal(
    acc: &crate::accelerator::Accelerator,
    preemption: Option<&Preemption>,
    step: u64,
) -> Result<Option<i32>, super::TrainError> {
    let Some(preemption) = preemption else {
        return Ok(None);
    };
    let mine = preemption.received().unwrap_or(0);
    if acc.num_processes() == 1 {
        return Ok((mine != 0).then_some(mine));
    }
    if step % AGREE_EVERY != 0 {
        return Ok(None);
    }
    let agreed = acc.reduce(
        &tch::Tensor::from_slice(&[mine as f32]),
        hearth_comm::ReduceOp::Max,
    )?;
    let signal = f64::try_from(&agreed)? as i32;
    Ok((signal != 0).then_some(signal))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_are_named_both_ways() {
        assert_eq!(signal_number("SIGUSR1"), Some(libc::SIGUSR1));
        assert_eq!(signal_name(libc::SIGTERM), "SIGTERM");
        assert_eq!(signal_number("SIGKILL"), None);
    }

    #[test]
    fn a_signal_delivered_twice_at_once_is_one_stop_and_the_process_goes_on() {
        let p = Preemption::install(&[libc::SIGUSR2], Duration::from_secs(60)).unwrap();
        assert_eq!(p.received(), None);
        // SAFETY: raise(3) sends a signal to this process; it is handled.
        unsafe { libc::raise(libc::SIGUSR2) };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while p.received().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(p.received(), Some(libc::SIGUSR2));
        // The same signal again at once (the scheduler's and the launcher's
        // copies) is the same stop: this test process is still here.
        unsafe { libc::raise(libc::SIGUSR2) };
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(p.received(), Some(libc::SIGUSR2));
        // Dropped, it stops handling the signal and disarms its timer.
        drop(p);
    }
}
