//! The framing of a `.wandb` file, as wandb's transaction log writes it
//! (LevelDB's log format with wandb's header and checksum):
//!
//! - a 7-byte file header: `:W&B`, the magic `0xBEE1` (little-endian) and
//!   the version 0;
//! - the file is cut into 32 KiB blocks; each record is one or more
//!   chunks, none crossing a block, each with a 7-byte header: the CRC-32
//!   (zlib's) of the chunk's type byte followed by its data, the data's
//!   length (`u16`), and the type: 1 whole, 2 first, 3 middle, 4 last;
//! - a block with less than 7 bytes left is padded with zeros.

use crc::{Crc, CRC_32_ISO_HDLC};
use std::fs::File;
use std::io::Write;

const CRC32: Crc<u32> = Crc::<u32>::new(&CRC_32_ISO_HDLC);
const BLOCK: usize = 32 * 1024;
const CHUNK_HEADER: usize = 7;
/// `:W&B`, magic 0xBEE1, version 0.
pub const FILE_HEADER: [u8; 7] = [b':', b'W', b'&', b'B', 0xe1, 0xbe, 0];

const FULL: u8 = 1;
const FIRST: u8 = 2;
const MIDDLE: u8 = 3;
const LAST: u8 = 4;

/// Frames records, keeping track of where in its block the file is.
#[derive(Debug, Default)]
pub struct Framer {
    offset: usize,
}

impl Framer {
    /// The bytes of a new file: its header.
    pub fn header(&mut self) -> Vec<u8> {
        self.offset = FILE_HEADER.len();
        FILE_HEADER.to_vec()
    }

    /// `data` as the chunks of one record, padding included.
    pub fn frame(&mut self, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(data.len() + 2 * CHUNK_HEADER);
        let mut rest = data;
        let mut first = true;
        loop {
            let left = BLOCK - self.offset % BLOCK;
            if left < CHUNK_HEADER {
                out.extend(std::iter::repeat_n(0u8, left));
                self.offset += left;
                continue;
            }
            let room = left - CHUNK_HEADER;
            let (chunk, more) = rest.split_at(rest.len().min(room));
            let kind = match (first, more.is_empty()) {
                (true, true) => FULL,
                (true, false) => FIRST,
                (false, false) => MIDDLE,
                (false, true) => LAST,
            };
            let mut digest = CRC32.digest();
            digest.update(&[kind]);
            digest.update(chunk);
            out.extend_from_slice(&digest.finalize().to_le_bytes());
            out.extend_from_slice(&(chunk.len() as u16).to_le_bytes());
            out.push(kind);
            out.extend_from_slice(chunk);
            self.offset += CHUNK_HEADER + chunk.len();
            if more.is_empty() {
                return out;
            }
            rest = more;
            first = false;
        }
    }
}

/// A `.wandb` file being written: every record goes to the file in one
/// write, so what a crash leaves is whole records (and at worst the end
/// of one, which wandb's reader stops at).
pub struct Log {
    file: File,
    framer: Framer,
}

impl Log {
    /// A new file at `path`, its header written.
    pub fn create(path: &str) -> Result<Self, String> {
        let mut file = File::create(path).map_err(|e| format!("creating {path}: {e}"))?;
        let mut framer = Framer::default();
        file.write_all(&framer.header())
            .map_err(|e| format!("writing {path}: {e}"))?;
        Ok(Self { file, framer })
    }

    /// One record.
    pub fn append(&mut self, record: &[u8]) -> Result<(), String> {
        let bytes = self.framer.frame(record);
        self.file
            .write_all(&bytes)
            .map_err(|e| format!("writing the .wandb file: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads chunks back the way LevelDB's log reader does.
    fn read_back(bytes: &[u8]) -> Vec<Vec<u8>> {
        assert_eq!(&bytes[..7], &FILE_HEADER);
        let (mut pos, mut records, mut partial) = (7, Vec::new(), Vec::new());
        while pos + CHUNK_HEADER <= bytes.len() {
            let left = BLOCK - pos % BLOCK;
            if left < CHUNK_HEADER {
                assert!(bytes[pos..pos + left].iter().all(|b| *b == 0));
                pos += left;
                continue;
            }
            let crc = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap());
            let len = u16::from_le_bytes([bytes[pos + 4], bytes[pos + 5]]) as usize;
            let kind = bytes[pos + 6];
            let data = &bytes[pos + 7..pos + 7 + len];
            let mut digest = CRC32.digest();
            digest.update(&[kind]);
            digest.update(data);
            assert_eq!(crc, digest.finalize());
            assert!(pos % BLOCK + 7 + len <= BLOCK, "a chunk crosses a block");
            partial.extend_from_slice(data);
            if kind == FULL || kind == LAST {
                records.push(std::mem::take(&mut partial));
            }
            pos += 7 + len;
        }
        assert_eq!(pos, bytes.len());
        records
    }

    #[test]
    fn the_checksum_is_zlibs_crc32_of_the_type_and_the_data() {
        // zlib.crc32(b"\x01" + b"abc") in Python.
        let mut digest = CRC32.digest();
        digest.update(&[1]);
        digest.update(b"abc");
        assert_eq!(digest.finalize(), 0x539d_20a9);
    }

    #[test]
    fn records_of_every_size_read_back_across_blocks() {
        let mut framer = Framer::default();
        let mut bytes = framer.header();
        let sizes = [0, 1, 100, BLOCK - 30, 5, 3 * BLOCK + 17, BLOCK, 7, 0];
        let records: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, n)| (0..*n).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        for record in &records {
            bytes.extend(framer.frame(record));
        }
        assert_eq!(read_back(&bytes), records);
    }
}
