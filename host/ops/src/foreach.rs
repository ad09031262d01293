//! Safe wrappers over the shim: each takes tch tensors, checks lengths, and
//! turns a C++ exception into a [`tch::TchError`].

use super::ffi;
use std::ffi::CStr;
use std::os::raw::c_char;
use tch::{TchError, Tensor};
use torch_sys::C_tensor;

pub(super) fn handles(tensors: &[Tensor]) -> Vec<*mut C_tensor> {
    tensors
        .iter()
        .map(|t| t.as_ptr() as *mut C_tensor)
        .collect()
}

pub(super) fn check(error: *mut c_char) -> Result<(), TchError> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string from strdup.
    let text = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    unsafe { ffi::hearth_free_error(error) };
    Err(TchError::Torch(text))
}

fn same_len(what: &str, expected: usize, got: usize) -> Result<(), TchError> {
    if expected == got {
        Ok(())
    } else {
        Err(TchError::Shape(format!(
            "{what}: expected {expected} tensors, got {got}"
        )))
    }
}

/// Every tensor of `others` must have the shape, dtype and device of the
/// parameter at the same index: libtorch's fused CPU kernels do not check,
/// and a mismatch would read or write out of bounds.
fn same_layout(what: &str, params: &[Tensor], others: &[Tensor]) -> Result<(), TchError> {
    for (i, (p, o)) in params.iter().zip(others).enumerate() {
        if p.size() != o.size() || p.kind() != o.kind() || p.device() != o.device() {
            return Err(TchError::Shape(format!(
                "{what}[{i}] is {:?} {:?} on {:?} but its parameter is {:?} {:?} on {:?}",
                o.size(),
                o.kind(),
                o.device(),
                p.size(),
                p.kind(),
                p.device()
            )));
        }
    }
    Ok(())
}

/// Adam/AdamW hyper-parameters for one fused step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    /// Learning rate.
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square.
    pub betas: (f64, f64),
    /// Weight decay: decoupled (multiplies `lr`) for AdamW, an L2 term
    /// added to the gradient for Adam.
    pub weight_decay: f64,
    /// Term added to the denominator.
    pub eps: f64,
    /// AdamW (`true`, `_fused_adamw_`) or Adam (`false`, `_fused_adam_`).
    pub decoupled: bool,
}

impl AdamHyper {
    /// `torch.optim.AdamW(lr=lr)`: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn adamw(lr: f64) -> Self {
        Self {
            lr,
            betas: (0.9, 0.999),
            weight_decay: 0.01,
            eps: 1e-8,
            decoupled: true,
        }
    }

    /// `torch.optim.Adam(lr=lr)`: betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn adam(lr: f64) -> Self {
        Self {
            weight_decay: 0.0,
            decoupled: false,
            ..Self::adamw(lr)
        }
    }
}

/// SGD hyper-parameters for one fused step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdHyper {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the momentum buffers).
    pub momentum: f64,
    /// Dampening for momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// One AdamW step with libtorch's `_fused_adamw_` (as
/// `torch.optim.AdamW(fused=True)`), or an Adam step with `_fused_adam_`
/// when `hyper.decoupled` is false: increments each `steps[i]` (a 0-dim
/// float tensor) and updates `params`, `exp_avgs` and `exp_avg_sqs` in place.
/// With `lr` (a 0-dim tensor on the parameters' device) the rate is read
/// from it when the kernel runs, not taken from `hyper.lr`.
pub fn fused_adam(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    steps: &[Tensor],
    hyper: AdamHyper,
    lr: Option<&Tensor>,
) -> Result<(), TchError> {
    let n = params.len();
    same_len("grads", n, grads.len())?;
    same_len("exp_avgs", n, exp_avgs.len())?;
    same_len("exp_avg_sqs", n, exp_avg_sqs.len())?;
    same_len("steps", n, steps.len())?;
    same_layout("grads", params, grads)?;
    same_layout("exp_avgs", params, exp_avgs)?;
    same_layout("exp_avg_sqs", params, exp_avg_sqs)?;
    if n == 0 {
        return Ok(());
    }
    let (p, g, m, v, s) = (
        handles(params),
        handles(grads),
        handles(exp_avgs),
        handles(exp_avg_sqs),
        handles(steps),
    );
    // SAFETY: every handle points at a live at::Tensor borrowed for the call.
    check(unsafe {
        ffi::hearth_fused_adam(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n,
            hyper.lr,
            lr.map_or(std::ptr::null_mut(), |t| t.as_ptr() as *mut C_tensor),
            hyper.betas.0,
            hyper.betas.1,
            hyper.weight_decay,
            hyper.eps,
            hyper.decoupled,
        )
    })
}

/// One SGD step with libtorch's `_fused_sgd_`. `momentum_buffers` must hold
/// one tensor per parameter when `hyper.momentum != 0` (filled from the
/// gradients when `first_step`), and may be empty otherwise.
pub fn fused_sgd(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: &[Tensor],
    hyper: SgdHyper,
    first_step: bool,
) -> Result<(), TchError> {
    let n = params.len();
    same_len("grads", n, grads.len())?;
    if hyper.momentum != 0.0 {
        same_len("momentum_buffers", n, momentum_buffers.len())?;
        same_layout("momentum_buffers", params, momentum_buffers)?;
    }
    same_layout("grads", params, grads)?;
    if n == 0 {
        return Ok(());
    }
    let (p, g, b) = (handles(params), handles(grads), handles(momentum_buffers));
    // SAFETY: as above; `b` is only read when momentum is non-zero.
    check(unsafe {
        ffi::hearth_fused_sgd(
            p.as_ptr(),
            g.as_ptr(),
            b.as_ptr(),
            n,
            hyper.lr,
            hyper.momentum,
            hyper.dampening,
            hyper.weight_decay,
            hyper.nesterov,
            first_step,
        )
    })
}

/// Drops the gradients of `tensors` (PyTorch's `zero_grad(set_to_none=True)`):
/// the next backward allocates fresh ones, and an optimizer skips
/// parameters that got none.
pub fn clear_grads(tensors: &[Tensor]) -> Result<(), TchError> {
    let t = handles(tensors);
    // SAFETY: live handles borrowed for the call.
    check(unsafe { ffi::hearth_clear_grads(t.as_ptr(), t.len()) })
}

/// Sets the gradient of `tensor` to `grad` (`param.grad = grad`), which
/// then holds `grad`'s storage.
pub fn set_grad(tensor: &Tensor, grad: &Tensor) -> Result<(), TchError> {
    // SAFETY: live handles borrowed for the call; the shim copies the
    // at::Tensor (a reference count), not the pointer.
    check(unsafe {
        ffi::hearth_set_grad(
            tensor.as_ptr() as *mut C_tensor,
            grad.as_ptr() as *mut C_tensor,
        )
    })
}

/// Makes libtorch call `ready(owner, index)` each time a backward pass has
/// accumulated a gradient into `tensor` (PyTorch's
/// `register_post_accumulate_grad_hook`), on the thread that accumulated it.
/// A tensor holds one such hook: this replaces any earlier one. `ready`
/// must not unwind.
pub fn on_grad_accumulated(
    tensor: &Tensor,
    ready: extern "C" fn(u64, u64),
    owner: u64,
    index: u64,
) -> Result<(), TchError> {
    // SAFETY: a live handle borrowed for the call; the hook keeps only the
    // function pointer and the two integers.
    check(unsafe {
        ffi::hearth_on_grad_accumulated(tensor.as_ptr() as *mut C_tensor, ready, owner, index)
    })
}

/// The `ord`-norm of each tensor (2: L2; `f64::INFINITY`: the largest
/// absolute value), as 0-dim tensors on the tensors' device.
pub fn foreach_norm(tensors: &[Tensor], ord: f64) -> Result<Vec<Tensor>, TchError> {
    if tensors.is_empty() {
        return Ok(Vec::new());
    }
    let t = handles(tensors);
    let mut out: Vec<*mut C_tensor> = vec![std::ptr::null_mut(); t.len()];
    // SAFETY: `out` has room for one handle per input; on success each is a
    // new at::Tensor whose ownership passes to a tch Tensor below.
    check(unsafe { ffi::hearth_foreach_norm(t.as_ptr(), t.len(), ord, out.as_mut_ptr()) })?;
    Ok(out
        .into_iter()
        .map(|p| unsafe { Tensor::from_ptr(p) })
        .collect())
}

/// `tensors[i] *= factor` in place, `factor` a 0-dim tensor (no host sync).
pub fn foreach_mul_(tensors: &[Tensor], factor: &Tensor) -> Result<(), TchError> {
    if tensors.is_empty() {
        return Ok(());
    }
    let t = handles(tensors);
    // SAFETY: live handles borrowed for the call.
    check(unsafe {
        ffi::hearth_foreach_mul_(t.as_ptr(), t.len(), factor.as_ptr() as *mut C_tensor)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn foreach_norm_matches_per_tensor_norm() {
        let a = Tensor::from_slice(&[3.0f32, 4.0]);
        let b = Tensor::from_slice(&[1.0f32, 2.0, 2.0]);
        let norms = foreach_norm(&[a.shallow_clone(), b.shallow_clone()], 2.0).unwrap();
        assert_eq!(f64::try_from(&norms[0]).unwrap(), 5.0);
        assert_eq!(f64::try_from(&norms[1]).unwrap(), 3.0);
        let norms = foreach_norm(&[a.shallow_clone(), b.shallow_clone()], 1.0).unwrap();
        assert_eq!(f64::try_from(&norms[0]).unwrap(), 7.0);
        assert_eq!(f64::try_from(&norms[1]).unwrap(), 5.0);
        let norms = foreach_norm(&[a, -b], f64::INFINITY).unwrap();
        assert_eq!(f64::try_from(&norms[0]).unwrap(), 4.0);
        assert_eq!(f64::try_from(&norms[1]).unwrap(), 2.0);
    }

    #[test]
    fn foreach_mul_scales_in_place() {
        let a = Tensor::ones([3], (Kind::Float, Device::Cpu));
        foreach_mul_(&[a.shallow_clone()], &Tensor::from(0.5f32)).unwrap();
        assert_eq!(f64::try_from(a.sum(Kind::Float)).unwrap(), 1.5);
    }

    #[test]
    fn a_gradient_of_the_wrong_shape_is_refused_before_the_kernel() {
        let p = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let g = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        let m = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let v = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let s = Tensor::zeros([], (Kind::Float, Device::Cpu));
        let hyper = AdamHyper {
            lr: 1e-3,
            betas: (0.9, 0.999),
            weight_decay: 0.0,
            eps: 1e-8,
            decoupled: true,
        };
        let err = fused_adam(&[p], &[g], &[m], &[v], &[s], hyper, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("grads[0]"), "{err}");
    }

    #[test]
    fn a_kernel_error_becomes_a_tch_error() {
        // Integer parameters: the fused kernel throws, the wrapper reports it.
        let t = || Tensor::zeros([2], (Kind::Int64, Device::Cpu));
        let s = Tensor::zeros([], (Kind::Float, Device::Cpu));
        let hyper = AdamHyper {
            lr: 1e-3,
            betas: (0.9, 0.999),
            weight_decay: 0.0,
            eps: 1e-8,
            decoupled: true,
        };
        assert!(matches!(
            fused_adam(&[t()], &[t()], &[t()], &[t()], &[s], hyper, None),
            Err(TchError::Torch(_))
        ));
    }
}
