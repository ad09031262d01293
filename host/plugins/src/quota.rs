//! A plugin's folder quota: what it may store (bytes) and how many files
//! and folders it may have there. wasmtime-wasi has no hook for this, so
//! hearth registers its own `wasi:filesystem/types` over wasmtime-wasi's:
//! every call is passed through, and those that grow the folder (writes,
//! streams, `set-size`, creating files, folders and links) are checked
//! first. Past the quota the plugin gets `insufficient-space` (ENOSPC) —
//! an error it can handle, not a trap. (A stream write that crosses the
//! quota stops exactly at it; wasi-libc reports that as EIO.)
//!
//! Counting is cheap: growth is charged as it happens, and only when the
//! count says the quota is reached is the folder walked again (links never
//! followed, at most the file quota of entries), so deletes and truncation
//! give room back.

use bytes::Bytes;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use wasmtime::component::{HasData, Resource};
use wasmtime_wasi::filesystem::{Descriptor, WasiFilesystemCtxView};
use wasmtime_wasi::p2::bindings::filesystem::types::{
    self, ErrorCode, HostDescriptor, HostDirectoryEntryStream,
};
use wasmtime_wasi::p2::{
    DynOutputStream, FsError, FsResult, OutputStream, Pollable, StreamError, StreamResult,
};

/// The quota of one folder, shared by every store that reaches it.
pub struct Quota {
    root: PathBuf,
    max_bytes: u64,
    max_files: u64,
    /// What was there before the plugin (not counted against it).
    baseline: (u64, u64),
    /// Bytes and entries now, as far as counted (may over-count between
    /// walks, never under-count).
    used: Mutex<(u64, u64)>,
}

/// Bytes of the files and number of entries under `root` (links not
/// followed), stopping after `max_entries` entries.
fn walk(root: &Path, max_entries: u64) -> (u64, u64) {
    let (mut bytes, mut entries) = (0, 0);
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(read) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in read.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            entries += 1;
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() {
                bytes += meta.len();
            }
            if entries > max_entries {
                return (bytes, entries);
            }
        }
    }
    (bytes, entries)
}

fn nospc() -> ErrorCode {
    ErrorCode::InsufficientSpace
}

impl Quota {
    /// At most `max_bytes` and `max_files` in `root`; what is there already
    /// counts unless `only_growth` (a checkpoint folder the host also
    /// writes into).
    pub fn new(root: &Path, max_bytes: u64, max_files: u64, only_growth: bool) -> Arc<Self> {
        let now = walk(root, u64::MAX);
        Arc::new(Self {
            root: root.into(),
            max_bytes,
            max_files,
            baseline: if only_growth { now } else { (0, 0) },
            used: Mutex::new(now),
        })
    }

    fn recount(&self, used: &mut (u64, u64)) {
        *used = walk(&self.root, self.baseline.1 + self.max_files);
    }

    /// Bytes that may still be added (walking the folder again once if
    /// the count says fewer than `want`).
    fn room(&self, want: u64) -> u64 {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let limit = self.baseline.0.saturating_add(self.max_bytes);
        if used.0.saturating_add(want) > limit {
            self.recount(&mut used);
        }
        limit.saturating_sub(used.0)
    }

    /// Charges `growth` bytes, or refuses them (checked and charged under
    /// one lock, so stores sharing the folder cannot both take the room).
    fn charge_bytes(&self, growth: u64) -> Result<(), ErrorCode> {
        if growth == 0 {
            return Ok(());
        }
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let limit = self.baseline.0.saturating_add(self.max_bytes);
        if used.0.saturating_add(growth) > limit {
            self.recount(&mut used);
        }
        if used.0.saturating_add(growth) > limit {
            return Err(nospc());
        }
        used.0 += growth;
        Ok(())
    }

    /// Whether one more file, folder or link may be created.
    fn entry_room(&self) -> bool {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let limit = self.baseline.1.saturating_add(self.max_files);
        if used.1 >= limit {
            self.recount(&mut used);
        }
        used.1 < limit
    }

    fn charge_entry(&self) {
        self.used.lock().unwrap_or_else(|p| p.into_inner()).1 += 1
    }
}

fn file_len(d: &Descriptor) -> Result<(Arc<std::fs::File>, u64), ErrorCode> {
    match d {
        Descriptor::File(f) => {
            let len = f.file.metadata().map_err(ErrorCode::from)?.len();
            Ok((f.file.clone(), len))
        }
        Descriptor::Dir(_) => Err(ErrorCode::BadDescriptor),
    }
}

/// Where a wrapped stream writes.
enum Mode {
    At(u64),
    Append,
}
/// An output stream into a file, charged to its folder's quota.
struct QuotaStream {
    inner: DynOutputStream,
    file: Arc<std::fs::File>,
    mode: Mode,
    quota: Arc<Quota>,
    /// Writes go straight to `file` on the calling thread, not through
    /// `inner` (which hands each to a blocking pool and back): see
    /// [`PluginState::new`](super::sandbox::PluginState::new).
    on_thread: bool,
}

fn stream_nospc() -> StreamError {
    StreamError::LastOperationFailed(std::io::Error::from_raw_os_error(libc::ENOSPC).into())
}

impl QuotaStream {
    fn growth(&self, n: u64) -> u64 {
        match self.mode {
            Mode::Append => n,
            // Past the end, the gap counts too (a sparse file is charged
            // its length).
            Mode::At(pos) => {
                let len = self.file.metadata().map(|m| m.len()).unwrap_or(0);
                pos.saturating_add(n).saturating_sub(len)
            }
        }
    }
    fn charge(&mut self, n: usize) -> StreamResult<()> {
        let g = self.growth(n as u64);
        self.quota.charge_bytes(g).map_err(|_| stream_nospc())?;
        if let Mode::At(p) = &mut self.mode {
            *p = p.saturating_add(n as u64)
        }
        Ok(())
    }
    /// Charges `bytes`, then writes them: on this thread, or through `inner`.
    fn charge_and_write(&mut self, bytes: Bytes) -> StreamResult<Option<Bytes>> {
        let at = match self.mode {
            Mode::At(pos) => Some(pos),
            Mode::Append => None,
        };
        self.charge(bytes.len())?;
        if !self.on_thread {
            return Ok(Some(bytes));
        }
        use std::os::unix::fs::FileExt;
        let failed = |e: std::io::Error| StreamError::LastOperationFailed(e.into());
        // Appending: at the end (pwrite on a file opened to append writes
        // there anyway).
        let at = match at {
            Some(pos) => pos,
            None => self.file.metadata().map_err(failed)?.len(),
        };
        self.file.write_all_at(&bytes, at).map_err(failed)?;
        Ok(None)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for QuotaStream {
    async fn ready(&mut self) {
        self.inner.ready().await
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for QuotaStream {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        match self.charge_and_write(bytes)? {
            Some(bytes) => self.inner.write(bytes),
            None => Ok(()),
        }
    }
    fn flush(&mut self) -> StreamResult<()> {
        self.inner.flush()
    }
    fn check_write(&mut self) -> StreamResult<usize> {
        let n = self.inner.check_write()?;
        if n == 0 {
            return Ok(0);
        }
        let free_overwrite = match self.mode {
            Mode::At(pos) => self
                .file
                .metadata()
                .map(|m| m.len())
                .unwrap_or(0)
                .saturating_sub(pos),
            Mode::Append => 0,
        };
        // Never fail here (a flush waits on check-write); clamp so a write ends
        // exactly at the limit, and let the next write() report ENOSPC.
        let room = self.quota.room(1).saturating_add(free_overwrite);
        if room == 0 {
            return Ok(n);
        }
        Ok(n.min(usize::try_from(room).unwrap_or(usize::MAX)))
    }
    async fn blocking_write_and_flush(&mut self, bytes: Bytes) -> StreamResult<()> {
        match self.charge_and_write(bytes)? {
            Some(bytes) => self.inner.blocking_write_and_flush(bytes).await,
            None => Ok(()),
        }
    }
    async fn cancel(&mut self) {
        self.inner.cancel().await
    }
}

/// wasmtime-wasi's filesystem with a quota on the one folder a plugin
/// reaches (none: passed through unchanged).
pub struct QuotaFs<'a> {
    /// wasmtime-wasi's filesystem of the store.
    pub fs: WasiFilesystemCtxView<'a>,
    /// The quota of the folder it reaches, if any.
    pub quota: Option<Arc<Quota>>,
    /// Whether stream writes may block the calling thread.
    pub on_thread: bool,
}
/// [`QuotaFs`] for the linker.
pub struct HasQuotaFs;
impl HasData for HasQuotaFs {
    type Data<'a> = QuotaFs<'a>;
}

impl QuotaFs<'_> {
    fn wrap(
        &mut self,
        s: Resource<DynOutputStream>,
        file: Arc<std::fs::File>,
        mode: Mode,
        quota: Arc<Quota>,
    ) -> FsResult<Resource<DynOutputStream>> {
        let inner = self.fs.table.delete(s)?;
        Ok(self.fs.table.push(Box::new(QuotaStream {
            inner,
            file,
            mode,
            quota,
            on_thread: self.on_thread,
        }) as DynOutputStream)?)
    }
    fn new_entry(&self) -> Result<(), ErrorCode> {
        match &self.quota {
            Some(q) if !q.entry_room() => Err(nospc()),
            _ => Ok(()),
        }
    }
    fn count_entry(&self) {
        if let Some(q) = &self.quota {
            q.charge_entry()
        }
    }
}

impl types::Host for QuotaFs<'_> {
    fn convert_error_code(&mut self, err: FsError) -> wasmtime::Result<ErrorCode> {
        types::Host::convert_error_code(&mut self.fs, err)
    }
    fn filesystem_error_code(
        &mut self,
        err: Resource<wasmtime::Error>,
    ) -> wasmtime::Result<Option<ErrorCode>> {
        types::Host::filesystem_error_code(&mut self.fs, err)
    }
}

impl HostDescriptor for QuotaFs<'_> {
    // ---- write paths (checked)
    async fn write(
        &mut self,
        fd: Resource<types::Descriptor>,
        mut buf: Vec<u8>,
        offset: types::Filesize,
    ) -> FsResult<types::Filesize> {
        if let Some(q) = self.quota.clone() {
            let (_, len) = file_len(self.fs.table.get(&fd)?)?;
            // What the file grows by, the gap before `offset` included (a
            // sparse file is charged its length).
            let growth = offset.saturating_add(buf.len() as u64).saturating_sub(len);
            if growth > 0 && q.room(growth) < growth {
                // Write what fits: the part over existing bytes, then room.
                let room = q.room(growth);
                let allowed = match offset >= len {
                    true => room.saturating_sub(offset - len),
                    false => (len - offset).saturating_add(room),
                };
                if allowed == 0 {
                    return Err(nospc().into());
                }
                buf.truncate(allowed.min(buf.len() as u64) as usize);
            }
            q.charge_bytes(offset.saturating_add(buf.len() as u64).saturating_sub(len))?;
        }
        HostDescriptor::write(&mut self.fs, fd, buf, offset).await
    }
    fn write_via_stream(
        &mut self,
        fd: Resource<types::Descriptor>,
        offset: types::Filesize,
    ) -> FsResult<Resource<DynOutputStream>> {
        let Some(q) = self.quota.clone() else {
            return HostDescriptor::write_via_stream(&mut self.fs, fd, offset);
        };
        let (file, len) = file_len(self.fs.table.get(&fd)?)?;
        // Already full and this stream can only grow the file: say ENOSPC now,
        // as an error-code (libc maps stream errors to EIO).
        if offset >= len && q.room(1) == 0 {
            return Err(nospc().into());
        }
        let s = HostDescriptor::write_via_stream(&mut self.fs, fd, offset)?;
        self.wrap(s, file, Mode::At(offset), q)
    }
    fn append_via_stream(
        &mut self,
        fd: Resource<types::Descriptor>,
    ) -> FsResult<Resource<DynOutputStream>> {
        let Some(q) = self.quota.clone() else {
            return HostDescriptor::append_via_stream(&mut self.fs, fd);
        };
        let (file, _) = file_len(self.fs.table.get(&fd)?)?;
        if q.room(1) == 0 {
            return Err(nospc().into());
        }
        let s = HostDescriptor::append_via_stream(&mut self.fs, fd)?;
        self.wrap(s, file, Mode::Append, q)
    }
    async fn set_size(
        &mut self,
        fd: Resource<types::Descriptor>,
        size: types::Filesize,
    ) -> FsResult<()> {
        if let Some(q) = self.quota.clone() {
            let (_, len) = file_len(self.fs.table.get(&fd)?)?;
            q.charge_bytes(size.saturating_sub(len))?;
        }
        HostDescriptor::set_size(&mut self.fs, fd, size).await
    }
    async fn open_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        path_flags: types::PathFlags,
        path: String,
        oflags: types::OpenFlags,
        flags: types::DescriptorFlags,
    ) -> FsResult<Resource<types::Descriptor>> {
        let create = oflags.contains(types::OpenFlags::CREATE);
        if create && self.new_entry().is_err() {
            // At the limit: only an already existing file may be opened.
            let fd2 = Resource::new_borrow(fd.rep());
            if HostDescriptor::stat_at(&mut self.fs, fd2, path_flags, path.clone())
                .await
                .is_err()
            {
                return Err(nospc().into());
            }
            return HostDescriptor::open_at(&mut self.fs, fd, path_flags, path, oflags, flags)
                .await;
        }
        let r = HostDescriptor::open_at(&mut self.fs, fd, path_flags, path, oflags, flags).await?;
        if create {
            self.count_entry()
        } // may over-count an existing file; a rescan corrects it
        Ok(r)
    }
    async fn create_directory_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        path: String,
    ) -> FsResult<()> {
        self.new_entry()?;
        HostDescriptor::create_directory_at(&mut self.fs, fd, path).await?;
        self.count_entry();
        Ok(())
    }
    async fn symlink_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        old: String,
        new: String,
    ) -> FsResult<()> {
        self.new_entry()?;
        HostDescriptor::symlink_at(&mut self.fs, fd, old, new).await?;
        self.count_entry();
        Ok(())
    }
    async fn link_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        of: types::PathFlags,
        op: String,
        nd: Resource<types::Descriptor>,
        np: String,
    ) -> FsResult<()> {
        self.new_entry()?;
        HostDescriptor::link_at(&mut self.fs, fd, of, op, nd, np).await?;
        self.count_entry();
        Ok(())
    }
    // ---- everything else: plain delegation
    async fn advise(
        &mut self,
        fd: Resource<types::Descriptor>,
        o: types::Filesize,
        l: types::Filesize,
        a: types::Advice,
    ) -> FsResult<()> {
        HostDescriptor::advise(&mut self.fs, fd, o, l, a).await
    }
    async fn sync_data(&mut self, fd: Resource<types::Descriptor>) -> FsResult<()> {
        HostDescriptor::sync_data(&mut self.fs, fd).await
    }
    async fn get_flags(
        &mut self,
        fd: Resource<types::Descriptor>,
    ) -> FsResult<types::DescriptorFlags> {
        HostDescriptor::get_flags(&mut self.fs, fd).await
    }
    async fn get_type(
        &mut self,
        fd: Resource<types::Descriptor>,
    ) -> FsResult<types::DescriptorType> {
        HostDescriptor::get_type(&mut self.fs, fd).await
    }
    async fn set_times(
        &mut self,
        fd: Resource<types::Descriptor>,
        a: types::NewTimestamp,
        m: types::NewTimestamp,
    ) -> FsResult<()> {
        HostDescriptor::set_times(&mut self.fs, fd, a, m).await
    }
    async fn read(
        &mut self,
        fd: Resource<types::Descriptor>,
        l: types::Filesize,
        o: types::Filesize,
    ) -> FsResult<(Vec<u8>, bool)> {
        HostDescriptor::read(&mut self.fs, fd, l, o).await
    }
    async fn read_directory(
        &mut self,
        fd: Resource<types::Descriptor>,
    ) -> FsResult<Resource<types::DirectoryEntryStream>> {
        HostDescriptor::read_directory(&mut self.fs, fd).await
    }
    async fn sync(&mut self, fd: Resource<types::Descriptor>) -> FsResult<()> {
        HostDescriptor::sync(&mut self.fs, fd).await
    }
    async fn stat(&mut self, fd: Resource<types::Descriptor>) -> FsResult<types::DescriptorStat> {
        HostDescriptor::stat(&mut self.fs, fd).await
    }
    async fn stat_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        f: types::PathFlags,
        p: String,
    ) -> FsResult<types::DescriptorStat> {
        HostDescriptor::stat_at(&mut self.fs, fd, f, p).await
    }
    async fn set_times_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        f: types::PathFlags,
        p: String,
        a: types::NewTimestamp,
        m: types::NewTimestamp,
    ) -> FsResult<()> {
        HostDescriptor::set_times_at(&mut self.fs, fd, f, p, a, m).await
    }
    fn drop(&mut self, fd: Resource<types::Descriptor>) -> wasmtime::Result<()> {
        HostDescriptor::drop(&mut self.fs, fd)
    }
    async fn readlink_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        p: String,
    ) -> FsResult<String> {
        HostDescriptor::readlink_at(&mut self.fs, fd, p).await
    }
    async fn remove_directory_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        p: String,
    ) -> FsResult<()> {
        HostDescriptor::remove_directory_at(&mut self.fs, fd, p).await
    }
    async fn rename_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        op: String,
        nd: Resource<types::Descriptor>,
        np: String,
    ) -> FsResult<()> {
        HostDescriptor::rename_at(&mut self.fs, fd, op, nd, np).await
    }
    async fn unlink_file_at(&mut self, fd: Resource<types::Descriptor>, p: String) -> FsResult<()> {
        HostDescriptor::unlink_file_at(&mut self.fs, fd, p).await
    }
    fn read_via_stream(
        &mut self,
        fd: Resource<types::Descriptor>,
        o: types::Filesize,
    ) -> FsResult<Resource<wasmtime_wasi::p2::DynInputStream>> {
        HostDescriptor::read_via_stream(&mut self.fs, fd, o)
    }
    async fn is_same_object(
        &mut self,
        a: Resource<types::Descriptor>,
        b: Resource<types::Descriptor>,
    ) -> wasmtime::Result<bool> {
        HostDescriptor::is_same_object(&mut self.fs, a, b).await
    }
    async fn metadata_hash(
        &mut self,
        fd: Resource<types::Descriptor>,
    ) -> FsResult<types::MetadataHashValue> {
        HostDescriptor::metadata_hash(&mut self.fs, fd).await
    }
    async fn metadata_hash_at(
        &mut self,
        fd: Resource<types::Descriptor>,
        f: types::PathFlags,
        p: String,
    ) -> FsResult<types::MetadataHashValue> {
        HostDescriptor::metadata_hash_at(&mut self.fs, fd, f, p).await
    }
}

impl HostDirectoryEntryStream for QuotaFs<'_> {
    async fn read_directory_entry(
        &mut self,
        s: Resource<types::DirectoryEntryStream>,
    ) -> FsResult<Option<types::DirectoryEntry>> {
        HostDirectoryEntryStream::read_directory_entry(&mut self.fs, s).await
    }
    fn drop(&mut self, s: Resource<types::DirectoryEntryStream>) -> wasmtime::Result<()> {
        HostDirectoryEntryStream::drop(&mut self.fs, s)
    }
}
