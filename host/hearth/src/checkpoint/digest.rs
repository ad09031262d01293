//! Content hashes of checkpoint files: xxh3-64, computed while a file is
//! written (never by reading it back), recorded in the checkpoint's
//! manifest as 16 hex digits, and checked when a checkpoint is verified,
//! loaded or chosen to resume from. A flipped bit anywhere in a file —
//! header or tensor data — changes its hash.
//!
//! xxh3 over crc32c: on the development machine (2-core AMD EPYC with
//! AVX-512) `hearth-bench`'s `checksum_speed` measured both over the same
//! buffer; see docs/src/checkpoints.md for the figures.

use std::hash::Hasher;
use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::OnceLock;
use twox_hash::XxHash3_64;

/// Whether checkpoints get content hashes: on unless
/// `HEARTH_CHECKPOINT_HASHES=off` (what `make bench-checkpoint` compares
/// against; such a checkpoint is checked by size only). Read once.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("HEARTH_CHECKPOINT_HASHES").as_deref(),
            Ok("off" | "0" | "false")
        )
    })
}

/// The hash of `bytes` for a manifest: none when hashes are off.
pub fn recorded(bytes: &[u8]) -> Option<String> {
    enabled().then(|| of_bytes(bytes))
}

/// A hash as the manifest writes it.
pub fn hex(hash: u64) -> String {
    format!("{hash:016x}")
}

/// The hash of `bytes`.
pub fn of_bytes(bytes: &[u8]) -> String {
    hex(XxHash3_64::oneshot(bytes))
}

/// The hash of the file at `path`, read in large blocks (what verifying
/// costs: one read of the file).
pub fn of_file(path: &Path) -> io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = XxHash3_64::new();
    let mut block = vec![0u8; 8 << 20];
    loop {
        let n = file.read(&mut block)?;
        if n == 0 {
            return Ok(hex(hasher.finish()));
        }
        hasher.write(&block[..n]);
    }
}

/// Writes this large or larger are hashed beside the write, not before it.
pub const OVERLAP: usize = 1 << 20;

/// A writer that hashes every byte it passes on (unless hashes are off).
pub struct Hashing<W> {
    inner: W,
    hasher: Option<XxHash3_64>,
}

impl<W: Write> Hashing<W> {
    /// Hashes what goes to `inner`.
    pub fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: enabled().then(XxHash3_64::new),
        }
    }

    /// Writes `bytes` whole. Past [`OVERLAP`] bytes they are hashed on a
    /// thread of their own while this one writes them, so that a save
    /// costs the longer of the two rather than their sum (on the
    /// development machine hashing alone was ~7 % of a 3 GB save).
    pub fn write_all_overlapped(&mut self, bytes: &[u8]) -> io::Result<()> {
        let Self { inner, hasher } = self;
        match hasher {
            Some(hasher) if bytes.len() >= OVERLAP => std::thread::scope(|scope| {
                let hashing = scope.spawn(|| hasher.write(bytes));
                let written = inner.write_all(bytes);
                hashing.join().expect("hashing does not panic");
                written
            }),
            _ => self.write_all(bytes),
        }
    }

    /// The writer, and the hash of everything written through it.
    pub fn finish(self) -> (W, Option<String>) {
        let hash = self.hasher.map(|h| hex(h.finish()));
        (self.inner, hash)
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        if let Some(hasher) = &mut self.hasher {
            hasher.write(&buf[..n]);
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_file_a_buffer_and_a_read_back_file_hash_alike() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..(20u32 << 20)).map(|i| (i * 7 + i / 3) as u8).collect();
        let mut w = Hashing::new(std::fs::File::create(&path).unwrap());
        for (i, chunk) in bytes.chunks(3 << 20).enumerate() {
            match i % 2 {
                0 => w.write_all(chunk).unwrap(),
                _ => w.write_all_overlapped(chunk).unwrap(),
            }
        }
        let (_, written) = w.finish();
        let written = written.expect("hashes are on");
        assert_eq!(written, of_bytes(&bytes));
        assert_eq!(written, of_file(&path).unwrap());
        let mut flipped = bytes.clone();
        flipped[12_345_678] ^= 0x10;
        assert_ne!(of_bytes(&flipped), written);
        // xxh3-64 of the empty input (the reference implementation's).
        assert_eq!(of_bytes(b""), "2d06800538d394c2");
    }
}
