//! The raw C ABI of `host/ops/csrc/shim.cpp`. Only the safe wrappers beside it call these.

use std::os::raw::{c_char, c_int};
use torch_sys::C_tensor;

extern "C" {
    pub fn hearth_free_error(error: *mut c_char);
    pub fn hearth_fused_adam(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: usize,
        lr: f64,
        lr_tensor: *mut C_tensor,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        decoupled: bool,
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
        ord: f64,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_foreach_mul_(
        tensors: *const *mut C_tensor,
        n: usize,
        factor: *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_amp_unscale_(
        grads: *const *mut C_tensor,
        n: usize,
        found_inf: *mut C_tensor,
        inv_scale: *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_amp_update_scale_(
        scale: *mut C_tensor,
        growth_tracker: *mut C_tensor,
        found_inf: *mut C_tensor,
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: i64,
    ) -> *mut c_char;
    pub fn hearth_autocast_cache(enabled: bool, was: *mut bool) -> *mut c_char;
    pub fn hearth_cuda_versions(
        cudart: *mut std::os::raw::c_long,
        cudnn: *mut std::os::raw::c_long,
    ) -> *mut c_char;
    pub fn hearth_autocast_set(
        device_type: c_int,
        enabled: bool,
        dtype: c_int,
        entering: bool,
        was_enabled: *mut bool,
        was_dtype: *mut c_int,
    ) -> *mut c_char;
    pub fn hearth_empty_device_cache() -> *mut c_char;
    pub fn hearth_use_deterministic_algorithms(on: i32) -> *mut c_char;
    pub fn hearth_deterministic_algorithms() -> i32;
    pub fn hearth_to_pinned_host(t: *mut C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn hearth_copy_non_blocking(dst: *mut C_tensor, src: *mut C_tensor) -> *mut c_char;
    pub fn hearth_randperm(n: i64, seed: u64, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn hearth_randn_seeded(
        dims: *const i64,
        ndims: *const usize,
        count: usize,
        dtype: c_int,
        seed: u64,
        outs: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_set_grad(tensor: *mut C_tensor, grad: *mut C_tensor) -> *mut c_char;
    pub fn hearth_on_grad_accumulated(
        tensor: *mut C_tensor,
        ready: extern "C" fn(u64, u64),
        owner: u64,
        index: u64,
    ) -> *mut c_char;
    pub fn hearth_clear_grads(tensors: *const *mut C_tensor, n: usize) -> *mut c_char;
    pub fn hearth_rng_get_state(
        device_type: c_int,
        index: c_int,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_rng_set_state(
        device_type: c_int,
        index: c_int,
        state: *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_jit_load(
        path: *const c_char,
        cuda_index: c_int,
        out: *mut *mut std::ffi::c_void,
    ) -> *mut c_char;
    pub fn hearth_jit_free(module: *mut std::ffi::c_void);
    pub fn hearth_jit_list(
        module: *mut std::ffi::c_void,
        on_module: extern "C" fn(*mut std::ffi::c_void, *const c_char, *const c_char),
        on_parameter: extern "C" fn(*mut std::ffi::c_void, *const c_char, *mut C_tensor),
        on_buffer: extern "C" fn(*mut std::ffi::c_void, *const c_char, *mut C_tensor),
        ctx: *mut std::ffi::c_void,
    ) -> *mut c_char;
    pub fn hearth_jit_train(module: *mut std::ffi::c_void, on: bool) -> *mut c_char;
    pub fn hearth_jit_fuse(
        module: *mut std::ffi::c_void,
        kernels: i32,
        on_cpu: bool,
        counts: *mut i64,
        report: *mut *mut c_char,
    ) -> *mut c_char;
    pub fn hearth_masked_attention_calls(out: *mut i64);
    pub fn hearth_jit_forward(
        module: *mut std::ffi::c_void,
        inputs: *const *mut C_tensor,
        n: std::ffi::c_int,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_jit_load_lazy(
        path: *const c_char,
        out: *mut *mut std::ffi::c_void,
        lazy: *mut *mut std::ffi::c_void,
    ) -> *mut c_char;
    pub fn hearth_jit_lazy_free(lazy: *mut std::ffi::c_void);
    pub fn hearth_storage_of(t: *mut C_tensor, memory: *mut u64, bytes: *mut u64);
    pub fn hearth_jit_lazy_find(
        lazy: *mut std::ffi::c_void,
        memory: u64,
        offset: *mut u64,
        size: *mut u64,
    ) -> bool;
    pub fn hearth_jit_lazy_done(lazy: *mut std::ffi::c_void, memory: u64);
    pub fn hearth_storage_bytes(t: *mut C_tensor) -> i64;
    pub fn hearth_storage_free(t: *mut C_tensor) -> *mut c_char;
    pub fn hearth_storage_take(t: *mut C_tensor, values: *mut C_tensor) -> *mut c_char;
    pub fn hearth_autograd_backward(
        tensors: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        n: c_int,
    ) -> *mut c_char;
    pub fn hearth_jit_cut(
        module: *mut std::ffi::c_void,
        units: *const *const c_char,
        n: c_int,
        out: *mut *mut std::ffi::c_void,
    ) -> *mut c_char;
    pub fn hearth_jit_cut_free(program: *mut std::ffi::c_void);
    pub fn hearth_jit_cut_pieces(program: *mut std::ffi::c_void) -> c_int;
    pub fn hearth_jit_cut_piece(
        program: *mut std::ffi::c_void,
        k: c_int,
        inputs: *mut i64,
        outputs: *mut i64,
        name: extern "C" fn(*mut std::ffi::c_void, c_int, *const c_char),
        ctx: *mut std::ffi::c_void,
    ) -> *mut c_char;
    pub fn hearth_jit_cut_run(
        program: *mut std::ffi::c_void,
        k: c_int,
        inputs: *const *mut C_tensor,
        n: c_int,
        give: extern "C" fn(*mut std::ffi::c_void, *mut C_tensor),
        ctx: *mut std::ffi::c_void,
    ) -> *mut c_char;
}

// host/ops/csrc/gelu.cpp: the exact GELU that keeps its derivative for backward.
extern "C" {
    pub fn hearth_gelu(x: *mut C_tensor, kernels: i32, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn hearth_rms_norm(
        x: *mut C_tensor,
        weight: *mut C_tensor,
        eps: f64,
        kernels: i32,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_swiglu(
        gate: *mut C_tensor,
        up: *mut C_tensor,
        kernels: i32,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_rotary(
        x: *mut C_tensor,
        cos: *mut C_tensor,
        sin: *mut C_tensor,
        kernels: i32,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_cpu_has_avx2_fma() -> bool;
    pub fn hearth_cpu_has_avx512f() -> bool;
    pub fn hearth_cpu_capability(buf: *mut c_char, len: usize) -> usize;
}

// host/ops/csrc/exp_avx2.cpp: the AVX2 kernels' exp, for its test.
#[cfg(all(test, target_arch = "x86_64"))]
extern "C" {
    pub fn hearth_exp_nonpositive_avx2(x: *const f32, y: *mut f32, n: i64, mutation: i32);
}

// host/ops/csrc/attention_avx2.cpp: the width of the attention's tiles on a
// path, for its test.
#[cfg(all(test, target_arch = "x86_64"))]
extern "C" {
    pub fn hearth_attention_tile_lanes(code: i32) -> i64;
}

// host/ops/csrc/attention.cpp: self-attention from a packed qkv projection.
extern "C" {
    pub fn hearth_self_attention(
        qkv: *mut C_tensor,
        heads: i64,
        causal: bool,
        kernels: i32,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn hearth_self_attention_fused(qkv: *mut C_tensor, heads: i64, kernels: i32) -> bool;
}

// host/ops/csrc/profiler.cpp: libtorch's Kineto profiler and record_function spans.
extern "C" {
    pub fn hearth_profiler_prepare(
        activities: c_int,
        shapes: bool,
        memory: bool,
        stack: bool,
        flops: bool,
        modules: bool,
    ) -> *mut c_char;
    pub fn hearth_profiler_enable(
        activities: c_int,
        shapes: bool,
        memory: bool,
        stack: bool,
        flops: bool,
        modules: bool,
    ) -> *mut c_char;
    pub fn hearth_profiler_add_metadata(key: *const c_char, value: *const c_char) -> *mut c_char;
    pub fn hearth_profiler_disable(out: *mut *mut std::ffi::c_void) -> *mut c_char;
    pub fn hearth_profiler_save(result: *mut std::ffi::c_void, path: *const c_char) -> *mut c_char;
    pub fn hearth_profiler_result_free(result: *mut std::ffi::c_void);
    pub fn hearth_profiler_events(
        result: *mut std::ffi::c_void,
        ctx: *mut std::ffi::c_void,
        on_event: extern "C" fn(
            *mut std::ffi::c_void,
            *const c_char,
            u64,
            u64,
            u64,
            u8,
            c_int,
            u64,
            i64,
        ),
    ) -> *mut c_char;
    pub fn hearth_span_enter(name: *const c_char) -> *mut std::ffi::c_void;
    pub fn hearth_span_exit(span: *mut std::ffi::c_void);
}
