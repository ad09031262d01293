//! Who is lost after a collective timed out: every process still alive
//! times out too (they all wait on the same collective) and then calls a
//! roll over a channel other than the communicator that failed, so that
//! the error names the ranks that hang or are gone. MPI calls it over MPI
//! point-to-point messages (`mpi/group.rs`); NCCL over the MPI world or the
//! job's store it was joined through (here).

use super::TcpStore;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The longest a roll call waits for the other processes' answers.
const ROLL_CALL_WINDOW: Duration = Duration::from_secs(15);

/// How long the roll call of a group whose collectives time out after
/// `timeout` waits: half the timeout, 15 s at most.
pub(crate) fn window(timeout: Duration) -> Duration {
    (timeout / 2).min(ROLL_CALL_WINDOW)
}

/// A channel the processes can call a roll over once a collective timed
/// out, apart from the communicator that timed out.
pub(crate) trait RollCall: Send {
    /// Which of `peers` (the other members of the group that timed out)
    /// did not answer within `window`, as ranks of the world (the
    /// launcher's numbering).
    fn silent_ranks(&self, window: Duration, peers: &[usize]) -> Vec<usize>;
}

/// The ranks the first roll call of this process found silent: later
/// timeouts (the group is broken by then) report them again rather than
/// call another, whose answers the first one's may take.
pub(crate) fn silent_once(call: impl FnOnce() -> Vec<usize>) -> Vec<usize> {
    SILENT.get_or_init(call).clone()
}

/// What the first roll call of this process found, if one was called.
pub(crate) fn silent_so_far() -> Option<Vec<usize>> {
    SILENT.get().cloned()
}

/// The first roll call's answer (see [`silent_once`]).
static SILENT: OnceLock<Vec<usize>> = OnceLock::new();

/// The roll call over the job's store (NCCL joined through it): each
/// process sets `hearth/roll-call/<rank>`, then polls for its peers' keys
/// until all are there or the window ends. Rank 0 serves the store: when
/// the store does not take this process's key in time, rank 0 is the one
/// named (the others cannot be told apart then); when it stops answering
/// part-way (rank 0 ended), the peers not heard from by then are named.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct StoreRollCall {
    /// The job's store (rank 0 serves it from a thread of its own, so it
    /// answers while rank 0's training thread hangs, not while the whole
    /// process is stopped).
    pub store: TcpStore,
    /// This process's rank in the world.
    pub rank: usize,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn key(rank: usize) -> String {
    format!("hearth/roll-call/{rank}")
}

/// How often a roll call over the store looks for the keys still missing.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const POLL: Duration = Duration::from_millis(20);

impl RollCall for StoreRollCall {
    fn silent_ranks(&self, window: Duration, peers: &[usize]) -> Vec<usize> {
        let deadline = Instant::now() + window;
        // A connection of the roll call's own, whose connecting and every
        // answer wait no longer than the window.
        let answered = self
            .store
            .client_within(window)
            .and_then(|client| client.set(&key(self.rank), &[]).map(|()| client));
        let Ok(client) = answered else {
            return vec![0];
        };
        let mut missing: Vec<usize> = peers.iter().copied().filter(|&p| p != self.rank).collect();
        loop {
            let mut heard = Vec::new();
            for &peer in &missing {
                match client.check(&key(peer)) {
                    Ok(true) => heard.push(peer),
                    Ok(false) => {}
                    Err(_) => return missing,
                }
            }
            missing.retain(|p| !heard.contains(p));
            if missing.is_empty() || Instant::now() >= deadline {
                return missing;
            }
            std::thread::sleep(POLL.min(deadline.saturating_duration_since(Instant::now())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::free_port;

    /// Rank `rank` on the store at `port` (served by rank 0).
    fn member(port: u16, rank: usize) -> StoreRollCall {
        let store = TcpStore::connect(
            "127.0.0.1",
            port,
            rank == 0,
            Duration::from_secs(10),
            Some("token"),
        )
        .unwrap();
        StoreRollCall { store, rank }
    }

    /// The others of a world of `n`, seen from `rank`.
    fn others(n: usize, rank: usize) -> Vec<usize> {
        (0..n).filter(|&r| r != rank).collect()
    }

    #[test]
    fn the_ranks_that_call_no_roll_are_named_by_those_that_do() {
        let port = free_port();
        let zero = member(port, 0);
        let (one, three) = (member(port, 1), member(port, 3));
        // Rank 2 hangs: it joined the store and never answers. Rank 3,
        // looked for after it, answers and is not named.
        let _two = member(port, 2);
        // Long beside rank 0's half second, for a loaded machine (CI).
        let window = Duration::from_secs(4);
        let started = Instant::now();
        let calls: Vec<_> = [(1, one), (3, three)]
            .into_iter()
            .map(|(r, m)| std::thread::spawn(move || m.silent_ranks(window, &others(4, r))))
            .collect();
        // Rank 0 comes to the roll call half a second late, within the window.
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(zero.silent_ranks(window, &others(4, 0)), vec![2]);
        for call in calls {
            assert_eq!(call.join().unwrap(), vec![2]);
        }
        assert!(started.elapsed() < window * 2, "{:?}", started.elapsed());
    }

    #[test]
    fn when_every_rank_answers_none_is_named_and_nobody_waits_the_window() {
        let port = free_port();
        let zero = member(port, 0);
        let one = member(port, 1);
        let started = Instant::now();
        let window = Duration::from_secs(10);
        let other = std::thread::spawn(move || one.silent_ranks(window, &[0]));
        assert!(zero.silent_ranks(window, &[1]).is_empty());
        assert!(other.join().unwrap().is_empty());
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// A split group (ranks 1 and 3 of 4) waits for its own members only:
    /// ranks 0 and 2, which did not time out, are not named.
    #[test]
    fn a_sub_group_calls_the_roll_among_its_members() {
        let port = free_port();
        let _zero = member(port, 0);
        let (one, three) = (member(port, 1), member(port, 3));
        // Both answer: the call ends when they do, not at the window.
        let window = Duration::from_secs(10);
        let other = std::thread::spawn(move || three.silent_ranks(window, &[1]));
        assert!(one.silent_ranks(window, &[3]).is_empty());
        assert!(other.join().unwrap().is_empty());
    }

    /// Rank 0's whole process stopped (SIGSTOP): its store takes
    /// connections into the kernel's backlog and answers nothing.
    #[test]
    fn a_store_that_answers_nothing_names_rank_0_within_the_window() {
        let stopped = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = stopped.local_addr().unwrap().port();
        // Without a token the client sends nothing until it is asked.
        let store =
            TcpStore::connect("127.0.0.1", port, false, Duration::from_secs(10), None).unwrap();
        let one = StoreRollCall { store, rank: 1 };
        let started = Instant::now();
        assert_eq!(one.silent_ranks(Duration::from_secs(1), &[0]), vec![0]);
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}
