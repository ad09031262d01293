//! Device-wide state: libtorch's default random generators (CPU and each CUDA
//! device), as `torch.get_rng_state` / `torch.cuda.get_rng_state` give it,
//! and the GPU memory cache.

use super::ffi;
use super::foreach::check;
use tch::{Device, TchError, Tensor};
use torch_sys::C_tensor;

fn device_args(device: Device) -> (i32, i32) {
    match device {
        Device::Cuda(i) => (1, i as i32),
        _ => (0, -1),
    }
}

/// A copy of the default generator's state of `device` (a uint8 tensor on
/// the CPU; 5056 bytes for the CPU generator).
pub fn rng_state(device: Device) -> Result<Tensor, TchError> {
    let (dt, index) = device_args(device);
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: on success `out` is a new at::Tensor owned by us from here on.
    check(unsafe { ffi::hearth_rng_get_state(dt, index, &mut out) })?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Restores a state [`rng_state`] returned for the same device.
pub fn set_rng_state(device: Device, state: &Tensor) -> Result<(), TchError> {
    let (dt, index) = device_args(device);
    // SAFETY: a live handle borrowed for the call.
    check(unsafe { ffi::hearth_rng_set_state(dt, index, state.as_ptr() as *mut C_tensor) })
}

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))`, drawn
/// from a private generator: no global generator is read or changed.
pub fn randperm(n: i64, seed: u64) -> Result<Tensor, TchError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: on success `out` is a new at::Tensor owned by us from here on.
    check(unsafe { ffi::hearth_randperm(n, seed, &mut out) })?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// `torch.manual_seed(seed)` then `torch.randn(shape, dtype=kind)` for each
/// of `shapes` in turn, on the CPU, as inside `torch.random.fork_rng()`: the
/// draws come from a private generator, no global one is read or changed.
pub fn randn_seeded(
    shapes: &[&[i64]],
    kind: tch::Kind,
    seed: u64,
) -> Result<Vec<Tensor>, TchError> {
    // c10::ScalarType's numbers of the floating kinds.
    let dtype = match kind {
        tch::Kind::Half => 5,
        tch::Kind::Float => 6,
        tch::Kind::Double => 7,
        tch::Kind::BFloat16 => 15,
        other => {
            return Err(TchError::Kind(format!(
                "randn draws floating-point values, not {other:?}"
            )))
        }
    };
    let dims: Vec<i64> = shapes.iter().flat_map(|s| s.iter().copied()).collect();
    let ndims: Vec<usize> = shapes.iter().map(|s| s.len()).collect();
    let mut outs: Vec<*mut C_tensor> = vec![std::ptr::null_mut(); shapes.len()];
    // SAFETY: `dims` and `ndims` describe `shapes.len()` shapes and `outs`
    // has room for as many tensors; on success each is a new at::Tensor
    // owned by us from here on (on failure none is left allocated: the
    // shim fails before or while allocating, and a failed at::randn
    // allocates nothing we keep).
    check(unsafe {
        ffi::hearth_randn_seeded(
            dims.as_ptr(),
            ndims.as_ptr(),
            shapes.len(),
            dtype,
            seed,
            outs.as_mut_ptr(),
        )
    })?;
    Ok(outs
        .into_iter()
        .map(|t| unsafe { Tensor::from_ptr(t) })
        .collect())
}

/// A copy of `t` (on any device) in page-locked (pinned) host memory,
/// which a GPU copies from and to at full speed; needs a GPU.
pub fn to_pinned_host(t: &Tensor) -> Result<Tensor, TchError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: `t` is a live handle borrowed for the call; on success `out`
    // is a new at::Tensor owned by us from here on.
    check(unsafe { ffi::hearth_to_pinned_host(t.as_ptr() as *mut C_tensor, &mut out) })?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Copies `src` into `dst` without waiting for the device (PyTorch's
/// `dst.copy_(src, non_blocking=True)`): from a GPU into pinned host
/// memory the copy is only queued, and `dst` holds it once the device has
/// been waited for (`tch::Cuda::synchronize`).
pub fn copy_non_blocking(dst: &Tensor, src: &Tensor) -> Result<(), TchError> {
    // SAFETY: both are live handles borrowed for the call.
    check(unsafe {
        ffi::hearth_copy_non_blocking(dst.as_ptr() as *mut C_tensor, src.as_ptr() as *mut C_tensor)
    })
}

/// Releases the GPU's cached, unused memory (`torch.cuda.empty_cache`);
/// nothing without a GPU.
pub fn empty_device_cache() -> Result<(), TchError> {
    // SAFETY: no arguments.
    check(unsafe { ffi::hearth_empty_device_cache() })
}

/// `torch.use_deterministic_algorithms(on)`: libtorch then picks
/// deterministic kernels, raises an error for an operation that has none,
/// and fills fresh (`empty`) tensors with NaN. Process-wide.
pub fn use_deterministic_algorithms(on: bool) -> Result<(), TchError> {
    // SAFETY: no pointers.
    check(unsafe { ffi::hearth_use_deterministic_algorithms(i32::from(on)) })
}

/// Whether [`use_deterministic_algorithms`] is on
/// (`torch.are_deterministic_algorithms_enabled()`).
pub fn deterministic_algorithms() -> bool {
    // SAFETY: no arguments.
    unsafe { ffi::hearth_deterministic_algorithms() != 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn restoring_the_cpu_state_replays_the_same_numbers() {
        tch::manual_seed(3);
        let state = rng_state(Device::Cpu).unwrap();
        let first = Tensor::rand([4], (Kind::Float, Device::Cpu));
        set_rng_state(Device::Cpu, &state).unwrap();
        let again = Tensor::rand([4], (Kind::Float, Device::Cpu));
        assert!(first.equal(&again));
    }

    #[test]
    fn a_truncated_state_is_an_error_not_a_crash() {
        let bad = Tensor::zeros([7], (Kind::Uint8, Device::Cpu));
        assert!(set_rng_state(Device::Cpu, &bad).is_err());
    }
}
