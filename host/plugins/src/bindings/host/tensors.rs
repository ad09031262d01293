//! `hearth:plugin/tensors`: a checkpoint hook's calls on the
//! `tensor-reader` and `tensor-writer` resources (`crate::tensors`).

use super::super::checkpoint::hearth::plugin::tensors::{self as wit};
use crate::sandbox::PluginState;
use crate::tensors::{TensorReader, TensorWriter};
use hearth_ops::tensor::TensorKey;
use wasmtime::component::Resource;

impl From<wit::TensorKey> for TensorKey {
    fn from(k: wit::TensorKey) -> Self {
        Self {
            model: k.model,
            name: k.name,
        }
    }
}

impl From<&TensorKey> for wit::TensorKey {
    fn from(k: &TensorKey) -> Self {
        Self {
            model: k.model,
            name: k.name.clone(),
        }
    }
}

impl wit::Host for PluginState {}

impl wit::HostTensorReader for PluginState {
    fn read(
        &mut self,
        reader: Resource<TensorReader>,
        key: wit::TensorKey,
        offset: u64,
        length: u64,
    ) -> Result<Vec<u8>, String> {
        let reader = self.table().get(&reader).map_err(|e| e.to_string())?;
        reader.read(key.into(), offset, length)
    }

    fn drop(&mut self, reader: Resource<TensorReader>) -> wasmtime::Result<()> {
        self.table().delete(reader)?;
        Ok(())
    }
}

impl wit::HostTensorWriter for PluginState {
    fn write(
        &mut self,
        writer: Resource<TensorWriter>,
        key: wit::TensorKey,
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), String> {
        let writer = self.table().get_mut(&writer).map_err(|e| e.to_string())?;
        writer.write(key.into(), offset, data)
    }

    fn drop(&mut self, writer: Resource<TensorWriter>) -> wasmtime::Result<()> {
        self.table().delete(writer)?;
        Ok(())
    }
}
