//! Early writeback for large files that are fsynced once written.
//!
//! Left alone, the kernel starts writing dirty pages to disk only past
//! `dirty_background_ratio` (10 % of available memory: gigabytes) or after
//! seconds, so the first gigabytes of a checkpoint go to the page cache
//! while the disk idles, and the final fsync then waits for all of them.
//! Worse, once dirty pages pass the throttling threshold (lower the more
//! memory the process holds, as an asynchronous save's snapshot does)
//! every write stalls. Asking for writeback as the file grows keeps the disk
//! busy from the first byte, and waiting for what lies more than
//! [`WINDOW`] behind keeps the file's dirty pages bounded. Advisory only:
//! the fsync that follows is what makes the file durable and reports errors.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Dirty bytes of one file allowed ahead of the disk.
pub(crate) const WINDOW: u64 = 256 << 20;
/// Files smaller than this are left to the page cache.
const MIN_FILE: u64 = 64 << 20;

/// Writeback of one file being written by someone else (a library that
/// creates it from its path), advanced as it grows.
pub(crate) struct Writeback {
    path: PathBuf,
    file: Option<File>,
    /// Bytes handed to writeback so far.
    started: u64,
    /// Bytes known to be on disk.
    waited: u64,
}

impl Writeback {
    /// Writeback for the file at `path` (opened when first advanced).
    pub(crate) fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            file: None,
            started: 0,
            waited: 0,
        }
    }

    /// Starts writeback of what was written since the last call and waits
    /// for everything more than [`WINDOW`] behind the end.
    pub(crate) fn advance(&mut self) {
        if self.file.is_none() {
            self.file = File::open(&self.path).ok();
        }
        let Some(file) = &self.file else { return };
        let Ok(len) = file.metadata().map(|m| m.len()) else {
            return;
        };
        if len < MIN_FILE {
            return;
        }
        let fd = file.as_raw_fd();
        if len > self.started {
            sync_range(fd, self.started, len, libc::SYNC_FILE_RANGE_WRITE);
            self.started = len;
        }
        let behind = len.saturating_sub(WINDOW);
        if behind > self.waited {
            let wait = libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            sync_range(fd, self.waited, behind, wait);
            self.waited = behind;
        }
    }
}

/// `sync_file_range` over bytes `from..to` of `fd` (advisory: an error is
/// left to the fsync that follows).
fn sync_range(fd: std::os::fd::RawFd, from: u64, to: u64, flags: libc::c_uint) {
    // SAFETY: a valid open descriptor and a range inside its file.
    unsafe {
        libc::sync_file_range(fd, from as i64, (to - from) as i64, flags);
    }
}
