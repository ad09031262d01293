//! A script from the fuzzer: bytes read front to back, with zeros once
//! they run out, so any input is a valid script.
#![allow(dead_code)]

/// Where a plugin's script is read from.
pub struct Script {
    bytes: Vec<u8>,
    at: usize,
}

impl Script {
    /// The script in `bytes`.
    pub fn new(bytes: Vec<u8>) -> Self {
        Self { bytes, at: 0 }
    }

    /// The hex string after `"<key>":"` in `text` (options JSON or a
    /// config value), decoded; empty when absent.
    pub fn from_hex_in(text: &str, key: &str) -> Self {
        let marker = format!("\"{key}\":\"");
        let hex = text
            .split(marker.as_str())
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap_or("");
        Self::new(decode_hex(hex))
    }

    /// True when every byte was read.
    pub fn done(&self) -> bool {
        self.at >= self.bytes.len()
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        let b = self.bytes.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }

    /// The next 4 bytes, little-endian.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// The next 8 bytes, little-endian.
    pub fn u64(&mut self) -> u64 {
        (self.u32() as u64) | ((self.u32() as u64) << 32)
    }

    /// A float: one byte picks a plain value, else the next 8 bytes' bits
    /// (NaN, infinities, negatives, subnormals).
    pub fn f64(&mut self) -> f64 {
        match self.u8() % 4 {
            0 => self.u8() as f64 / 1000.0,
            1 => 0.0,
            _ => f64::from_bits(self.u64()),
        }
    }

    /// A length: a byte, or with 255 a large one (to cross the host's caps).
    pub fn len(&mut self) -> usize {
        match self.u8() {
            255 => (self.u32() % (1 << 17)) as usize,
            n => n as usize,
        }
    }

    /// `len()` bytes: taken from the script while it lasts, then a
    /// repeating pattern (multi-byte UTF-8 included, to cut mid-character).
    pub fn bytes(&mut self) -> Vec<u8> {
        let n = self.len();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.at < self.bytes.len() {
                out.push(self.bytes[self.at]);
                self.at += 1;
            } else {
                out.extend_from_slice("é€\u{10348}\n".as_bytes());
            }
        }
        out.truncate(n);
        out
    }

    /// `bytes()` as text (invalid UTF-8 replaced).
    pub fn text(&mut self) -> String {
        String::from_utf8_lossy(&self.bytes()).into_owned()
    }

    /// Writes some bytes to stdout and stderr and logs a line, as the
    /// script says (what the host does with a plugin's output).
    pub fn chatter(&mut self) {
        use std::io::Write;
        let what = self.u8();
        if what & 1 != 0 {
            let _ = std::io::stdout().write_all(&self.bytes());
            let _ = std::io::stdout().flush();
        }
        if what & 2 != 0 {
            let _ = std::io::stderr().write_all(&self.bytes());
        }
        if what & 4 != 0 {
            let line = self.text();
            match what >> 3 & 3 {
                0 => hearth_guest::log::debug(&line),
                1 => hearth_guest::log::info(&line),
                2 => hearth_guest::log::warn(&line),
                _ => hearth_guest::log::error(&line),
            }
        }
    }
}

fn decode_hex(hex: &str) -> Vec<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        b'A'..=b'F' => c - b'A' + 10,
        _ => 0,
    };
    hex.as_bytes()
        .chunks(2)
        .map(|p| digit(p[0]) << 4 | p.get(1).map_or(0, |&c| digit(c)))
        .collect()
}
