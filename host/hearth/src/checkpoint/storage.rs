//! When storage refuses a checkpoint: a full file system (`ENOSPC`), a
//! used-up quota (`EDQUOT`), a file over the process's size limit
//! (`EFBIG`, `ulimit -f`) or a failing disk (`EIO`). Such a failure is
//! reported with the file system it happened on (its mount point and
//! kind, from `/proc/self/mountinfo`), the bytes the save needed and
//! those free when it began, instead of a bare "failed to access".

use super::CheckpointError;
use std::path::{Path, PathBuf};

/// A file system: where it is mounted, its kind, and its free bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSystem {
    /// Its mount point.
    pub mount: PathBuf,
    /// Its kind (`ext4`, `tmpfs`, `nfs4`, …).
    pub kind: String,
    /// Bytes an unprivileged writer may still use.
    pub free: u64,
}

impl FileSystem {
    /// The file system holding `path` (or its nearest existing ancestor).
    pub fn of(path: &Path) -> Option<Self> {
        let existing = path.ancestors().find(|p| p.exists())?;
        let real = existing.canonicalize().ok()?;
        let stat = rustix::fs::statvfs(&real).ok()?;
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let (mount, kind) = mount_of(&real, &mountinfo)
            .unwrap_or_else(|| (PathBuf::from("/"), "unknown".to_string()));
        Some(Self {
            mount,
            kind,
            free: stat.f_bavail.saturating_mul(stat.f_frsize),
        })
    }
}

impl std::fmt::Display for FileSystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.mount.display(), self.kind)
    }
}

/// The mount point and kind of the file system holding `path` (canonical):
/// the longest mount point in `mountinfo` that contains it.
fn mount_of(path: &Path, mountinfo: &str) -> Option<(PathBuf, String)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            // ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [OPTIONAL…] - KIND SOURCE SUPER-OPTIONS
            let (before, after) = line.split_once(" - ")?;
            let mount = unescape(before.split(' ').nth(4)?);
            let kind = after.split(' ').next()?.to_string();
            Some((PathBuf::from(mount), kind))
        })
        .filter(|(mount, _)| path.starts_with(mount))
        // The last of equally long ones: a later mount hides an earlier one.
        .fold(None, |best: Option<(PathBuf, String)>, m| match &best {
            Some((b, _)) if b.as_os_str().len() > m.0.as_os_str().len() => best,
            _ => Some(m),
        })
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            std::str::from_utf8(d)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What refused a write, as a clause of a sentence; `None` for errors that
/// are not the storage's.
fn refusal(error: &std::io::Error, fs: &str) -> Option<String> {
    Some(match error.raw_os_error()? {
        libc::ENOSPC => format!("the file system at {fs} is full"),
        libc::EDQUOT => format!("your disk quota on the file system at {fs} is used up"),
        libc::EFBIG => {
            let limit = rustix::process::getrlimit(rustix::process::Resource::Fsize)
                .current
                .map_or("none".to_string(), |l| format!("{} bytes", l));
            format!("a file would pass the largest file this process may write (`ulimit -f`: {limit})")
        }
        libc::EIO => format!(
            "the file system at {fs} reported an I/O error (its disk or network storage may be failing)"
        ),
        _ => return None,
    })
}

/// Bytes in words: `12.3 MB`.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "kB", "MB", "GB", "TB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A save of checkpoint `dest` that needs about `needed` bytes, with the
/// file system as it was when it began (see [`FileSystem::of`]).
pub(crate) struct SaveSpace<'a> {
    /// The checkpoint.
    pub dest: &'a Path,
    /// Bytes this process writes for it.
    pub needed: u64,
    /// Its file system when the save began.
    pub before: Option<FileSystem>,
}

impl SaveSpace<'_> {
    /// Measures the file system of `dest` now.
    pub(crate) fn begin(dest: &Path, needed: u64) -> SaveSpace<'_> {
        SaveSpace {
            dest,
            needed,
            before: FileSystem::of(dest),
        }
    }

    /// `error`, told as storage's refusal when it is one (see the module
    /// documentation); other errors unchanged.
    pub(crate) fn explain(&self, error: CheckpointError) -> CheckpointError {
        let CheckpointError::Io { path, source } = &error else {
            return error;
        };
        let fs = self
            .before
            .clone()
            .or_else(|| FileSystem::of(self.dest))
            .map_or_else(|| "?".to_string(), |fs| fs.to_string());
        let Some(why) = refusal(source, &fs) else {
            return error;
        };
        // Free space matters to a full disk or quota, not to a size limit
        // or a failing disk.
        let space_ran_out = matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT));
        let free = match &self.before {
            Some(b) if space_ran_out => {
                format!(", {} were free when it began", human_bytes(b.free))
            }
            _ => String::new(),
        };
        let message = format!(
            "checkpoint {} was not saved: writing {} failed because {why} ({source}). \
             The save needed about {}{free}. Any previous checkpoint is untouched and the \
             partial folder was removed; free space there, keep fewer checkpoints \
             (`[run] keep-checkpoints`), or save to a larger file system (`[run] output-dir`)",
            self.dest.display(),
            path.display(),
            human_bytes(self.needed),
        );
        CheckpointError::Storage {
            path: self.dest.to_path_buf(),
            message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:25 / /mnt/small rw shared:2 - tmpfs none rw,size=2048k
31 22 0:26 / /mnt/small\\040disk rw - xfs /dev/sdb1 rw
32 30 0:27 / /mnt/small/inner rw - nfs4 server:/x rw
";

    #[test]
    fn the_longest_mount_point_holding_the_path_is_its_file_system() {
        let of = |p: &str| mount_of(Path::new(p), MOUNTINFO).unwrap();
        assert_eq!(of("/home/x"), ("/".into(), "ext4".into()));
        assert_eq!(
            of("/mnt/small/run/ckpt"),
            ("/mnt/small".into(), "tmpfs".into())
        );
        assert_eq!(
            of("/mnt/small disk/a"),
            ("/mnt/small disk".into(), "xfs".into())
        );
        assert_eq!(
            of("/mnt/small/inner/a"),
            ("/mnt/small/inner".into(), "nfs4".into())
        );
        // Component-wise: /mnt/smaller is not under /mnt/small.
        assert_eq!(of("/mnt/smaller"), ("/".into(), "ext4".into()));
    }

    #[test]
    fn storage_refusals_are_told_with_the_file_system_and_the_bytes() {
        let space = SaveSpace {
            dest: Path::new("/mnt/small/checkpoint_2"),
            needed: 12_345_678,
            before: Some(FileSystem {
                mount: "/mnt/small".into(),
                kind: "tmpfs".into(),
                free: 2_000_000,
            }),
        };
        let io = |errno| CheckpointError::Io {
            path: "/mnt/small/.checkpoint_2.tmp-1/model.safetensors".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        let full = space.explain(io(libc::ENOSPC)).to_string();
        for part in [
            "/mnt/small (tmpfs) is full",
            "12.3 MB",
            "2.0 MB were free",
            "model.safetensors",
            "untouched",
        ] {
            assert!(full.contains(part), "{part:?} not in {full}");
        }
        assert!(space
            .explain(io(libc::EDQUOT))
            .to_string()
            .contains("quota"));
        assert!(space
            .explain(io(libc::EIO))
            .to_string()
            .contains("I/O error"));
        assert!(space
            .explain(io(libc::EFBIG))
            .to_string()
            .contains("ulimit -f"));
        // Not storage's: unchanged.
        let denied = space.explain(io(libc::EACCES));
        assert!(matches!(denied, CheckpointError::Io { .. }), "{denied}");
    }

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(human_bytes(999), "999 bytes");
        assert_eq!(human_bytes(1_500), "1.5 kB");
        assert_eq!(human_bytes(3_210_000_000), "3.2 GB");
    }
}
