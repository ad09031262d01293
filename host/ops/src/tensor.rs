//! Tensors as bytes: safetensors' dtype names for tensor kinds, the bytes
//! of a CPU tensor, and the key that names one tensor of a prepared model
//! (checkpoints, checkpoint hooks and collectives all move tensors as bytes).

use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// The safetensors dtype of a tensor kind; `None` for kinds safetensors
/// has no name for.
pub fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        _ => return None,
    })
}

/// The tensor kind of a safetensors dtype; `None` for dtypes libtorch
/// has no kind for.
pub fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

/// The bytes of `tensor` (little-endian, row-major). It must be a
/// contiguous CPU tensor; anything else is a bug in the caller.
pub fn tensor_bytes(tensor: &Tensor) -> &[u8] {
    assert!(
        tensor.device() == Device::Cpu && tensor.is_contiguous(),
        "tensor_bytes needs a contiguous CPU tensor"
    );
    let len = tensor.numel() * tensor.kind().elt_size_in_bytes();
    if len == 0 {
        return &[];
    }
    // SAFETY: the tensor is contiguous, on the CPU, and outlives the
    // borrow; `len` is numel * element size.
    unsafe { std::slice::from_raw_parts(tensor.data_ptr() as *const u8, len) }
}

/// One tensor of one prepared model: the model's index (0 is
/// `model.safetensors`, 1 `model_1.safetensors`, …) and the tensor's name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorKey {
    /// The prepared model.
    pub model: u32,
    /// The tensor's name in its state dict.
    pub name: String,
}

impl TensorKey {
    /// Tensor `name` of prepared model `model`.
    pub fn new(model: usize, name: &str) -> Self {
        Self {
            model: model as u32,
            name: name.into(),
        }
    }
}

impl std::fmt::Display for TensorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` of model {}", self.name, self.model)
    }
}
