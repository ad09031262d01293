//! hearth's ground floor, below every other hearth crate.
//!
//! Typed Rust bindings to libtorch pieces that tch does not expose (the C++
//! shim in `csrc/shim.cpp`): fused optimizer steps, foreach norms, the
//! gradient scaler's kernels, autocast on any device and generator states,
//! and hearth's own fused kernels. Beside them, what every layer above
//! needs and nothing above owns: tensors as bytes ([`tensor`]), crash-safe
//! file writes ([`durable`]) and Accelerate's enum spellings ([`spelling`]).
#![warn(missing_docs)]

mod amp;
pub mod cpu_kernels;
pub mod cuda;
pub mod cuda_graph;
pub mod cuda_loss;
pub mod durable;
mod ffi;
mod foreach;
mod fused;
mod jit;
mod jit_lazy;
mod jit_units;
pub mod profiler;
mod rng;
pub mod spelling;
mod storage;
pub mod tensor;

pub use amp::{amp_unscale_, amp_update_scale_, autocast_cache_enabled, AutocastGuard};
pub use cpu_kernels::{cpu_kernels, CpuKernels, CpuKernelsError};
pub use foreach::{
    clear_grads, foreach_mul_, foreach_norm, fused_adam, fused_sgd, on_grad_accumulated, set_grad,
    AdamHyper, SgdHyper,
};
pub use fused::{gelu, rms_norm, rotary, self_attention, self_attention_is_fused, swiglu};
pub use jit::{
    masked_attention_calls, pattern_kernels_mutated, Fused, JitStructure, MaskedAttentionCalls,
    ScriptModule,
};
pub use jit_lazy::LazyWeights;
pub use jit_units::{CutForward, Piece};
pub use rng::{
    copy_non_blocking, deterministic_algorithms, empty_device_cache, randn_seeded, randperm,
    rng_state, set_rng_state, to_pinned_host, use_deterministic_algorithms,
};
pub use storage::{backward, free_storage, storage_bytes, take_storage};

/// What hearth sets up before `main` (an ELF constructor, in every program
/// linking hearth): libtorch_cuda is loaded where a driver is
/// ([`cuda::runtime`]), so the first libtorch call already finds the CUDA
/// hooks.
///
/// Transparent huge pages for libtorch's CPU allocator
/// (`THP_MEM_ALLOC_ENABLE=1`) were tried here and left out: they cut the
/// page faults of a 3 GB save_state from 1.74 M to 0.24 M, but with the
/// kernel's THP defrag set to `madvise` (Debian's default) every huge-page
/// fault may compact memory synchronously, and with the page cache full of
/// the checkpoint being written the save took 2.7x as long (7.4-8.3 s
/// against 2.8-3.0 s) and its load 2.5x.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array"]
static BEFORE_MAIN: extern "C" fn() = {
    extern "C" fn before_main() {
        cuda::runtime();
    }
    before_main
};

/// Keeps the memory a training step frees for the next step instead of
/// handing it back to the system and faulting it in again. glibc trims the
/// top of its heap whenever 128 KiB or more (twice its dynamic mmap
/// threshold) is free there, which happens at the end of every step, when
/// the activations go: on the bench GPT that was ~4 000 page faults per
/// step and ~7 % of its time (perf). This sets `M_TRIM_THRESHOLD` to
/// 256 MiB and, since setting it freezes glibc's dynamic mmap threshold,
/// `M_MMAP_THRESHOLD` to 32 MiB, the most that dynamic threshold reaches
/// (blocks that large are still mapped and unmapped one by one).
/// Process-wide and idempotent; left alone when any of glibc's
/// `MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TOP_PAD_`
/// variables is set. [`free_large_blocks_at_once`] and
/// [`return_freed_host_memory`] still act after it.
pub fn keep_freed_memory_for_reuse() {
    #[cfg(target_env = "gnu")]
    {
        let tuned_by_user = [
            "MALLOC_TRIM_THRESHOLD_",
            "MALLOC_MMAP_THRESHOLD_",
            "MALLOC_TOP_PAD_",
        ]
        .iter()
        .any(|var| std::env::var_os(var).is_some());
        if tuned_by_user {
            return;
        }
        // SAFETY: mallopt only sets glibc tunables.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
        }
    }
}

/// Makes glibc hand blocks of at least `bytes` back to the system as soon
/// as they are freed (`mallopt(M_MMAP_THRESHOLD)`, which also stops glibc
/// raising that threshold as large blocks are freed). FULL_SHARD gathers
/// and frees whole units every step; without it their memory stays in the
/// heap once the threshold has grown past their size. Process-wide; the
/// `MALLOC_MMAP_THRESHOLD_` environment variable, when set, wins.
pub fn free_large_blocks_at_once(bytes: usize) {
    #[cfg(target_env = "gnu")]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // SAFETY: mallopt only sets a glibc tunable.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, bytes.min(i32::MAX as usize) as i32);
        }
    }
}

/// Returns the host memory freed so far to the system (glibc's
/// `malloc_trim`). Freed tensors smaller than glibc's mmap threshold (which
/// grows to 32 MiB as large blocks are freed) otherwise stay in the
/// process's heap: FULL_SHARD calls it once it has released the whole
/// model it was built from.
pub fn return_freed_host_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks glibc's own heap structures.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `e` and its causes, joined with `: ` (one line for a log or a panic).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut at = e.source();
    while let Some(cause) = at {
        parts.push(cause.to_string());
        at = cause.source();
    }
    parts.join(": ")
}
