//! What calls into plugins cost, per plugin, counted by the one place every
//! call goes through ([`Prepared::run`](super::runtime::Prepared::run)):
//! how many, the wall time the calling thread spent in them, and that
//! thread's CPU time meanwhile; instantiations apart (user and system: a tracker's file writes
//! run on its own thread). A scheduler is called on the training loop, so
//! its wall time is what training waited; trackers are called on their own
//! low-priority thread, so their CPU time bounds what they took from the
//! compute threads. A run's `summary.json` lists them (`plugin_calls`).

use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The calls into one plugin.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PluginUsage {
    /// The plugin's kind (`scheduler`, `tracker`, …).
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Calls of its functions.
    pub calls: u64,
    /// Wall seconds the calling threads spent in them.
    pub wall_seconds: f64,
    /// CPU seconds the calling threads used meanwhile.
    pub cpu_seconds: f64,
    /// Instantiations (a fresh sandbox each: at load, and after a fault).
    pub instantiations: u64,
    /// Wall seconds those took.
    pub instantiate_seconds: f64,
}

/// What a timed call was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Instantiate,
    Call,
}

#[derive(Default, Clone, Copy)]
struct Totals {
    calls: u64,
    wall: Duration,
    cpu: Duration,
    instantiations: u64,
    instantiate: Duration,
}

/// Every plugin's totals since the process started, by (kind, name).
static TOTALS: Mutex<BTreeMap<(String, String), Totals>> = Mutex::new(BTreeMap::new());

/// When a call started, by both clocks.
pub(crate) struct CallStart {
    wall: Instant,
    cpu: Duration,
}

/// Starts timing a call on this thread.
pub(crate) fn start() -> CallStart {
    CallStart {
        wall: Instant::now(),
        cpu: thread_cpu(),
    }
}

/// Adds the call that began at `started` to plugin `name`'s totals.
pub(crate) fn record(kind: &str, name: &str, phase: Phase, started: CallStart) {
    let wall = started.wall.elapsed();
    let cpu = thread_cpu().saturating_sub(started.cpu);
    let mut totals = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
    // Found without building a key: a call allocates nothing once its
    // plugin has an entry (plugins are few).
    let known = totals.iter().position(|((k, n), _)| k == kind && n == name);
    let t = match known {
        Some(at) => totals.values_mut().nth(at).expect("found above"),
        None => totals.entry((kind.into(), name.into())).or_default(),
    };
    match phase {
        Phase::Call => {
            t.calls += 1;
            t.wall += wall;
            t.cpu += cpu;
        }
        Phase::Instantiate => {
            t.instantiations += 1;
            t.instantiate += wall;
        }
    }
}

/// Every plugin called so far in this process, by kind then name.
pub fn plugin_usage() -> Vec<PluginUsage> {
    let totals = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
    totals
        .iter()
        .map(|((kind, name), t)| PluginUsage {
            kind: kind.clone(),
            name: name.clone(),
            calls: t.calls,
            wall_seconds: t.wall.as_secs_f64(),
            cpu_seconds: t.cpu.as_secs_f64(),
            instantiations: t.instantiations,
            instantiate_seconds: t.instantiate.as_secs_f64(),
        })
        .collect()
}

/// The calls made since `before` (an earlier [`plugin_usage`]): what one
/// run of several in a process cost.
pub fn plugin_usage_since(before: &[PluginUsage]) -> Vec<PluginUsage> {
    plugin_usage()
        .into_iter()
        .filter_map(|now| {
            let earlier = before
                .iter()
                .find(|b| b.kind == now.kind && b.name == now.name);
            let Some(b) = earlier else {
                return Some(now);
            };
            let called = now.calls > b.calls || now.instantiations > b.instantiations;
            called.then(|| PluginUsage {
                calls: now.calls - b.calls,
                wall_seconds: now.wall_seconds - b.wall_seconds,
                cpu_seconds: now.cpu_seconds - b.cpu_seconds,
                instantiations: now.instantiations - b.instantiations,
                instantiate_seconds: now.instantiate_seconds - b.instantiate_seconds,
                ..now
            })
        })
        .collect()
}

/// This thread's CPU time so far (zero where the clock is missing).
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a timespec to fill.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
    if !ok {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_counts_its_wall_time_and_its_threads_cpu_time() {
        let before = plugin_usage();
        // A call that sleeps: wall time, next to no CPU.
        let started = start();
        std::thread::sleep(Duration::from_millis(30));
        record("test", "sleeper", Phase::Call, started);
        // A call that spins: CPU time about its wall time.
        let started = start();
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        record("test", "spinner", Phase::Call, started);
        record("test", "spinner", Phase::Instantiate, start());
        let used = plugin_usage_since(&before);
        let of = |name: &str| used.iter().find(|u| u.name == name).unwrap().clone();
        let (sleeper, spinner) = (of("sleeper"), of("spinner"));
        assert_eq!((sleeper.calls, spinner.calls), (1, 1));
        assert_eq!((sleeper.instantiations, spinner.instantiations), (0, 1));
        assert!(sleeper.wall_seconds >= 0.03, "{sleeper:?}");
        assert!(sleeper.cpu_seconds < 0.01, "{sleeper:?}");
        assert!(spinner.cpu_seconds > 0.005, "{spinner:?}");
        assert!(
            spinner.cpu_seconds <= spinner.wall_seconds + 1e-3,
            "{spinner:?}"
        );
        // Counted since `before` only, and only what was called.
        let again = plugin_usage_since(&plugin_usage());
        assert!(again.iter().all(|u| u.kind != "test"), "{again:?}");
    }
}
