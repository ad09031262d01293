//! Which content hash a checkpoint records: xxh3-64 (twox-hash, its AVX2
//! path chosen at run time) against crc32c (the crc32c crate, SSE4.2's
//! crc32 instruction), over the same 1 GiB buffer in the 8 MiB blocks a
//! verify reads, best of 5 passes each, alternating. Prints GB/s of each.
//! A benchmark, not a test: nothing is asserted.
//! Usage: cargo run --release -p hearth-bench --bin checksum_speed

use std::hash::Hasher;
use std::time::Instant;

fn main() {
    let bytes: Vec<u8> = (0..1u64 << 30)
        .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8)
        .collect();
    let gb = bytes.len() as f64 / 1e9;
    let (mut xxh3, mut crc) = (f64::MAX, f64::MAX);
    let (mut xxh3_out, mut crc_out) = (0u64, 0u32);
    for _ in 0..5 {
        let t = Instant::now();
        let mut h = twox_hash::XxHash3_64::new();
        for block in bytes.chunks(8 << 20) {
            h.write(block);
        }
        xxh3_out = h.finish();
        xxh3 = xxh3.min(t.elapsed().as_secs_f64());

        let t = Instant::now();
        let mut c = 0u32;
        for block in bytes.chunks(8 << 20) {
            c = crc32c::crc32c_append(c, block);
        }
        crc_out = c;
        crc = crc.min(t.elapsed().as_secs_f64());
    }
    println!("xxh3-64 {:6.2} GB/s  ({xxh3_out:016x})", gb / xxh3);
    println!("crc32c  {:6.2} GB/s  ({crc_out:08x})", gb / crc);
}
