//! Durable file writes shared by checkpoints and the plugin cache: write
//! beside, fsync, rename, fsync the folder.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

/// Writes `path` so that a reader sees either the old file or the complete
/// new one, never a torn write: the bytes go to a temporary file in the same
/// folder, are fsynced, and the file is renamed over `path`.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    replace_atomically(path, |tmp| {
        // create_new: never through a link someone planted under the name.
        let mut file = File::options().write(true).create_new(true).open(tmp)?;
        write(&mut file)?;
        file.flush()
    })
}

/// As [`write_atomically`], for writers that create the file themselves:
/// `write` gets the temporary path to create; the file is then fsynced and
/// renamed over `path`.
pub fn replace_atomically(
    path: &Path,
    write: impl FnOnce(&Path) -> io::Result<()>,
) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        // Whatever is there (a link left by someone else) goes, not its target.
        match fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        write(&tmp)?;
        File::open(&tmp)?.sync_all()?;
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_keeps_the_old_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let path = dir.join("f.bin");
        write_atomically(&path, |f| f.write_all(b"old")).unwrap();
        let err = write_atomically(&path, |f| {
            f.write_all(b"partial")?;
            Err(io::Error::other("disk full"))
        });
        assert!(err.is_err());
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(
            fs::read_dir(dir).unwrap().count(),
            1,
            "no temporary file left behind"
        );
    }

    #[test]
    fn a_link_planted_under_the_temporary_name_is_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let victim = dir.join("victim.bin");
        fs::write(&victim, b"keep me").unwrap();
        let tmp = dir.join(format!(".f.bin.tmp-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        write_atomically(&dir.join("f.bin"), |f| f.write_all(b"new")).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"keep me");
        assert_eq!(fs::read(dir.join("f.bin")).unwrap(), b"new");
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        replace_atomically(&dir.join("g.bin"), |t| fs::write(t, b"new")).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"keep me");
    }
}
