//! Delivery that neither stalls nor loses: an outbox for a tracker that
//! sends its records to a service over the network.
//!
//! A record (one logged step, a run's parameters...) goes in with
//! [`Outbox::push`]. Once [`Settings::batch`] records wait, the outbox
//! hands them, oldest first and at most [`Settings::per_request`] at a
//! time, to the tracker's `send` function, which makes the request(s) and
//! says how it went ([`Attempt`]):
//! - **sent**: they are gone;
//! - **retry** (the service is down, slow, or answered 5xx, 408 or 429):
//!   they wait, written to a spool file in the tracker's folder, and the
//!   outbox backs off (0.5 s, doubling to 30 s) before it tries again, at
//!   a later `push` or at [`Outbox::flush`];
//! - **refused** (any other answer): they are dropped, and said once.
//!
//! The spool is bounded ([`Settings::spool_bytes`]): past it the oldest
//! records are dropped. A fresh instance after a fault, or a resumed run,
//! opens the same folder and sends what was spooled. [`Outbox::flush`], at
//! `finish`, keeps trying for a bounded time; what is still unsent then is
//! counted as dropped and stays in the spool (a resumed run sends it).
//! Delivery is at least once: a request the service applied but whose
//! answer was lost is sent again.
//!
//! The counts ([`Counts`]: values sent, retried, spooled, dropped) are
//! kept beside the spool and reported to hearth after every change, which
//! puts them in the run's `summary.json`.
//!
//! ```no_run
//! use hearth_guest::outbox::{Attempt, Outbox, Record, Settings};
//! let mut outbox = Outbox::open("/logs/outbox", Settings::default())?;
//! let send = |records: &[Record]| {
//!     let body = records.iter().map(|r| r.line.as_str()).collect::<Vec<_>>().join("\n");
//!     match hearth_guest::http::post("http://127.0.0.1:8080/log", &[], body.as_bytes()) {
//!         Ok(reply) => Attempt::from_status(reply.status, &reply.body),
//!         Err(e) => Attempt::Retry(e),
//!     }
//! };
//! outbox.push(Record::new(1, r#"{"step": 1, "loss": 0.5}"#), send);
//! # Ok::<(), String>(())
//! ```

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One record to deliver: a line of the tracker's own format (no newline)
/// and the number of logged values it carries (0 for one that carries
/// none, such as a run's parameters).
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Logged values (name and value pairs) in it.
    pub values: u64,
    /// The record, as the tracker's `send` reads it back.
    pub line: String,
}

impl Record {
    /// A record of `values` logged values.
    pub fn new(values: u64, line: impl Into<String>) -> Self {
        let mut line = line.into();
        // One record per spool line.
        line.retain(|c| c != '\n' && c != '\r');
        Self { values, line }
    }
}

/// How one attempt to send a batch of records went.
#[derive(Debug, Clone, PartialEq)]
pub enum Attempt {
    /// The service took them.
    Sent,
    /// Worth trying again later (no connection, a timeout, 5xx, 408, 429).
    Retry(String),
    /// The service refused them for good (another 4xx, a malformed
    /// answer): they are dropped.
    Refused(String),
}

impl Attempt {
    /// The attempt an HTTP answer with `status` and `body` makes.
    pub fn from_status(status: u16, body: &[u8]) -> Self {
        let said = || {
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            format!("answered {status}: {text}")
        };
        match status {
            200..=299 => Attempt::Sent,
            408 | 429 | 500..=599 => Attempt::Retry(said()),
            _ => Attempt::Refused(said()),
        }
    }
}

/// What happened to the logged values that went through an outbox, over
/// the run (a fresh instance reads them back from the spool's folder).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Values the service took.
    pub sent: u64,
    /// Values whose first attempt failed and that were tried again.
    pub retried: u64,
    /// Values that waited in the spool file.
    pub spooled: u64,
    /// Values given up: refused, pushed out of a full spool, or unsent
    /// when [`Outbox::flush`] ran out of time.
    pub dropped: u64,
}

impl Counts {
    /// The counts and the values a flush left unsent, as a line.
    fn to_line(self, unsent: u64) -> String {
        let Self {
            sent,
            retried,
            spooled,
            dropped,
        } = self;
        format!("{sent} {retried} {spooled} {dropped} {unsent}")
    }

    fn from_line(line: &str) -> Option<(Self, u64)> {
        let mut n = line.split_whitespace().map(|f| f.parse::<u64>().ok());
        let counts = Self {
            sent: n.next()??,
            retried: n.next()??,
            spooled: n.next()??,
            dropped: n.next()??,
        };
        Some((counts, n.next().flatten().unwrap_or(0)))
    }
}

/// How an outbox sends, waits and spools.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Records that wait in memory before a send is tried (1: each at once).
    pub batch: usize,
    /// Most records handed to one `send` (what a spool drains with).
    pub per_request: usize,
    /// Most bytes the spool file holds; the oldest records go first.
    pub spool_bytes: u64,
    /// The first wait after a failed attempt; each further failure doubles
    /// it, up to `max_backoff`.
    pub backoff: Duration,
    /// The longest wait between attempts.
    pub max_backoff: Duration,
    /// How long [`Outbox::flush`] keeps trying.
    pub flush: Duration,
    /// Also send, whatever `batch` says, once this long has passed since
    /// the last attempt: at most one request per interval while values
    /// come fast, each at once when they come slowly (none: `batch` alone
    /// decides). What waits when no further record comes goes at `flush`.
    pub interval: Option<Duration>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            batch: 1,
            per_request: 500,
            spool_bytes: 64 << 20,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            flush: Duration::from_secs(5),
            interval: None,
        }
    }
}

/// The records a tracker has yet to deliver, and its delivery counts.
pub struct Outbox {
    dir: PathBuf,
    settings: Settings,
    /// Oldest first; the first `spooled` of them are in the spool file.
    waiting: VecDeque<Record>,
    spooled: usize,
    /// Bytes of the spool file.
    spool_bytes: u64,
    /// The first `failed` waiting records have had an attempt fail.
    failed: usize,
    /// When the next attempt may be made, after a failure.
    retry_at: Option<Instant>,
    /// The wait after the next failure.
    next_backoff: Duration,
    counts: Counts,
    /// Values the last flush left unsent, counted as dropped until a later
    /// instance (or flush) takes them up again.
    unsent_at_flush: u64,
    /// When a send was last tried (or the outbox opened).
    last_attempt: Instant,
    /// Refusals and drops are said once each.
    said_refused: bool,
    said_full: bool,
}

const SPOOL: &str = "spool.jsonl";
const COUNTS: &str = "counts.txt";

impl Outbox {
    /// An outbox spooling in `dir` (created if missing). What a previous
    /// instance spooled there, and its counts, are read back.
    pub fn open(dir: impl AsRef<Path>, settings: Settings) -> Result<Self, String> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut waiting = VecDeque::new();
        let mut spool_bytes = 0;
        if let Ok(text) = std::fs::read_to_string(dir.join(SPOOL)) {
            for line in text.lines() {
                // `<values> <record>`; a torn last line (a fault mid-write) is skipped.
                if let Some((values, record)) = line.split_once(' ') {
                    if let Ok(values) = values.parse() {
                        spool_bytes += line.len() as u64 + 1;
                        waiting.push_back(Record::new(values, record));
                    }
                }
            }
        }
        // What a flush left unsent is waiting again, no longer dropped.
        let (mut counts, unsent) = std::fs::read_to_string(dir.join(COUNTS))
            .ok()
            .and_then(|t| Counts::from_line(&t))
            .unwrap_or_default();
        counts.dropped = counts.dropped.saturating_sub(unsent);
        let spooled = waiting.len();
        let next_backoff = settings.backoff;
        let outbox = Self {
            dir,
            settings,
            waiting,
            spooled,
            spool_bytes,
            failed: spooled,
            retry_at: None,
            next_backoff,
            counts,
            unsent_at_flush: 0,
            last_attempt: Instant::now(),
            said_refused: false,
            said_full: false,
        };
        outbox.report();
        Ok(outbox)
    }

    /// The counts so far.
    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// Records not yet delivered.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Adds `record`; once [`Settings::batch`] wait (or
    /// [`Settings::interval`] has passed) and no back-off is running,
    /// tries to send them (with `send`).
    pub fn push(&mut self, record: Record, send: impl FnMut(&[Record]) -> Attempt) {
        let full = self.waiting.len() + 1 >= self.settings.batch.max(1);
        let due = self
            .settings
            .interval
            .is_some_and(|every| self.last_attempt.elapsed() >= every);
        self.push_and_try(record, send, full || due)
    }

    /// Adds `record` and, unless a back-off is running, tries at once to
    /// send everything waiting, whatever [`Settings::batch`] says (a run's
    /// parameters at its start).
    pub fn push_now(&mut self, record: Record, send: impl FnMut(&[Record]) -> Attempt) {
        self.push_and_try(record, send, true)
    }

    fn push_and_try(
        &mut self,
        record: Record,
        send: impl FnMut(&[Record]) -> Attempt,
        try_now: bool,
    ) {
        self.waiting.push_back(record);
        if try_now && self.may_try(Instant::now()) {
            self.drain(send);
        }
        self.spool_failed();
        self.save_counts();
    }

    /// Sends everything waiting, trying again after failures until
    /// [`Settings::flush`] has passed; what is left then is counted as
    /// dropped (and stays in the spool). Returns the counts.
    pub fn flush(&mut self, mut send: impl FnMut(&[Record]) -> Attempt) -> Counts {
        self.counts.dropped -= std::mem::take(&mut self.unsent_at_flush);
        let deadline = Instant::now() + self.settings.flush;
        while !self.waiting.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            if let Some(at) = self.retry_at.filter(|&at| at > now) {
                std::thread::sleep(at.min(deadline) - now);
                continue;
            }
            self.drain(&mut send);
        }
        self.spool_failed();
        let left: u64 = self.waiting.iter().map(|r| r.values).sum();
        if left > 0 {
            warn(&format!(
                "{left} values could not be sent within {:?}; they stay in {}",
                self.settings.flush,
                self.dir.join(SPOOL).display()
            ));
        }
        self.counts.dropped += left;
        self.unsent_at_flush = left;
        self.save_counts();
        self.counts
    }

    fn may_try(&self, now: Instant) -> bool {
        self.retry_at.is_none_or(|at| now >= at)
    }

    /// Sends waiting records, oldest first, until they are gone or an
    /// attempt fails.
    fn drain(&mut self, mut send: impl FnMut(&[Record]) -> Attempt) {
        self.last_attempt = Instant::now();
        let spooled_before = self.spooled;
        while !self.waiting.is_empty() {
            let n = self.waiting.len().min(self.settings.per_request.max(1));
            let batch: Vec<Record> = self.waiting.iter().take(n).cloned().collect();
            let values: u64 = batch.iter().map(|r| r.values).sum();
            match send(&batch) {
                Attempt::Sent => {
                    self.counts.sent += values;
                    self.take_front(n);
                    self.retry_at = None;
                    self.next_backoff = self.settings.backoff;
                }
                Attempt::Refused(why) => {
                    if !self.said_refused {
                        self.said_refused = true;
                        warn(&format!(
                            "the service refused {values} values ({why}); they are dropped"
                        ));
                    }
                    self.counts.dropped += values;
                    self.take_front(n);
                }
                Attempt::Retry(why) => {
                    let fresh: u64 = batch.iter().skip(self.failed).map(|r| r.values).sum();
                    if self.failed == 0 {
                        warn(&format!(
                            "could not send ({why}); trying again in {:?}, keeping the values in {}",
                            self.next_backoff,
                            self.dir.join(SPOOL).display()
                        ));
                    }
                    self.counts.retried += fresh;
                    self.failed = self.failed.max(n);
                    self.retry_at = Some(Instant::now() + self.next_backoff);
                    self.next_backoff = (self.next_backoff * 2).min(self.settings.max_backoff);
                    break;
                }
            }
        }
        if self.spooled < spooled_before {
            self.rewrite_spool();
        }
    }

    /// Drops the `n` oldest waiting records.
    fn take_front(&mut self, n: usize) {
        self.waiting.drain(..n);
        self.spooled = self.spooled.saturating_sub(n);
        self.failed = self.failed.saturating_sub(n);
    }

    /// Writes to the spool the waiting records that have had an attempt
    /// fail (or wait behind one that has) and are not in it yet; past the
    /// spool's bound the oldest are dropped.
    fn spool_failed(&mut self) {
        if self.retry_at.is_none() || self.spooled == self.waiting.len() {
            return;
        }
        let new: Vec<String> = self
            .waiting
            .iter()
            .skip(self.spooled)
            .map(|r| format!("{} {}\n", r.values, r.line))
            .collect();
        self.counts.spooled += self
            .waiting
            .iter()
            .skip(self.spooled)
            .map(|r| r.values)
            .sum::<u64>();
        self.spool_bytes += new.iter().map(|l| l.len() as u64).sum::<u64>();
        self.spooled = self.waiting.len();
        if self.spool_bytes > self.settings.spool_bytes {
            let mut dropped = 0;
            while self.spool_bytes > self.settings.spool_bytes && !self.waiting.is_empty() {
                let r = self.waiting.pop_front().expect("not empty");
                self.spool_bytes -= r.line.len() as u64 + r.values.to_string().len() as u64 + 2;
                self.spooled -= 1;
                self.failed = self.failed.saturating_sub(1);
                dropped += r.values;
            }
            self.counts.dropped += dropped;
            if !self.said_full {
                self.said_full = true;
                warn(&format!(
                    "the spool is full ({} bytes); dropping the oldest values",
                    self.settings.spool_bytes
                ));
            }
            self.rewrite_spool();
            return;
        }
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(SPOOL))
            .and_then(|mut f| f.write_all(new.concat().as_bytes()));
        if let Err(e) = appended {
            warn(&format!("spooling to {}: {e}", self.dir.display()));
        }
    }

    /// Writes the spool anew with the spooled records still waiting (or
    /// removes it when none are), through a temporary file so that a fault
    /// leaves the old or the new one.
    fn rewrite_spool(&mut self) {
        let path = self.dir.join(SPOOL);
        if self.spooled == 0 {
            let _ = std::fs::remove_file(&path);
            self.spool_bytes = 0;
            return;
        }
        let text: String = self
            .waiting
            .iter()
            .take(self.spooled)
            .map(|r| format!("{} {}\n", r.values, r.line))
            .collect();
        self.spool_bytes = text.len() as u64;
        let tmp = self.dir.join("spool.tmp");
        let written = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            warn(&format!("rewriting {}: {e}", path.display()));
        }
    }

    fn save_counts(&self) {
        let line = self.counts.to_line(self.unsent_at_flush);
        let _ = std::fs::write(self.dir.join(COUNTS), line);
        self.report();
    }

    fn report(&self) {
        report(self.counts)
    }
}

/// A warning in hearth's log (on standard error in a native test build,
/// which has no host).
fn warn(message: &str) {
    #[cfg(target_arch = "wasm32")]
    crate::log::warn(message);
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("{message}");
}

/// Hands the counts to hearth (on WebAssembly; a native test build has no host).
fn report(counts: Counts) {
    #[cfg(target_arch = "wasm32")]
    {
        use crate::bindings::tracker::hearth::plugin::delivery;
        delivery::report(delivery::Counts {
            sent: counts.sent,
            retried: counts.retried,
            spooled: counts.spooled,
            dropped: counts.dropped,
        });
    }
    #[cfg(not(target_arch = "wasm32"))]
    let _ = counts;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    fn fast() -> Settings {
        Settings {
            backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(80),
            flush: Duration::from_millis(500),
            ..Settings::default()
        }
    }

    /// A service that is down while `down` is set and keeps what it took.
    struct Service {
        down: RefCell<bool>,
        took: RefCell<Vec<String>>,
        attempts: RefCell<u32>,
    }

    impl Service {
        fn new(down: bool) -> Self {
            Self {
                down: RefCell::new(down),
                took: RefCell::new(vec![]),
                attempts: RefCell::new(0),
            }
        }
        fn send(&self) -> impl FnMut(&[Record]) -> Attempt + '_ {
            move |records| {
                *self.attempts.borrow_mut() += 1;
                if *self.down.borrow() {
                    return Attempt::Retry("connection refused".into());
                }
                self.took
                    .borrow_mut()
                    .extend(records.iter().map(|r| r.line.clone()));
                Attempt::Sent
            }
        }
    }

    fn record(step: u64) -> Record {
        Record::new(2, format!("{{\"step\": {step}}}"))
    }

    #[test]
    fn a_service_that_is_up_takes_each_record_at_once_and_nothing_is_spooled() {
        let dir = tempfile::tempdir().unwrap();
        let service = Service::new(false);
        let mut outbox = Outbox::open(dir.path(), fast()).unwrap();
        for step in 0..5 {
            outbox.push(record(step), service.send());
        }
        assert_eq!(service.took.borrow().len(), 5);
        assert_eq!(
            outbox.counts(),
            Counts {
                sent: 10,
                ..Counts::default()
            }
        );
        assert!(!dir.path().join(SPOOL).exists());
    }

    #[test]
    fn with_an_interval_fast_records_go_together_and_slow_ones_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let service = Service::new(false);
        let settings = Settings {
            batch: usize::MAX,
            interval: Some(Duration::from_millis(200)),
            ..fast()
        };
        let mut outbox = Outbox::open(dir.path(), settings).unwrap();
        // Fast: within the interval nothing is sent.
        for step in 0..5 {
            outbox.push(record(step), service.send());
        }
        assert_eq!(*service.attempts.borrow(), 0);
        // The interval passes: the next push sends all six in one request.
        std::thread::sleep(Duration::from_millis(220));
        outbox.push(record(5), service.send());
        assert_eq!(*service.attempts.borrow(), 1);
        assert_eq!(service.took.borrow().len(), 6);
        // Slow: a record after a quiet interval goes at once.
        std::thread::sleep(Duration::from_millis(220));
        outbox.push(record(6), service.send());
        assert_eq!((*service.attempts.borrow(), outbox.waiting()), (2, 0));
        // What waits when no record follows goes at flush.
        outbox.push(record(7), service.send());
        assert_eq!(outbox.waiting(), 1);
        assert_eq!(outbox.flush(service.send()).sent, 16);
    }

    #[test]
    fn a_service_that_comes_back_gets_every_record_once_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let service = Service::new(true);
        let mut outbox = Outbox::open(dir.path(), fast()).unwrap();
        for step in 0..10 {
            outbox.push(record(step), service.send());
        }
        // One attempt, then the back-off holds the rest: no attempt per record.
        assert_eq!(*service.attempts.borrow(), 1);
        assert_eq!(outbox.waiting(), 10);
        let spool = std::fs::read_to_string(dir.path().join(SPOOL)).unwrap();
        assert_eq!(spool.lines().count(), 10, "{spool}");
        *service.down.borrow_mut() = false;
        std::thread::sleep(Duration::from_millis(30));
        outbox.push(record(10), service.send());
        let want: Vec<String> = (0..11).map(|s| record(s).line).collect();
        assert_eq!(*service.took.borrow(), want);
        assert_eq!(
            outbox.counts(),
            Counts {
                sent: 22,
                retried: 2,
                spooled: 20,
                dropped: 0
            }
        );
        assert!(
            !dir.path().join(SPOOL).exists(),
            "an emptied spool is removed"
        );
    }

    #[test]
    fn a_fresh_instance_sends_what_the_last_one_spooled_and_keeps_its_counts() {
        let dir = tempfile::tempdir().unwrap();
        let service = Service::new(true);
        {
            let mut outbox = Outbox::open(dir.path(), fast()).unwrap();
            for step in 0..3 {
                outbox.push(record(step), service.send());
            }
        } // the instance is gone (a fault)
        *service.down.borrow_mut() = false;
        let mut outbox = Outbox::open(dir.path(), fast()).unwrap();
        assert_eq!(outbox.waiting(), 3);
        let counts = outbox.flush(service.send());
        assert_eq!(service.took.borrow().len(), 3);
        assert_eq!(
            counts,
            Counts {
                sent: 6,
                retried: 2,
                spooled: 6,
                dropped: 0
            }
        );
    }

    #[test]
    fn flush_gives_up_in_bounded_time_and_counts_what_is_left_as_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let service = Service::new(true);
        let mut outbox = Outbox::open(dir.path(), fast()).unwrap();
        for step in 0..4 {
            outbox.push(record(step), service.send());
        }
        let start = Instant::now();
        let counts = outbox.flush(service.send());
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_secs(2),
            "{took:?}"
        );
        assert!(
            *service.attempts.borrow() > 2,
            "it tried again while flushing"
        );
        assert_eq!((counts.sent, counts.dropped), (0, 8));
        // They stay spooled for a resumed run.
        let spool = std::fs::read_to_string(dir.path().join(SPOOL)).unwrap();
        assert_eq!(spool.lines().count(), 4);
    }

    #[test]
    fn what_a_flush_left_is_sent_by_a_resumed_run_and_no_longer_counted_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let service = Service::new(true);
        {
            let mut outbox = Outbox::open(dir.path(), fast()).unwrap();
            outbox.push(record(0), service.send());
            outbox.push(record(1), service.send());
            assert_eq!(outbox.flush(service.send()).dropped, 4);
        }
        *service.down.borrow_mut() = false;
        let mut outbox = Outbox::open(dir.path(), fast()).unwrap();
        assert_eq!(outbox.counts().dropped, 0, "waiting again, not dropped");
        let counts = outbox.flush(service.send());
        assert_eq!((counts.sent, counts.dropped), (4, 0));
        assert_eq!(service.took.borrow().len(), 2);
    }

    #[test]
    fn a_full_spool_drops_the_oldest_records() {
        let dir = tempfile::tempdir().unwrap();
        let service = Service::new(true);
        let settings = Settings {
            spool_bytes: 100,
            ..fast()
        };
        let mut outbox = Outbox::open(dir.path(), settings).unwrap();
        for step in 0..20 {
            outbox.push(record(step), service.send());
        }
        let spool = std::fs::read_to_string(dir.path().join(SPOOL)).unwrap();
        assert!(spool.len() <= 100, "{} bytes", spool.len());
        assert!(
            spool.ends_with("{\"step\": 19}\n"),
            "the newest are kept: {spool}"
        );
        let counts = outbox.counts();
        assert_eq!(counts.dropped + 2 * outbox.waiting() as u64, 40);
    }

    #[test]
    fn refused_records_are_dropped_and_the_next_ones_go_on() {
        let dir = tempfile::tempdir().unwrap();
        let mut outbox = Outbox::open(dir.path(), fast()).unwrap();
        let mut took = vec![];
        for step in 0..3 {
            outbox.push(record(step), |records: &[Record]| {
                if records[0].line.contains(": 1}") {
                    Attempt::from_status(400, b"bad metric name")
                } else {
                    took.push(records[0].line.clone());
                    Attempt::from_status(200, b"")
                }
            });
        }
        assert_eq!(took.len(), 2);
        assert_eq!((outbox.counts().sent, outbox.counts().dropped), (4, 2));
    }

    #[test]
    fn statuses_map_to_attempts_as_http_clients_retry() {
        assert_eq!(Attempt::from_status(204, b""), Attempt::Sent);
        for status in [408, 429, 500, 502, 503] {
            assert!(
                matches!(Attempt::from_status(status, b""), Attempt::Retry(_)),
                "{status}"
            );
        }
        for status in [400, 401, 403, 404, 413] {
            assert!(
                matches!(Attempt::from_status(status, b""), Attempt::Refused(_)),
                "{status}"
            );
        }
    }
}
