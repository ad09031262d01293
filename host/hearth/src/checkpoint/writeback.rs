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
//! [`WINDOW`] behind keeps the file's dirty pages bounded. What is on disk
//! then leaves the page cache: the file's next pages reuse that memory
//! rather than taking fresh memory (on the development VM fresh memory
//! cost a host fault a page, and a 3 GB save after another 3 GB of fresh
//! memory took 9–12 s instead of 5.6–6.3), and a checkpoint no longer
//! pushes the rest of the cache out (the training data's). DeepSpeed's
//! FastPersist skips the page cache altogether (O_DIRECT). The price: a
//! checkpoint read back at once comes from the disk. Advisory only: the
//! fsync that follows is what makes the file durable and reports errors.

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
    /// Bytes known to be on disk (and dropped from the cache).
    waited: u64,
    /// Dirty bytes allowed ahead of the disk.
    window: u64,
    /// Smaller files are left to the page cache.
    min_file: u64,
}

impl Writeback {
    /// Writeback for the file at `path` (opened when first advanced).
    pub(crate) fn new(path: &Path) -> Self {
        Self::with_window(path, WINDOW, MIN_FILE)
    }

    fn with_window(path: &Path, window: u64, min_file: u64) -> Self {
        Self {
            path: path.to_path_buf(),
            file: None,
            started: 0,
            waited: 0,
            window,
            min_file,
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
        if len < self.min_file {
            return;
        }
        let fd = file.as_raw_fd();
        if len > self.started {
            sync_range(fd, self.started, len, libc::SYNC_FILE_RANGE_WRITE);
            self.started = len;
        }
        let behind = len.saturating_sub(self.window);
        if behind > self.waited {
            let wait = libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            sync_range(fd, self.waited, behind, wait);
            drop_cached(fd, self.waited, behind);
            self.waited = behind;
        }
    }
}

/// Drops bytes `from..to` of `fd`, on disk by now, from the page cache,
/// so the file's next pages reuse that memory instead of taking fresh
/// memory. Advisory.
fn drop_cached(fd: std::os::fd::RawFd, from: u64, to: u64) {
    // SAFETY: a valid open descriptor and a range inside its file.
    unsafe {
        libc::posix_fadvise(
            fd,
            from as i64,
            (to - from) as i64,
            libc::POSIX_FADV_DONTNEED,
        );
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Pages of `path` in the page cache, by mincore on a mapping of it.
    fn cached_pages(path: &Path) -> Vec<bool> {
        let file = File::open(path).unwrap();
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let page = 4096;
        let mut resident = vec![0u8; map.len().div_ceil(page)];
        // SAFETY: a live mapping of map.len() bytes and a vector of one
        // byte per page.
        let ok = unsafe {
            libc::mincore(
                map.as_ptr() as *mut libc::c_void,
                map.len(),
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(ok, 0);
        resident.iter().map(|r| r & 1 == 1).collect()
    }

    #[test]
    fn what_is_on_disk_leaves_the_page_cache_and_the_window_stays() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: statfs of a path into a zeroed struct.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        let c = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut fs) }, 0);
        if fs.f_type == libc::TMPFS_MAGIC {
            eprintln!(
                "the temporary folder is tmpfs, whose pages are its storage: nothing to check"
            );
            return;
        }
        let path = dir.path().join("big");
        let mut file = File::create(&path).unwrap();
        let (mib, chunk) = (1u64 << 20, vec![7u8; 1 << 20]);
        let mut writeback = Writeback::with_window(&path, 4 * mib, mib);
        for _ in 0..16 {
            file.write_all(&chunk).unwrap();
            writeback.advance();
        }
        file.sync_all().unwrap();
        let cached = cached_pages(&path);
        let pages_per_mib = (mib / 4096) as usize;
        let (written_back, window) = cached.split_at(12 * pages_per_mib);
        assert!(
            written_back.iter().all(|c| !c),
            "{} of the first 12 MiB's pages still cached",
            written_back.iter().filter(|c| **c).count()
        );
        assert!(window.iter().all(|c| *c), "the last 4 MiB stay cached");
        assert_eq!(std::fs::read(&path).unwrap(), vec![7u8; 16 << 20]);
    }
}
