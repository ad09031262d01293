//! Just enough protobuf encoding for TensorBoard's messages
//! (`tensorboard/compat/proto/{event,summary,tensor}.proto` and the hparams
//! plugin's `plugin_data.proto`); field numbers are those files'.

/// A message under construction: fields appended in any order.
#[derive(Default)]
pub struct Message(Vec<u8>);

const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;
const FIXED32: u64 = 5;

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

impl Message {
    fn key(&mut self, field: u32, wire: u64) {
        varint(&mut self.0, (u64::from(field) << 3) | wire);
    }
    /// An int32/int64/enum/bool field.
    pub fn int(mut self, field: u32, v: i64) -> Self {
        self.key(field, VARINT);
        varint(&mut self.0, v as u64);
        self
    }
    /// A double field.
    pub fn double(mut self, field: u32, v: f64) -> Self {
        self.key(field, FIXED64);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A float field.
    pub fn float(mut self, field: u32, v: f32) -> Self {
        self.key(field, FIXED32);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A string or bytes field.
    pub fn bytes(mut self, field: u32, v: &[u8]) -> Self {
        self.key(field, LEN);
        varint(&mut self.0, v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }
    /// A string field.
    pub fn string(self, field: u32, v: &str) -> Self {
        self.bytes(field, v.as_bytes())
    }
    /// An embedded message field.
    pub fn message(self, field: u32, m: Message) -> Self {
        self.bytes(field, &m.0)
    }
    /// The encoded bytes.
    pub fn finish(self) -> Vec<u8> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_like_the_protobuf_spec() {
        // Examples from protobuf.dev/programming-guides/encoding.
        assert_eq!(Message::default().int(1, 150).finish(), [0x08, 0x96, 0x01]);
        assert_eq!(
            Message::default().string(2, "testing").finish(),
            b"\x12\x07testing"
        );
        assert_eq!(Message::default().int(1, -2).finish().len(), 11);
    }
}
