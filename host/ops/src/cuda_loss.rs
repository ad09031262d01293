//! Cross-entropy of bfloat16 logits on a GPU by hearth's own kernels
//! (`csrc/cuda_cross_entropy.cpp`, compiled at run time by NVRTC and part
//! of the embedded CUDA library, [`super::cuda_graph`]): one pass over the
//! logits forward and one backward, where autocast's float32 cast,
//! log-softmax and NLL make six over a float32 copy.

use super::cuda_graph::{library, GraphError};
use std::ffi::c_void;
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

/// Whether the kernels run on GPU `index` (compiled and loaded on the first
/// call for each GPU), and if not why: `HEARTH_GPU_KERNELS=off`, no GPU or
/// no embedded library, no NVRTC beside the CUDA runtime, or a GPU NVRTC
/// does not know.
pub fn available(index: usize) -> Result<(), GraphError> {
    if std::env::var("HEARTH_GPU_KERNELS").is_ok_and(|v| v == "off") {
        return Err(GraphError::Unavailable(
            "hearth's GPU kernels are turned off (HEARTH_GPU_KERNELS=off)".into(),
        ));
    }
    static CHECKED: OnceLock<Vec<OnceLock<Result<(), GraphError>>>> = OnceLock::new();
    let slots = CHECKED.get_or_init(|| (0..64).map(|_| OnceLock::new()).collect());
    let Some(slot) = slots.get(index) else {
        return Err(GraphError::Unavailable(format!(
            "GPU {index}: more than 64 GPUs"
        )));
    };
    slot.get_or_init(|| {
        let lib = library()?;
        // SAFETY: a plain index; errors come back as messages.
        lib.check(unsafe { (lib.cross_entropy_available)(index as i32) })
    })
    .clone()
}

/// The mean cross-entropy of `logits` (`[rows, vocab]`, bfloat16, on a GPU)
/// against `targets` (`[rows]`, int64), leaving out rows whose target is
/// `ignore_index`: a float32 scalar equal, to float32 rounding, to
/// `F.cross_entropy(logits.float(), targets, ignore_index=...)`, whose
/// gradient comes back in bfloat16 (the float32 one rounded once). A
/// target outside the vocabulary makes the loss NaN. No second derivative.
///
/// Returns `None` where the kernels cannot run (see [`available`]) or the
/// arguments are not of that form; the caller then uses libtorch's
/// operators.
pub fn bf16_cross_entropy(logits: &Tensor, targets: &Tensor, ignore_index: i64) -> Option<Tensor> {
    let Device::Cuda(index) = logits.device() else {
        return None;
    };
    if logits.kind() != Kind::BFloat16
        || logits.dim() != 2
        || targets.kind() != Kind::Int64
        || targets.size() != [logits.size()[0]]
        || targets.device() != logits.device()
        || available(index).is_err()
    {
        return None;
    }
    let lib = library().ok()?;
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: both tensors are live handles borrowed for the call; on
    // success `out` is a new at::Tensor owned by us from here on.
    let status = unsafe {
        (lib.cross_entropy_bf16)(
            logits.as_ptr() as *mut c_void,
            targets.as_ptr() as *mut c_void,
            ignore_index,
            &mut out,
        )
    };
    match lib.check(status) {
        // SAFETY: see above.
        Ok(()) => Some(unsafe { Tensor::from_ptr(out as *mut C_tensor) }),
        Err(e) => panic!("cross-entropy: {e}"),
    }
}
