//! The resources of the `tensors` interface a checkpoint hook imports:
//! `tensor-reader` (the snapshot being saved, read by range) and
//! `tensor-writer` (the tensors a hook restores, written by range), which
//! `bindings` maps the WIT's to (their host calls are in
//! `bindings/host/tensors.rs`).

use hearth_ops::tensor::{tensor_bytes, TensorKey};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// Most bytes one `read` may return.
const MAX_READ: u64 = 64 << 20;

/// The host side of `tensor-reader`: the snapshot being saved.
pub struct TensorReader {
    pub(crate) tensors: HashMap<TensorKey, Tensor>,
}

impl TensorReader {
    pub(crate) fn read(&self, key: TensorKey, offset: u64, length: u64) -> Result<Vec<u8>, String> {
        let tensor = self
            .tensors
            .get(&key)
            .ok_or_else(|| format!("the checkpoint has no tensor {key}"))?;
        let bytes = tensor_bytes(tensor);
        let end = offset.saturating_add(length);
        if end > bytes.len() as u64 {
            return Err(format!(
                "tensor {key} has {} bytes; [{offset}, {end}) is out of range",
                bytes.len()
            ));
        }
        if length > MAX_READ {
            return Err(format!(
                "a read returns at most {MAX_READ} bytes; read {key} in chunks"
            ));
        }
        Ok(bytes[offset as usize..end as usize].to_vec())
    }
}

/// What a restored tensor must be.
pub(crate) struct Expected {
    pub(crate) kind: Kind,
    pub(crate) shape: Vec<i64>,
    pub(crate) bytes: usize,
}

/// The host side of `tensor-writer`: the tensors a hook restores, collected
/// until the hook returns.
pub struct TensorWriter {
    pub(crate) expected: HashMap<TensorKey, Expected>,
    pub(crate) written: HashMap<TensorKey, Vec<u8>>,
}

impl TensorWriter {
    pub(crate) fn write(
        &mut self,
        key: TensorKey,
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), String> {
        let expected = self.expected.get(&key).ok_or_else(|| {
            format!("tensor {key} was not claimed by this hook when the checkpoint was saved")
        })?;
        let buffer = self
            .written
            .entry(key.clone())
            .or_insert_with(|| Vec::with_capacity(expected.bytes));
        if offset != buffer.len() as u64 {
            return Err(format!(
                "write to {key} at offset {offset}, but {} bytes were written so far; write each tensor in order",
                buffer.len()
            ));
        }
        if buffer.len() + data.len() > expected.bytes {
            return Err(format!(
                "tensor {key} has {} bytes ({:?} {:?}); this write would make it {}",
                expected.bytes,
                expected.kind,
                expected.shape,
                buffer.len() + data.len()
            ));
        }
        buffer.extend_from_slice(&data);
        Ok(())
    }

    /// The restored tensors, each complete, or why not.
    pub(crate) fn finish(mut self) -> Result<Vec<(TensorKey, Tensor)>, String> {
        let mut keys: Vec<&TensorKey> = self.expected.keys().collect();
        keys.sort();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let expected = &self.expected[key];
            let bytes = self.written.remove(key).unwrap_or_default();
            if bytes.len() != expected.bytes {
                return Err(format!(
                    "restored {} of the {} bytes of tensor {key}",
                    bytes.len(),
                    expected.bytes
                ));
            }
            let tensor = Tensor::from_data_size(&bytes, &expected.shape, expected.kind);
            out.push((key.clone(), tensor));
        }
        Ok(out)
    }
}
