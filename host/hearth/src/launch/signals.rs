//! The signals `hearth launch` passes on: a scheduler's polite stop
//! (SIGTERM; SIGUSR1 and SIGUSR2, which SLURM's `--signal` sends) reaches
//! the launcher, which hands it to every process it started — they finish
//! their step, agree, save and exit with status 75 — and waits for them
//! rather than dying first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

const FORWARDED: [i32; 3] = [libc::SIGTERM, libc::SIGUSR1, libc::SIGUSR2];

/// Whether `pid` is one of mpirun's ranks (not a daemon of its, `ssh`,
/// `srun`, …): Open MPI gives each rank its `OMPI_COMM_WORLD_RANK`.
fn is_rank(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
        env.split(|b| *b == 0)
            .any(|v| v.starts_with(b"OMPI_COMM_WORLD_RANK="))
    })
}

/// The launcher's processes of the current start, and whether a signal
/// reached the launcher itself.
#[derive(Default)]
pub(super) struct Forwarding {
    children: Mutex<Vec<u32>>,
    /// mpirun's pid, whose processes (started after it) get the signal.
    mpirun: Mutex<Option<u32>>,
    signalled: AtomicBool,
}

impl Forwarding {
    /// The launcher's forwarding, its handler installed on first use (a
    /// thread of its own waits for the signals).
    pub(super) fn get() -> &'static Arc<Forwarding> {
        static FORWARDING: OnceLock<Arc<Forwarding>> = OnceLock::new();
        FORWARDING.get_or_init(|| {
            let forwarding = Arc::new(Forwarding::default());
            let passed = Arc::clone(&forwarding);
            match signal_hook::iterator::Signals::new(FORWARDED) {
                Ok(mut signals) => {
                    std::thread::spawn(move || {
                        for signal in signals.forever() {
                            passed.signalled.store(true, Ordering::SeqCst);
                            let mut children =
                                passed.children.lock().unwrap_or_else(|p| p.into_inner()).clone();
                            // Under mpirun: its processes, straight (mpirun
                            // would take a SIGTERM as a reason to kill them).
                            if let Some(mpirun) = *passed.mpirun.lock().unwrap_or_else(|p| p.into_inner()) {
                                children.extend(
                                    super::process::descendants(mpirun).into_iter().filter(|&p| is_rank(p)),
                                );
                            }
                            eprintln!(
                                "hearth launch: got signal {signal}; passing it to the {} processes",
                                children.len()
                            );
                            for &pid in children.iter() {
                                // SAFETY: kill(2) on a child's pid.
                                unsafe { libc::kill(pid as libc::pid_t, signal) };
                            }
                        }
                    });
                }
                Err(e) => eprintln!("hearth launch: cannot pass signals on ({e}); a polite stop reaches the launcher only"),
            }
            forwarding
        })
    }

    /// The processes a signal goes to from now on.
    pub(super) fn set_children(&self, pids: Vec<u32>) {
        *self.children.lock().unwrap_or_else(|p| p.into_inner()) = pids;
    }

    /// A process that ended (reaped): no signal goes to its pid again.
    pub(super) fn forget(&self, pid: u32) {
        self.children
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|&p| p != pid);
    }

    /// mpirun, whose processes a signal goes to from now on (`None`: no
    /// longer).
    pub(super) fn set_mpirun(&self, pid: Option<u32>) {
        *self.mpirun.lock().unwrap_or_else(|p| p.into_inner()) = pid;
    }

    /// Whether a signal reached the launcher itself.
    pub(super) fn signalled(&self) -> bool {
        self.signalled.load(Ordering::SeqCst)
    }
}
