//! TFRecord framing: `u64 length`, `u32 masked_crc32c(length)`, `data`,
//! `u32 masked_crc32c(data)`, all little-endian.

use crc::{Crc, CRC_32_ISCSI};

const CRC32C: Crc<u32> = Crc::<u32>::new(&CRC_32_ISCSI);

/// TensorFlow's masked CRC32C (`tensorflow/core/lib/hash/crc32c.h`).
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = CRC32C.checksum(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `data` framed as one record.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        // The CRC-32C check value of "123456789" (RFC 3720, B.4).
        assert_eq!(CRC32C.checksum(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn masked_like_tensorboard() {
        // tensorboard.summary.writer.record_writer.masked_crc32c of the same bytes.
        assert_eq!(masked_crc(b"brain.Event:2"), 0x7c06_01ee);
        assert_eq!(masked_crc(&13u64.to_le_bytes()), 0x34b8_373c);
    }
}
