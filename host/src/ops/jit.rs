//! What tch does not tell about a TorchScript file: its submodules with
//! their classes, and its buffers.

use super::ffi;
use super::foreach::check;
use std::ffi::{c_char, c_void, CStr, CString};
use tch::{TchError, Tensor};
use torch_sys::C_tensor;

/// The structure of a TorchScript module.
#[derive(Debug, Default)]
pub struct JitStructure {
    /// Every submodule's path (`""` first, the root) and the last part of
    /// its qualified class name (`Block` for `__torch__.peer.Block`).
    pub modules: Vec<(String, String)>,
    /// Every buffer, by name.
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

extern "C" fn on_module(ctx: *mut c_void, path: *const c_char, class: *const c_char) {
    // SAFETY: `ctx` is the JitStructure `structure` passes; the strings are
    // live NUL-terminated C strings for the call.
    let (structure, path, class) = unsafe {
        (
            &mut *(ctx as *mut JitStructure),
            CStr::from_ptr(path).to_string_lossy().into_owned(),
            CStr::from_ptr(class).to_string_lossy(),
        )
    };
    structure.modules.push((path, class_of(&class)));
}

extern "C" fn on_buffer(ctx: *mut c_void, name: *const c_char, tensor: *mut C_tensor) {
    // SAFETY: as in `on_module`; `tensor` is a new at::Tensor handed over.
    let (structure, name, tensor) = unsafe {
        (
            &mut *(ctx as *mut JitStructure),
            CStr::from_ptr(name).to_string_lossy().into_owned(),
            Tensor::from_ptr(tensor),
        )
    };
    structure.buffers.push((name, tensor));
}

/// Loads the TorchScript file at `path` on the CPU and lists its submodules
/// and buffers.
pub fn jit_structure(path: &std::path::Path) -> Result<JitStructure, TchError> {
    let c_path = CString::new(path.to_string_lossy().as_bytes())
        .map_err(|_| TchError::FileFormat(format!("{}: a NUL in the path", path.display())))?;
    let mut structure = JitStructure::default();
    // SAFETY: the callbacks get `structure` back, which outlives the call.
    check(unsafe {
        ffi::hearth_jit_structure(
            c_path.as_ptr(),
            on_module,
            on_buffer,
            &mut structure as *mut JitStructure as *mut c_void,
        )
    })?;
    Ok(structure)
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
