//! A TorchScript file loaded without reading its weights
//! (`csrc/jit_lazy.cpp`): the module's tensors are allocated but never
//! written, so they take no memory, until [`LazyWeights::read`] reads a
//! storage's bytes from the file, one unit at a time where a model is
//! sharded as it is read.

use super::ffi;
use super::foreach::check;
use super::jit::ScriptModule;
use std::ffi::{c_void, CString};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use tch::{TchError, Tensor};
use torch_sys::C_tensor;

/// The tensors of a lazily loaded module whose bytes are still in its file.
pub struct LazyWeights {
    handle: NonNull<c_void>,
    file: std::fs::File,
    path: PathBuf,
}

// SAFETY: the C++ side guards its table with a mutex; the file is a file.
unsafe impl Send for LazyWeights {}

impl Drop for LazyWeights {
    fn drop(&mut self) {
        // SAFETY: from hearth_jit_load_lazy, freed once.
        unsafe { ffi::hearth_jit_lazy_free(self.handle.as_ptr()) }
    }
}

/// The memory and byte size of `t`'s storage (0 for none).
fn storage_of(t: &Tensor) -> (u64, u64) {
    let (mut memory, mut bytes) = (0u64, 0u64);
    // SAFETY: a live tensor; the two numbers are written.
    unsafe { ffi::hearth_storage_of(t.as_ptr() as *mut C_tensor, &mut memory, &mut bytes) };
    (memory, bytes)
}

impl ScriptModule {
    /// Loads the TorchScript file at `path` on the CPU without reading its
    /// tensors' bytes: every parameter and buffer is allocated, holds no
    /// values and takes no memory until [`LazyWeights::read`] reads it.
    pub fn load_lazy(path: &Path) -> Result<(Self, LazyWeights), TchError> {
        use std::os::unix::ffi::OsStrExt;
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| TchError::FileFormat(format!("{}: a NUL in the path", path.display())))?;
        let file = std::fs::File::open(path)
            .map_err(|e| TchError::Torch(format!("{}: {e}", path.display())))?;
        let (mut module, mut lazy) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: both out-pointers receive new objects on success.
        check(unsafe { ffi::hearth_jit_load_lazy(c_path.as_ptr(), &mut module, &mut lazy) })?;
        let module = NonNull::new(module)
            .ok_or_else(|| TchError::Torch("loading returned no module".into()))?;
        let handle = NonNull::new(lazy)
            .ok_or_else(|| TchError::Torch("loading returned no table".into()))?;
        Ok((
            Self::from_handle(module),
            LazyWeights {
                handle,
                file,
                path: path.into(),
            },
        ))
    }
}

impl LazyWeights {
    /// Reads the bytes of `t`'s storage from the file, when they are still
    /// there: true when it read them, false when the storage already had
    /// its values (read before, or not from the file).
    pub fn read(&self, t: &Tensor) -> Result<bool, TchError> {
        let (memory, bytes) = storage_of(t);
        let (mut offset, mut size) = (0u64, 0u64);
        // SAFETY: a live table; the two numbers are written when found.
        let found = memory != 0
            && unsafe {
                ffi::hearth_jit_lazy_find(self.handle.as_ptr(), memory, &mut offset, &mut size)
            };
        if !found {
            return Ok(false);
        }
        if size != bytes {
            return Err(TchError::Torch(format!(
                "{}: a tensor record of {size} bytes for a storage of {bytes}",
                self.path.display()
            )));
        }
        // SAFETY: `memory` is the live storage of `t`, `size` bytes long,
        // which nothing else reads or writes while it is filled.
        let into = unsafe { std::slice::from_raw_parts_mut(memory as *mut u8, size as usize) };
        self.file
            .read_exact_at(into, offset)
            .map_err(|e| TchError::Torch(format!("{}: {e}", self.path.display())))?;
        // SAFETY: a live table.
        unsafe { ffi::hearth_jit_lazy_done(self.handle.as_ptr(), memory) };
        Ok(true)
    }
}
