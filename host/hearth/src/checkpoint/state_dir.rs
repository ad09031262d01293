//! Checkpoint folders that are complete or absent: a save is written into a
//! hidden temporary folder beside its destination, every file fsynced, a
//! manifest (`hearth_checkpoint.json`: names, sizes and content hashes)
//! written last, and the folder renamed into place. A folder without a valid manifest is
//! incomplete and never loaded. Numbered checkpoints
//! (`checkpoints/checkpoint_<n>`) are listed, rotated and found here.

use super::safetensors_io::{save_safetensors, CheckpointError};
use hearth_ops::durable::write_atomically;
use serde::{Deserialize, Serialize};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use tch::Tensor;

/// The manifest that marks a checkpoint folder complete.
pub const MANIFEST_NAME: &str = "hearth_checkpoint.json";

/// What `hearth_checkpoint.json` records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Layout version (1).
    pub version: u32,
    /// Every file of the checkpoint with its size in bytes (files that
    /// checkpoint hooks wrote included).
    pub files: Vec<ManifestFile>,
    /// The checkpoint hooks that ran, in order, and the tensors each saved
    /// itself (left out of the model files; loading needs that hook).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<HookRecord>,
}

pub use hearth_ops::tensor::TensorKey;

/// A checkpoint hook that ran for a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HookRecord {
    /// The plugin's name.
    pub name: String,
    /// The tensors it saved itself.
    #[serde(default)]
    pub claimed: Vec<TensorKey>,
}

/// One file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Name inside the folder.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Its content hash (xxh3-64, 16 hex digits; [`super::digest`]),
    /// computed while it was written. Absent in checkpoints of a hearth
    /// before hashes: those load on their sizes alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh3: Option<String>,
}

/// What an entry of a folder being written is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryKind {
    File,
    Dir,
    /// A symbolic link, a socket, …
    Other,
}

/// One entry of a folder being written.
struct Entry {
    /// Its path relative to the folder, `/`-separated.
    name: String,
    path: PathBuf,
    kind: EntryKind,
}

/// A checkpoint being written; [`commit`](Self::commit) puts it in place.
/// Dropped without commit, it removes its temporary folder.
pub struct StagedCheckpoint {
    tmp: PathBuf,
    dest: PathBuf,
    files: Vec<ManifestFile>,
    hooks: Vec<HookRecord>,
    committed: bool,
}

impl StagedCheckpoint {
    /// Starts a checkpoint that will become `dest`, which must not exist.
    pub fn begin(dest: &Path) -> Result<Self, CheckpointError> {
        if dest.exists() {
            return Err(CheckpointError::Exists(dest.into()));
        }
        let parent = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        fs::create_dir_all(parent).map_err(CheckpointError::io(parent))?;
        let name = dest
            .file_name()
            .ok_or_else(|| CheckpointError::Exists(dest.into()))?
            .to_string_lossy();
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(CheckpointError::io(&tmp))?;
        }
        fs::create_dir(&tmp).map_err(CheckpointError::io(&tmp))?;
        Ok(Self {
            tmp,
            dest: dest.into(),
            files: Vec::new(),
            hooks: Vec::new(),
            committed: false,
        })
    }

    fn record(&mut self, name: &str, xxh3: Option<String>) -> Result<(), CheckpointError> {
        let path = self.tmp.join(name);
        let size = fs::metadata(&path)
            .map_err(CheckpointError::io(&path))?
            .len();
        self.files.push(ManifestFile {
            name: name.into(),
            size,
            xxh3,
        });
        Ok(())
    }

    /// Writes named tensors as `name` (safetensors).
    pub fn tensors(
        &mut self,
        name: &str,
        tensors: &[(String, Tensor)],
    ) -> Result<(), CheckpointError> {
        let xxh3 = save_safetensors(&self.tmp.join(name), tensors)?;
        self.record(name, xxh3)
    }

    /// Records `name`, written into the folder by this process or another
    /// one (its own part of the checkpoint) with content hash `xxh3`, as
    /// hearth's.
    pub fn adopt(&mut self, name: &str, xxh3: Option<String>) -> Result<(), CheckpointError> {
        self.record(name, xxh3)
    }

    /// Writes raw bytes as `name`.
    pub fn bytes(&mut self, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
        let path = self.tmp.join(name);
        write_atomically(&path, |f| f.write_all(bytes)).map_err(CheckpointError::io(&path))?;
        self.record(name, super::digest::recorded(bytes))
    }

    /// Writes `value` as pretty JSON in `name`.
    pub fn json<T: Serialize>(&mut self, name: &str, value: &T) -> Result<(), CheckpointError> {
        let text = serde_json::to_vec_pretty(value).expect("checkpoint JSON serialises");
        self.bytes(name, &text)
    }

    /// The temporary folder being written (what a checkpoint hook sees).
    pub fn folder(&self) -> &Path {
        &self.tmp
    }

    /// The checkpoint it will become.
    pub fn destination(&self) -> &Path {
        &self.dest
    }

    /// Records that checkpoint hook `name` ran and saved `claimed` itself.
    pub fn record_hook(&mut self, name: &str, claimed: Vec<TensorKey>) {
        self.hooks.push(HookRecord {
            name: name.into(),
            claimed,
        });
    }

    /// Checks what others (the checkpoint hook that just ran) left in the
    /// folder: files and folders only (a link could make hearth write
    /// through it), nothing under a name hearth writes itself (`reserved`,
    /// the manifest, hidden temporaries), and every file hearth already
    /// wrote still there with its size. Says what is wrong.
    pub fn check_foreign(&self, reserved: &[String]) -> Result<(), String> {
        let entries = self
            .entries()
            .map_err(|e| format!("{}: {e}", self.tmp.display()))?;
        for entry in entries {
            let name = &entry.name;
            if entry.kind == EntryKind::Other {
                return Err(format!(
                    "left `{name}`, which is not a file or folder (a symbolic link?); checkpoints hold files and folders only"
                ));
            }
            let hearths = name == MANIFEST_NAME
                || (!name.contains('/') && name.starts_with('.'))
                || reserved.contains(name);
            if hearths {
                return Err(format!("left `{name}`, a name hearth writes itself"));
            }
        }
        for f in &self.files {
            match fs::symlink_metadata(self.tmp.join(&f.name)) {
                Ok(m) if m.is_file() && m.len() == f.size => {}
                _ => {
                    return Err(format!(
                        "changed or removed `{}`, which hearth wrote",
                        f.name
                    ))
                }
            }
        }
        Ok(())
    }

    /// Everything in the folder, recursively, by path relative to it
    /// (`/`-separated), each folder before its contents.
    fn entries(&self) -> std::io::Result<Vec<Entry>> {
        let mut out = Vec::new();
        let mut pending = vec![(self.tmp.clone(), String::new())];
        while let Some((dir, prefix)) = pending.pop() {
            let mut listed = fs::read_dir(&dir)?.collect::<Result<Vec<_>, _>>()?;
            listed.sort_by_key(|e| e.file_name());
            for entry in listed {
                let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
                let kind = match entry.file_type()? {
                    t if t.is_dir() => EntryKind::Dir,
                    t if t.is_file() => EntryKind::File,
                    _ => EntryKind::Other,
                };
                if kind == EntryKind::Dir {
                    pending.push((entry.path(), format!("{name}/")));
                }
                out.push(Entry {
                    name,
                    path: entry.path(),
                    kind,
                });
            }
        }
        Ok(out)
    }

    /// Fsyncs and records the files that others (checkpoint hooks) wrote
    /// into the folder. Anything but files and folders — a symbolic link —
    /// fails the save: host tools would follow it out of the checkpoint.
    fn adopt_others(&mut self) -> Result<(), CheckpointError> {
        let known: std::collections::HashSet<String> =
            self.files.iter().map(|f| f.name.clone()).collect();
        let entries = self.entries().map_err(CheckpointError::io(&self.tmp))?;
        for entry in entries {
            match entry.kind {
                EntryKind::Dir => File::open(&entry.path)
                    .and_then(|d| d.sync_all())
                    .map_err(CheckpointError::io(&entry.path))?,
                EntryKind::File if known.contains(&entry.name) => {}
                EntryKind::File => {
                    File::open(&entry.path)
                        .and_then(|f| f.sync_all())
                        .map_err(CheckpointError::io(&entry.path))?;
                    // A hook's file: hearth never saw its bytes, so it
                    // reads them once (hooks' files are small).
                    let xxh3 = match super::digest::enabled() {
                        true => Some(
                            super::digest::of_file(&entry.path)
                                .map_err(CheckpointError::io(&entry.path))?,
                        ),
                        false => None,
                    };
                    self.record(&entry.name, xxh3)?;
                }
                EntryKind::Other => {
                    return Err(CheckpointError::State {
                        path: entry.path,
                        message: "a checkpoint hook left something that is not a file or folder (a symbolic link?); checkpoints hold files and folders only".into(),
                    })
                }
            }
        }
        Ok(())
    }

    /// Writes the manifest and renames the folder into place; returns it.
    pub fn commit(mut self) -> Result<PathBuf, CheckpointError> {
        self.adopt_others()?;
        let manifest = Manifest {
            version: 1,
            files: std::mem::take(&mut self.files),
            hooks: std::mem::take(&mut self.hooks),
        };
        let path = self.tmp.join(MANIFEST_NAME);
        let text = serde_json::to_vec_pretty(&manifest).expect("manifest serialises");
        write_atomically(&path, |f| f.write_all(&text)).map_err(CheckpointError::io(&path))?;
        File::open(&self.tmp)
            .and_then(|d| d.sync_all())
            .map_err(CheckpointError::io(&self.tmp))?;
        if self.dest.exists() {
            return Err(CheckpointError::Exists(self.dest.clone()));
        }
        fs::rename(&self.tmp, &self.dest).map_err(CheckpointError::io(&self.dest))?;
        let parent = self.dest.parent().unwrap_or(Path::new("."));
        File::open(parent)
            .and_then(|d| d.sync_all())
            .map_err(CheckpointError::io(parent))?;
        self.committed = true;
        remove_abandoned(parent);
        Ok(self.dest.clone())
    }
}

impl Drop for StagedCheckpoint {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Removes the temporary folders that saves killed before their commit,
/// and rotations killed while deleting, left in `folder`
/// (`.<name>.tmp-<pid>` and `.<name>.removing-<pid>` of processes no
/// longer running).
pub fn remove_abandoned(folder: &Path) {
    if !Path::new("/proc/self").exists() {
        return; // cannot tell whether a writer is still alive
    }
    for entry in fs::read_dir(folder).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .starts_with('.')
            .then(|| {
                name.rsplit_once(".tmp-")
                    .or_else(|| name.rsplit_once(".removing-"))
            })
            .flatten()
            .and_then(|(_, pid)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// Reads and checks the manifest of `dir`: every file it names is there
/// with its recorded size. An error says why the folder is not a complete
/// checkpoint.
pub fn verify_complete(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST_NAME);
    let incomplete = |why: String| CheckpointError::Incomplete {
        path: dir.into(),
        why,
    };
    let text = fs::read(&path).map_err(|_| incomplete(format!("it has no {MANIFEST_NAME}")))?;
    let manifest: Manifest = serde_json::from_slice(&text)
        .map_err(|e| incomplete(format!("{MANIFEST_NAME} is unreadable: {e}")))?;
    for f in &manifest.files {
        match fs::metadata(dir.join(&f.name)) {
            Ok(m) if m.len() == f.size => {}
            Ok(m) => {
                return Err(incomplete(format!(
                    "{} has {} bytes, the manifest says {}",
                    f.name,
                    m.len(),
                    f.size
                )))
            }
            Err(_) => return Err(incomplete(format!("{} is missing", f.name))),
        }
    }
    Ok(manifest)
}

/// Checks every file of `dir` against the content hash `manifest`
/// records for it (one read of each file). A file whose bytes changed —
/// a flipped bit on the disk, in memory or on the way — is an error
/// naming it and the checkpoint. A checkpoint without hashes (a hearth
/// before them, or `HEARTH_CHECKPOINT_HASHES=off`, wrote it) passes, said
/// once per process; with hashes off nothing is checked.
pub fn verify_contents(dir: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
    if !super::digest::enabled() {
        return Ok(());
    }
    if manifest.files.iter().all(|f| f.xxh3.is_none()) && !manifest.files.is_empty() {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::warn!(
                "{} records no content hashes (written by a hearth before them, or with \
                 HEARTH_CHECKPOINT_HASHES=off): its files are checked by size only",
                dir.display()
            )
        });
        return Ok(());
    }
    for f in &manifest.files {
        let Some(expected) = &f.xxh3 else { continue };
        let path = dir.join(&f.name);
        let actual = super::digest::of_file(&path).map_err(CheckpointError::io(&path))?;
        if &actual != expected {
            return Err(CheckpointError::Damaged {
                path: dir.into(),
                why: format!(
                    "{} has changed since it was written (content hash {actual}, the manifest \
                     recorded {expected})",
                    f.name
                ),
            });
        }
    }
    Ok(())
}

/// [`verify_complete`] and [`verify_contents`]: the manifest, every file
/// at its size, and every file's bytes as they were written.
pub fn verify_intact(dir: &Path) -> Result<Manifest, CheckpointError> {
    let manifest = verify_complete(dir)?;
    verify_contents(dir, &manifest)?;
    Ok(manifest)
}

/// The numbered checkpoints `checkpoint_<n>` in `folder`, by number.
pub fn numbered_checkpoints(folder: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = fs::read_dir(folder)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("checkpoint_")?.parse().ok()?;
            e.path().is_dir().then(|| (n, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// The newest complete numbered checkpoint in `folder`; newer incomplete
/// ones are skipped with a warning.
pub fn newest_complete(folder: &Path) -> Option<(u64, PathBuf)> {
    newest_passing(folder, verify_complete)
}

/// The newest numbered checkpoint in `folder` that is complete and whose
/// files hash as they did when written (what a resume starts from), and
/// the newer ones skipped, each with a warning that says why.
pub fn newest_intact(folder: &Path) -> (Option<(u64, PathBuf)>, Vec<PathBuf>) {
    let mut skipped = Vec::new();
    for (n, dir) in numbered_checkpoints(folder).into_iter().rev() {
        match verify_intact(&dir) {
            Ok(_) => return (Some((n, dir)), skipped),
            Err(e) => {
                tracing::warn!("skipping checkpoint: {e}");
                skipped.push(dir);
            }
        }
    }
    (None, skipped)
}

fn newest_passing(
    folder: &Path,
    check: impl Fn(&Path) -> Result<Manifest, CheckpointError>,
) -> Option<(u64, PathBuf)> {
    for (n, dir) in numbered_checkpoints(folder).into_iter().rev() {
        match check(&dir) {
            Ok(_) => return Some((n, dir)),
            Err(e) => tracing::warn!("skipping checkpoint: {e}"),
        }
    }
    None
}

/// Moves a numbered checkpoint that a resume skipped (damaged or
/// incomplete) out of the numbering, to `checkpoint_<n>.damaged` beside
/// it (`.damaged-2`, … if taken), so that the resumed run's saves can take
/// its number; nothing in it is deleted. Returns where it went.
pub fn set_aside(dir: &Path) -> Result<PathBuf, CheckpointError> {
    set_aside_as(dir, "damaged")
}

/// Renames checkpoint `dir` to `<name>.<why>` (or `<name>.<why>-2`, …)
/// beside it, durably: it keeps its files and is never loaded again.
pub fn set_aside_as(dir: &Path, why: &str) -> Result<PathBuf, CheckpointError> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let parent = dir.parent().unwrap_or(Path::new("."));
    let to = (1..)
        .map(|i| match i {
            1 => parent.join(format!("{name}.{why}")),
            i => parent.join(format!("{name}.{why}-{i}")),
        })
        .find(|p| !p.exists())
        .expect("an unused name");
    fs::rename(dir, &to).map_err(CheckpointError::io(dir))?;
    File::open(parent)
        .and_then(|d| d.sync_all())
        .map_err(CheckpointError::io(parent))?;
    Ok(to)
}

/// Keeps the newest `limit` numbered checkpoints in `folder` (by number)
/// and removes the others. Each goes at once: it is renamed to a hidden
/// `.checkpoint_<n>.removing-<pid>` (the rename made durable) before its
/// files are deleted, so a process killed while deleting leaves no visible
/// half-deleted checkpoint; the next commit sweeps such leftovers. A folder
/// that cannot be removed does not stop the others: each is tried, as are
/// this process's own hidden leftovers of an earlier rotation, and the
/// first error is returned.
pub fn rotate(folder: &Path, limit: usize) -> Result<(), CheckpointError> {
    match rotate_with(folder, limit, |dir| fs::remove_dir_all(dir))
        .into_iter()
        .next()
    {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// [`rotate`] once a new checkpoint in `folder` has committed. A failure
/// there (an old folder that cannot be renamed or deleted) leaves the new
/// checkpoint complete, so it does not fail the save: it is logged as a
/// warning naming each folder and why, the other old folders still go, and
/// the next save's rotation tries the stuck ones again.
pub fn rotate_after_commit(folder: &Path, limit: usize) {
    rotate_after_commit_with(folder, limit, |dir| fs::remove_dir_all(dir));
}

/// [`rotate_after_commit`], deleting each hidden folder with `remove`;
/// returns the warning it logged, if any.
fn rotate_after_commit_with(
    folder: &Path,
    limit: usize,
    remove: impl FnMut(&Path) -> std::io::Result<()>,
) -> Option<String> {
    let errors = rotate_with(folder, limit, remove);
    if errors.is_empty() {
        return None;
    }
    let why: Vec<String> = errors.iter().map(with_causes).collect();
    let message = format!(
        "the checkpoint was saved, but {} of the old ones beyond total_limit = {limit} in {} \
         could not be removed ({}); a later save tries again",
        errors.len(),
        folder.display(),
        why.join("; ")
    );
    tracing::warn!("{message}");
    Some(message)
}

/// `e` and the errors under it, as one line.
fn with_causes(e: &CheckpointError) -> String {
    let mut line = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        line = format!("{line}: {cause}");
        source = cause.source();
    }
    line
}

/// [`rotate`], deleting each hidden folder with `remove`: every one is
/// tried, and the errors come back together (none: all gone).
fn rotate_with(
    folder: &Path,
    limit: usize,
    mut remove: impl FnMut(&Path) -> std::io::Result<()>,
) -> Vec<CheckpointError> {
    let mut errors = Vec::new();
    // This process's own leftovers, from a rotation whose deletion failed
    // (a dead process's go at the next commit: remove_abandoned). Saves
    // run one at a time, so none of them is being deleted now.
    let own = format!(".removing-{}", std::process::id());
    for entry in fs::read_dir(folder).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".checkpoint_") && name.ends_with(&own) {
            let path = entry.path();
            if let Err(e) = remove(&path) {
                errors.push(CheckpointError::io(&path)(e));
            }
        }
    }
    let all = numbered_checkpoints(folder);
    let excess = all.len().saturating_sub(limit);
    for (n, dir) in all.into_iter().take(excess) {
        let hidden = folder.join(format!(".checkpoint_{n}{own}"));
        if let Err(e) = fs::rename(&dir, &hidden) {
            errors.push(CheckpointError::io(&dir)(e));
            continue;
        }
        if let Err(e) = File::open(folder).and_then(|d| d.sync_all()) {
            errors.push(CheckpointError::io(folder)(e));
        }
        if let Err(e) = remove(&hidden) {
            errors.push(CheckpointError::io(&hidden)(e));
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checkpoints 0..n committed in `dir`.
    fn committed(dir: &Path, n: u64) {
        for n in 0..n {
            let mut staged = StagedCheckpoint::begin(&dir.join(format!("checkpoint_{n}"))).unwrap();
            staged.bytes("model.safetensors", &[7u8; 100]).unwrap();
            staged.commit().unwrap();
        }
    }

    fn visible(dir: &Path) -> Vec<u64> {
        numbered_checkpoints(dir).iter().map(|(n, _)| *n).collect()
    }

    /// A rotation that fails after a commit is a warning naming the
    /// folder, the limit and each cause, not an error; a folder that
    /// cannot be removed does not keep the others, and a later rotation
    /// removes this process's own half-deleted leftovers.
    #[test]
    fn a_rotation_failing_after_a_commit_is_a_warning_and_removes_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        committed(dir, 4);
        let mut calls = 0;
        let said = rotate_after_commit_with(dir, 1, |d| {
            calls += 1;
            if calls == 1 {
                return Err(std::io::Error::other("busy"));
            }
            fs::remove_dir_all(d)
        })
        .expect("the failure is reported");
        assert!(
            said.contains("1 of the old ones beyond total_limit = 1")
                && said.contains(&dir.display().to_string())
                && said.contains("busy"),
            "{said}"
        );
        assert_eq!(visible(dir), [3]);
        assert!(verify_complete(&dir.join("checkpoint_3")).is_ok());
        let own = dir.join(format!(".checkpoint_0.removing-{}", std::process::id()));
        assert!(own.exists(), "the folder that failed is left hidden");
        assert_eq!(
            rotate_after_commit_with(dir, 1, |d| fs::remove_dir_all(d)),
            None
        );
        assert!(!own.exists(), "and the next rotation removes it");
        assert_eq!(visible(dir), [3]);
    }

    #[test]
    fn a_rotation_killed_while_deleting_leaves_every_visible_checkpoint_complete() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        committed(dir, 4);
        // Each deletion dies after removing the manifest (as a SIGKILL
        // there would leave it).
        let errors = rotate_with(dir, 2, |d| {
            fs::remove_file(d.join(MANIFEST_NAME))?;
            Err(std::io::Error::other("killed"))
        });
        assert_eq!(errors.len(), 2);
        let visible_now = numbered_checkpoints(dir);
        assert_eq!(visible(dir), [2, 3]);
        for (_, d) in &visible_now {
            assert!(
                verify_complete(d).is_ok(),
                "{} is visible and incomplete",
                d.display()
            );
        }
        // The leftover of a dead process goes at the next commit.
        let leftover = dir.join(".checkpoint_0.removing-4999999");
        fs::rename(
            dir.join(format!(".checkpoint_0.removing-{}", std::process::id())),
            &leftover,
        )
        .unwrap();
        StagedCheckpoint::begin(&dir.join("checkpoint_4"))
            .unwrap()
            .commit()
            .unwrap();
        assert!(!leftover.exists());
        // This process's own goes at its next rotation.
        let own = dir.join(format!(".checkpoint_1.removing-{}", std::process::id()));
        assert!(own.exists());
        rotate(dir, 2).unwrap();
        assert!(!own.exists());
        assert_eq!(visible(dir), [3, 4]);
    }

    #[test]
    fn a_commit_removes_temporaries_of_dead_writers_only() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // pid 1 is alive; a pid above the kernel's limit never is.
        let alive = dir.join(".checkpoint_3.tmp-1");
        let dead = dir.join(".checkpoint_4.tmp-4999999");
        fs::create_dir(&alive).unwrap();
        fs::create_dir(&dead).unwrap();
        let staged = StagedCheckpoint::begin(&dir.join("checkpoint_5")).unwrap();
        let done = staged.commit().unwrap();
        assert!(verify_complete(&done).is_ok());
        assert!(alive.exists() && !dead.exists());
    }

    #[test]
    fn a_commit_records_files_others_wrote_and_refuses_links() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("project");
        let mut staged = StagedCheckpoint::begin(&dir.join("checkpoint_0")).unwrap();
        staged.bytes("own.bin", b"abc").unwrap();
        fs::create_dir(staged.folder().join("extra")).unwrap();
        fs::write(staged.folder().join("extra/hook.txt"), "12345").unwrap();
        staged.record_hook("h", vec![]);
        let done = staged.commit().unwrap();
        let manifest = verify_complete(&done).unwrap();
        let files: Vec<(&str, u64)> = manifest
            .files
            .iter()
            .map(|f| (f.name.as_str(), f.size))
            .collect();
        assert_eq!(files, [("own.bin", 3), ("extra/hook.txt", 5)]);
        assert_eq!(manifest.hooks[0].name, "h");
        fs::remove_file(done.join("extra/hook.txt")).unwrap();
        assert!(
            verify_complete(&done).is_err(),
            "a hook's file is checked too"
        );

        let staged = StagedCheckpoint::begin(&dir.join("checkpoint_1")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", staged.folder().join("passwd")).unwrap();
        let why = staged.check_foreign(&[]).unwrap_err();
        assert!(
            why.contains("`passwd`") && why.contains("symbolic link"),
            "{why}"
        );
        let err = staged.commit().unwrap_err().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        assert!(!dir.join("checkpoint_1").exists());
    }

    #[test]
    fn a_staged_checkpoint_dropped_before_commit_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("project");
        let mut staged = StagedCheckpoint::begin(&dir.join("checkpoint_0")).unwrap();
        staged.bytes("a.bin", b"abc").unwrap();
        drop(staged);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
    }
}
