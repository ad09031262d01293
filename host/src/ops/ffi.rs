//! The raw C ABI of `host/csrc/shim.cpp`. Only `foreach.rs` calls these.

use std::os::raw::c_char;
use torch_sys::C_tensor;

extern "C" {
    pub fn hearth_free_error(error: *mut c_char);
    pub fn hearth_fused_adamw(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> *mut c_char;
    pub fn hearth_fused_sgd(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        momentum_buffers: *const *mut C_tensor,
        n: usize,
        lr: f64,
        momentum: f64,
        dampening: f64,
        weight_decay: f64,
        nesterov: bool,
        first_step: bool,
    ) -> *mut c_char;
    pub fn hearth_foreach_norm(
        tensors: *const *mut C_tensor,
        n: usize,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_foreach_mul_(
        tensors: *const *mut C_tensor,
        n: usize,
        factor: *mut C_tensor,
    ) -> *mut c_char;
}
