//! A tensor's memory dropped and given back while autograd keeps views of
//! it (`csrc/storage.cpp`): how FULL_SHARD frees a unit's whole
//! parameters between its forward and backward passes without
//! recomputing it, and backward from given output gradients.

use super::ffi;
use super::foreach::check;
use tch::{TchError, Tensor};
use torch_sys::C_tensor;

/// The bytes `t`'s storage holds (0 once [`free_storage`] freed it).
pub fn storage_bytes(t: &Tensor) -> usize {
    // SAFETY: a live tensor.
    unsafe { ffi::hearth_storage_bytes(t.as_ptr() as *mut C_tensor) as usize }
}

/// Frees the memory of `t`'s storage: `t` and every view of it (those
/// autograd saved) keep their sizes, and must not be read until
/// [`take_storage`] gives it memory again.
pub fn free_storage(t: &Tensor) -> Result<(), TchError> {
    // SAFETY: a live tensor.
    check(unsafe { ffi::hearth_storage_free(t.as_ptr() as *mut C_tensor) })
}

/// Gives `t`'s freed storage the memory of `values` (`t`'s size and kind,
/// contiguous, a storage of its own, as a fresh copy is), moved without a
/// copy: `values` is left empty.
pub fn take_storage(t: &Tensor, values: Tensor) -> Result<(), TchError> {
    // SAFETY: live tensors; `values` is dropped after the call.
    check(unsafe {
        ffi::hearth_storage_take(
            t.as_ptr() as *mut C_tensor,
            values.as_ptr() as *mut C_tensor,
        )
    })
}

/// Backward from `tensors` with their gradients `grads` (PyTorch's
/// `torch.autograd.backward(tensors, grads)`), the graph freed after it.
pub fn backward(tensors: &[Tensor], grads: &[Tensor]) -> Result<(), TchError> {
    if tensors.len() != grads.len() {
        return Err(TchError::Torch(format!(
            "backward: {} tensors, {} gradients",
            tensors.len(),
            grads.len()
        )));
    }
    let t: Vec<*mut C_tensor> = tensors
        .iter()
        .map(|t| t.as_ptr() as *mut C_tensor)
        .collect();
    let g: Vec<*mut C_tensor> = grads.iter().map(|g| g.as_ptr() as *mut C_tensor).collect();
    // SAFETY: live tensors, as many gradients as tensors.
    check(unsafe { ffi::hearth_autograd_backward(t.as_ptr(), g.as_ptr(), t.len() as i32) })
}
