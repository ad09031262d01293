//! TorchScript modules through the shim: tch's `CModule` lists neither a
//! module's submodules nor its buffers, so hearth loads and runs
//! TorchScript files itself.

use super::ffi;
use super::foreach::check;
use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::NonNull;
use tch::{Device, TchError, Tensor};
use torch_sys::C_tensor;

/// What a TorchScript module holds, in libtorch's (declaration) order.
#[derive(Debug, Default)]
pub struct JitStructure {
    /// Every submodule's path (`""` first, the root) and the last part of
    /// its qualified class name (`Block` for `__torch__.peer.Block`).
    pub modules: Vec<(String, String)>,
    /// Every parameter, by name (a tied one under each of its names); the
    /// handles share the module's own tensors.
    pub parameters: Vec<(String, Tensor)>,
    /// Every buffer, by name; the handles share the module's own tensors.
    pub buffers: Vec<(String, Tensor)>,
}

/// The class of a TorchScript qualified name: its last part.
fn class_of(qualified: &str) -> String {
    qualified
        .rsplit('.')
        .next()
        .unwrap_or(qualified)
        .to_string()
}

/// # Safety
/// `ctx` must be the `JitStructure` that [`ScriptModule::structure`]
/// passes, and the strings live NUL-terminated C strings.
unsafe fn strings<'a>(ctx: *mut c_void, name: *const c_char) -> (&'a mut JitStructure, String) {
    (
        &mut *(ctx as *mut JitStructure),
        CStr::from_ptr(name).to_string_lossy().into_owned(),
    )
}

extern "C" fn on_module(ctx: *mut c_void, path: *const c_char, class: *const c_char) {
    // SAFETY: see `strings`.
    let (structure, path, class) = unsafe {
        let (s, p) = strings(ctx, path);
        (s, p, CStr::from_ptr(class).to_string_lossy())
    };
    structure.modules.push((path, class_of(&class)));
}

extern "C" fn on_parameter(ctx: *mut c_void, name: *const c_char, tensor: *mut C_tensor) {
    // SAFETY: see `strings`; `tensor` is a new at::Tensor handed over.
    let (structure, name, tensor) = unsafe {
        let (s, n) = strings(ctx, name);
        (s, n, Tensor::from_ptr(tensor))
    };
    structure.parameters.push((name, tensor));
}

extern "C" fn on_buffer(ctx: *mut c_void, name: *const c_char, tensor: *mut C_tensor) {
    // SAFETY: as in `on_parameter`.
    let (structure, name, tensor) = unsafe {
        let (s, n) = strings(ctx, name);
        (s, n, Tensor::from_ptr(tensor))
    };
    structure.buffers.push((name, tensor));
}

/// What [`ScriptModule::fuse`] rewrote, and what it saw and left.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fused {
    /// tanh-GELU chains now one `aten::gelu(x, approximate="tanh")`.
    pub tanh_gelu: usize,
    /// Concatenations of an empty constant and a tensor, now the tensor.
    pub empty_concatenations: usize,
    /// Attentions of q, k, v split from one projection, now hearth's.
    pub attention: usize,
    /// Those of them under a mask the graph computes, which runs hearth's
    /// kernels when it is causal or all true ([`masked_attention_calls`]).
    pub masked_attention: usize,
    /// RMSNorm chains (Llama, Qwen2, Mistral) now `hearth::rms_norm`.
    pub rms_norm: usize,
    /// SiLU-gated MLPs, `silu(gate(x)) * up(x)`, now `hearth::swiglu`.
    pub swiglu: usize,
    /// Rotary embeddings, `q * cos + rotate_half(q) * sin`, now `hearth::rotary`.
    pub rotary: usize,
    /// Attentions of separate q, k and v projections (grouped-query heads
    /// taken before `repeat_kv`'s copies) now `hearth::attention`.
    pub separate_attention: usize,
    /// Those of them under a mask the graph computes, checked on each call
    /// ([`masked_attention_calls`]): causal or all true runs libtorch's
    /// attention without the mask.
    pub masked_separate_attention: usize,
    /// Each chain the pass saw and left as it was, with the reason (a
    /// pattern's anchor op outside any of its matches).
    pub unfused: Vec<String>,
}

/// How often, in this process, a rewritten attention under a computed mask
/// found it causal, all true (both run hearth's kernels), or anything else
/// (libtorch's masked attention).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaskedAttentionCalls {
    /// Calls whose mask was the causal pattern.
    pub causal: u64,
    /// Calls whose mask let every position see every other.
    pub full: u64,
    /// Calls with any other mask.
    pub other: u64,
}

/// The counts of [`MaskedAttentionCalls`] so far.
pub fn masked_attention_calls() -> MaskedAttentionCalls {
    let mut out = [0i64; 3];
    // SAFETY: `out` holds the three numbers it writes.
    unsafe { ffi::hearth_masked_attention_calls(out.as_mut_ptr()) };
    MaskedAttentionCalls {
        causal: out[0] as u64,
        full: out[1] as u64,
        other: out[2] as u64,
    }
}

impl Fused {
    /// Whether anything was rewritten.
    pub fn any(&self) -> bool {
        self.rewrites() > 0
    }

    /// How many rewrites in all (the masked counts are part of theirs).
    pub fn rewrites(&self) -> usize {
        self.tanh_gelu
            + self.empty_concatenations
            + self.attention
            + self.rms_norm
            + self.swiglu
            + self.rotary
            + self.separate_attention
    }
}

impl std::fmt::Display for Fused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} tanh-GELU chain(s) fused into aten::gelu, {} empty concatenation(s) dropped, \
             {} attention(s) now hearth's",
            self.tanh_gelu, self.empty_concatenations, self.attention
        )?;
        if self.masked_attention > 0 {
            write!(
                f,
                " ({} under a mask, checked on each call)",
                self.masked_attention
            )?;
        }
        let llama = [
            (self.rms_norm, "RMSNorm(s)"),
            (self.swiglu, "SiLU-gated MLP(s)"),
            (self.rotary, "rotary embedding(s)"),
        ];
        for (n, what) in llama.iter().filter(|(n, _)| *n > 0) {
            write!(f, ", {n} {what} fused")?;
        }
        if self.separate_attention > 0 {
            write!(
                f,
                ", {} attention(s) of separate q, k, v now hearth's ({} under a mask, \
                 checked on each call)",
                self.separate_attention, self.masked_separate_attention
            )?;
        }
        Ok(())
    }
}

/// `text`'s lines, each once in the order first seen, those seen more than
/// once with their count (every layer of a model reports the same).
fn counted_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<(&str, usize)> = Vec::new();
    for line in text.lines() {
        match lines.iter_mut().find(|(l, _)| *l == line) {
            Some((_, n)) => *n += 1,
            None => lines.push((line, 1)),
        }
    }
    lines
        .into_iter()
        .map(|(l, n)| {
            if n > 1 {
                format!("{l} (×{n})")
            } else {
                l.to_string()
            }
        })
        .collect()
}

/// This process's kernel path with the Llama-family pattern kernels'
/// deliberate error (`csrc/kernel_paths.h`'s `kPatternOff`): what the
/// graph tests load a model with to see that they catch it.
#[doc(hidden)]
pub fn pattern_kernels_mutated() -> i32 {
    crate::cpu_kernels().map_or(0, |path| path.code()) | (3 << 8)
}

/// A loaded TorchScript module (`torch.jit.load`).
pub struct ScriptModule(NonNull<c_void>);

// SAFETY: a torch::jit::Module is a handle to a reference-counted object
// that libtorch lets any one thread use at a time; hearth never shares one
// without a lock.
unsafe impl Send for ScriptModule {}

impl Drop for ScriptModule {
    fn drop(&mut self) {
        // SAFETY: the pointer came from hearth_jit_load and is freed once.
        unsafe { ffi::hearth_jit_free(self.0.as_ptr()) }
    }
}

impl ScriptModule {
    /// A handle to the torch::jit::Module at `module` (a new one, owned).
    pub(crate) fn from_handle(module: NonNull<c_void>) -> Self {
        Self(module)
    }

    /// The torch::jit::Module behind this handle.
    pub(crate) fn as_ptr(&self) -> *mut c_void {
        self.0.as_ptr()
    }

    /// Loads the TorchScript file at `path` onto `device` (the CPU or a
    /// CUDA device).
    pub fn load(path: &std::path::Path, device: Device) -> Result<Self, TchError> {
        use std::os::unix::ffi::OsStrExt;
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| TchError::FileFormat(format!("{}: a NUL in the path", path.display())))?;
        let index = match device {
            Device::Cpu => -1,
            Device::Cuda(i) => i as i32,
            other => {
                return Err(TchError::Torch(format!(
                    "TorchScript models load on the CPU or a CUDA device, not {other:?}"
                )))
            }
        };
        let mut out = std::ptr::null_mut();
        // SAFETY: `out` receives a new module on success.
        check(unsafe { ffi::hearth_jit_load(c_path.as_ptr(), index, &mut out) })?;
        NonNull::new(out)
            .map(Self)
            .ok_or_else(|| TchError::Torch("loading returned no module".into()))
    }

    /// Its submodules, parameters and buffers.
    pub fn structure(&self) -> Result<JitStructure, TchError> {
        let mut structure = JitStructure::default();
        // SAFETY: the callbacks get `structure` back, which outlives the call.
        check(unsafe {
            ffi::hearth_jit_list(
                self.0.as_ptr(),
                on_module,
                on_parameter,
                on_buffer,
                &mut structure as *mut JitStructure as *mut c_void,
            )
        })?;
        Ok(structure)
    }

    /// Switches the module (and all below it) to training or evaluation.
    pub fn set_train(&mut self, on: bool) -> Result<(), TchError> {
        // SAFETY: a live module.
        check(unsafe { ffi::hearth_jit_train(self.0.as_ptr(), on) })
    }

    /// Rewrites the graphs of every method of every module into fewer
    /// operators that compute the same: transformers' tanh-GELU chain
    /// (mul, pow, mul, add, mul, tanh, add, mul) becomes `aten::gelu(x,
    /// approximate="tanh")`, and a concatenation of an empty constant (a
    /// traced empty cache) before a tensor becomes that tensor
    /// (`csrc/jit_fuse.cpp`); where hearth's CPU kernels run
    /// ([`cpu_kernels`](crate::cpu_kernels())), q, k and v split out of one
    /// packed projection into `scaled_dot_product_attention` become
    /// hearth's self-attention on that projection, for a module on the CPU
    /// (`device`, where it was loaded). Call it before the first `forward`.
    pub fn fuse(&mut self, device: Device) -> Result<Fused, TchError> {
        // A kernel path this process cannot honour is refused when hearth
        // starts; here it only means no attention rewrite.
        let kernels = crate::cpu_kernels().map_or(0, |path| path.code());
        self.fuse_with(device, kernels)
    }

    /// [`ScriptModule::fuse`] with the kernels `code` names
    /// (`csrc/kernel_paths.h`: a path, and in tests a deliberate error).
    #[doc(hidden)]
    pub fn fuse_with(&mut self, device: Device, code: i32) -> Result<Fused, TchError> {
        let mut counts = [0i64; 9];
        let mut report: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live module; `counts` holds the nine numbers it writes,
        // and `report` receives a malloc'd string or null.
        check(unsafe {
            ffi::hearth_jit_fuse(
                self.0.as_ptr(),
                code,
                device == Device::Cpu,
                counts.as_mut_ptr(),
                &mut report,
            )
        })?;
        let unfused = if report.is_null() {
            Vec::new()
        } else {
            // SAFETY: a NUL-terminated string from strdup, freed once here
            // by the library's own free function.
            let text = unsafe { CStr::from_ptr(report) }
                .to_string_lossy()
                .into_owned();
            unsafe { ffi::hearth_free_error(report) };
            counted_lines(&text)
        };
        let n = |i: usize| counts[i] as usize;
        Ok(Fused {
            tanh_gelu: n(0),
            empty_concatenations: n(1),
            attention: n(2),
            masked_attention: n(3),
            rms_norm: n(4),
            swiglu: n(5),
            rotary: n(6),
            separate_attention: n(7),
            masked_separate_attention: n(8),
            unfused,
        })
    }

    /// Runs `forward(inputs...)`: a tensor, or the first element of a
    /// tuple when it is one (transformers' outputs with `torchscript=True`);
    /// anything else is an error.
    pub fn forward(&self, inputs: &[&Tensor]) -> Result<Tensor, TchError> {
        let mut out = std::ptr::null_mut();
        let handles: Vec<*mut C_tensor> =
            inputs.iter().map(|t| t.as_ptr() as *mut C_tensor).collect();
        // SAFETY: a live module and tensors; `out` receives a new tensor.
        check(unsafe {
            ffi::hearth_jit_forward(
                self.0.as_ptr(),
                handles.as_ptr(),
                handles.len() as std::ffi::c_int,
                &mut out,
            )
        })?;
        // SAFETY: a new at::Tensor handed over on success.
        Ok(unsafe { Tensor::from_ptr(out) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_the_last_part_of_qualified_names() {
        assert_eq!(class_of("__torch__.peer.Block"), "Block");
        assert_eq!(
            class_of("__torch__.torch.nn.modules.linear.___torch_mangle_0.Linear"),
            "Linear"
        );
    }
}
