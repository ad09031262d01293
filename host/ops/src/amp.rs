//! Mixed-precision kernels: the gradient scaler's unscale and update (the
//! kernels `torch.amp.GradScaler` uses) and autocast on any device type.

use super::ffi;
use super::foreach::{check, handles};
use std::os::raw::c_int;
use tch::{Device, Kind, TchError, Tensor};
use torch_sys::C_tensor;

/// `grads[i] *= inv_scale` in place; `found_inf` (a 1-element float tensor
/// on the gradients' device) is set to 1 when any gradient holds an inf or
/// NaN, else left as it was.
pub fn amp_unscale_(
    grads: &[Tensor],
    found_inf: &Tensor,
    inv_scale: &Tensor,
) -> Result<(), TchError> {
    if grads.is_empty() {
        return Ok(());
    }
    let g = handles(grads);
    // SAFETY: live handles borrowed for the call.
    check(unsafe {
        ffi::hearth_amp_unscale_(
            g.as_ptr(),
            g.len(),
            found_inf.as_ptr() as *mut C_tensor,
            inv_scale.as_ptr() as *mut C_tensor,
        )
    })
}

/// Updates a loss scale in place after a step: times `backoff_factor` and
/// the growth tracker reset when `found_inf` is non-zero, else the tracker
/// counts up and the scale grows by `growth_factor` every `growth_interval`
/// clean steps. `scale` and `found_inf` are 1-element float tensors,
/// `growth_tracker` a 1-element int32 tensor, all on one device.
pub fn amp_update_scale_(
    scale: &Tensor,
    growth_tracker: &Tensor,
    found_inf: &Tensor,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i64,
) -> Result<(), TchError> {
    // SAFETY: live handles borrowed for the call.
    check(unsafe {
        ffi::hearth_amp_update_scale_(
            scale.as_ptr() as *mut C_tensor,
            growth_tracker.as_ptr() as *mut C_tensor,
            found_inf.as_ptr() as *mut C_tensor,
            growth_factor,
            backoff_factor,
            growth_interval,
        )
    })
}

/// c10::DeviceType of a device.
fn device_type(device: Device) -> c_int {
    match device {
        Device::Cpu => 0,
        Device::Cuda(_) => 1,
        Device::Mps => 13,
        Device::Vulkan => 10,
    }
}

/// c10::ScalarType of the kinds autocast can cast to.
fn scalar_type(kind: Kind) -> Result<c_int, TchError> {
    match kind {
        Kind::Half => Ok(5),
        Kind::Float => Ok(6),
        Kind::BFloat16 => Ok(15),
        other => Err(TchError::Kind(format!(
            "autocast casts to float16, bfloat16 or float32, not {other:?}"
        ))),
    }
}

fn kind_of(scalar_type: c_int) -> Kind {
    match scalar_type {
        5 => Kind::Half,
        15 => Kind::BFloat16,
        _ => Kind::Float,
    }
}

/// Autocast enabled for one device type while it lives (PyTorch's
/// `torch.autocast(device_type, dtype)`): eligible operations (matmul,
/// linear, convolution…) run in `kind`, the rest in float32. Dropping it
/// restores the previous state, so guards nest — drop them in the reverse
/// order of creation. Autocast state is per thread, so a guard cannot leave
/// its thread.
#[must_use = "autocast ends when the guard is dropped"]
pub struct AutocastGuard {
    device_type: c_int,
    was_enabled: bool,
    was_dtype: c_int,
    /// The cache setting before, when the guard changed it.
    was_cache: Option<bool>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Turns autocast on for `device`'s type with `kind` (`Half` or `BFloat16`).
    pub fn new(device: Device, kind: Kind) -> Result<Self, TchError> {
        Self::with(device, kind, true, None)
    }

    /// `torch.autocast(device_type, dtype, enabled, cache_enabled)`:
    /// `enabled = false` turns autocast off for the device type inside (also
    /// under an outer guard); `cache_enabled`, when given, sets whether
    /// casts of leaf tensors are cached inside.
    pub fn with(
        device: Device,
        kind: Kind,
        enabled: bool,
        cache_enabled: Option<bool>,
    ) -> Result<Self, TchError> {
        let (dt, st) = (device_type(device), scalar_type(kind)?);
        let (mut was_enabled, mut was_dtype) = (false, 0);
        // SAFETY: plain values and two out-pointers to locals.
        check(unsafe {
            ffi::hearth_autocast_set(dt, enabled, st, true, &mut was_enabled, &mut was_dtype)
        })?;
        let was_cache = match cache_enabled {
            Some(on) => {
                let mut was = true;
                // SAFETY: a plain value and an out-pointer to a local.
                check(unsafe { ffi::hearth_autocast_cache(on, &mut was) })?;
                Some(was)
            }
            None => None,
        };
        Ok(Self {
            device_type: dt,
            was_enabled,
            was_dtype,
            was_cache,
            _not_send: std::marker::PhantomData,
        })
    }

    /// The kind autocast casts to on `device` right now, when it is on.
    pub fn active(device: Device) -> Option<Kind> {
        let dt = device_type(device);
        let (mut enabled, mut dtype) = (false, 0);
        // Reading is a set to the same values without counting a level.
        // SAFETY: as above.
        let probe =
            unsafe { ffi::hearth_autocast_set(dt, false, 6, true, &mut enabled, &mut dtype) };
        check(probe).ok()?;
        let (mut e2, mut d2) = (false, 0);
        // SAFETY: as above; restores what the probe changed.
        check(unsafe { ffi::hearth_autocast_set(dt, enabled, dtype, false, &mut e2, &mut d2) })
            .ok()?;
        enabled.then(|| kind_of(dtype))
    }
}

/// Whether autocast caches its casts of leaf tensors
/// (`torch.is_autocast_cache_enabled()`).
pub fn autocast_cache_enabled() -> bool {
    let (mut was, mut again) = (true, true);
    // SAFETY: plain values and out-pointers to locals; the second call puts
    // back what the first read.
    unsafe {
        let _ = check(ffi::hearth_autocast_cache(true, &mut was));
        let _ = check(ffi::hearth_autocast_cache(was, &mut again));
    }
    was
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        if let Some(was) = self.was_cache {
            let mut now = false;
            // SAFETY: as above.
            let _ = check(unsafe { ffi::hearth_autocast_cache(was, &mut now) });
        }
        let (mut e, mut d) = (false, 0);
        // SAFETY: as above; restoring the saved state cannot fail for a
        // device type that was accepted on entry.
        let err = unsafe {
            ffi::hearth_autocast_set(
                self.device_type,
                self.was_enabled,
                self.was_dtype,
                false,
                &mut e,
                &mut d,
            )
        };
        let _ = check(err);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unscale_flags_non_finite_gradients_and_scales_the_rest() {
        let g = Tensor::from_slice(&[2.0f32, 4.0]);
        let found = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        let inv = Tensor::from_slice(&[0.5f32]);
        amp_unscale_(&[g.shallow_clone()], &found, &inv).unwrap();
        assert_eq!(Vec::<f32>::try_from(&g).unwrap(), vec![1.0, 2.0]);
        assert_eq!(f64::try_from(found.sum(Kind::Float)).unwrap(), 0.0);
        let bad = Tensor::from_slice(&[f32::NAN]);
        amp_unscale_(&[bad], &found, &inv).unwrap();
        assert_eq!(f64::try_from(found.sum(Kind::Float)).unwrap(), 1.0);
    }

    #[test]
    fn bf16_autocast_on_cpu_runs_matmul_in_bf16_and_ends_with_the_guard() {
        let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
        {
            let _guard = AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
            assert_eq!(AutocastGuard::active(Device::Cpu), Some(Kind::BFloat16));
            assert_eq!(a.matmul(&a).kind(), Kind::BFloat16);
        }
        assert_eq!(AutocastGuard::active(Device::Cpu), None);
        assert_eq!(a.matmul(&a).kind(), Kind::Float);
    }
}
