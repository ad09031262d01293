//! A TorchScript module's forward pass cut at the calls of its units
//! (`csrc/jit_units.cpp`): pieces that run one after another, each on the
//! tensors the one before it gave, so that the host can hold one unit's
//! parameters whole at a time.

use super::ffi;
use super::foreach::check;
use super::jit::ScriptModule;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::NonNull;
use tch::{TchError, Tensor};
use torch_sys::C_tensor;

/// One piece of a cut forward pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Piece {
    /// The unit this piece calls (`m.model.layers.0`); `None` for the code
    /// between unit calls (embeddings, masks, the final norm and head).
    pub unit: Option<String>,
    /// The module paths it calls and the tensors it reads by name (all
    /// paths from the root): whose parameters must be whole while it runs.
    pub uses: Vec<String>,
    /// How many tensors it takes: for the first, the module's inputs.
    pub inputs: usize,
    /// How many tensors it gives: for the last, one (forward's result).
    pub outputs: usize,
}

/// A module's forward pass cut at its units ([`ScriptModule::cut`]). It
/// shares the module's object: parameters changed there (gathered,
/// released, trained) are what the pieces compute with.
pub struct CutForward {
    program: NonNull<c_void>,
    pieces: Vec<Piece>,
}

// SAFETY: as ScriptModule: the program holds handles to reference-counted
// libtorch objects that one thread at a time uses; hearth keeps it beside
// the module, behind the same lock.
unsafe impl Send for CutForward {}

impl Drop for CutForward {
    fn drop(&mut self) {
        // SAFETY: the pointer came from hearth_jit_cut and is freed once.
        unsafe { ffi::hearth_jit_cut_free(self.program.as_ptr()) }
    }
}

extern "C" fn on_name(ctx: *mut c_void, which: c_int, name: *const c_char) {
    // SAFETY: `ctx` is the Piece hearth_jit_cut_piece was given; `name` a
    // live NUL-terminated string.
    let (piece, name) = unsafe {
        (
            &mut *(ctx as *mut Piece),
            CStr::from_ptr(name).to_string_lossy().into_owned(),
        )
    };
    match which {
        0 => piece.unit = (!name.is_empty()).then_some(name),
        _ => piece.uses.push(name),
    }
}

extern "C" fn on_tensor(ctx: *mut c_void, tensor: *mut C_tensor) {
    // SAFETY: `ctx` is the Vec hearth_jit_cut_run was given; `tensor` a new
    // at::Tensor handed over.
    unsafe { (*(ctx as *mut Vec<Tensor>)).push(Tensor::from_ptr(tensor)) }
}

impl ScriptModule {
    /// Cuts `forward` at the calls of `units` (module paths; the root `""`
    /// is left out): the calls of the modules holding them are inlined, and
    /// the graph is cut before and after each unit call. An error names
    /// the unit and why it cannot be run alone (called inside control
    /// flow, never called, or a value that is not a tensor crossing the
    /// cut). Call it after [`fuse`](Self::fuse): the pieces copy the graphs
    /// as they are now.
    pub fn cut(&self, units: &[String]) -> Result<CutForward, TchError> {
        let names: Vec<CString> = units
            .iter()
            .map(|u| CString::new(u.as_str()))
            .collect::<Result<_, _>>()
            .map_err(|_| TchError::Torch("a NUL in a unit path".into()))?;
        let pointers: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
        let mut out = std::ptr::null_mut();
        // SAFETY: a live module, `pointers` live C strings; `out` receives a
        // new program on success.
        check(unsafe {
            ffi::hearth_jit_cut(
                self.as_ptr(),
                pointers.as_ptr(),
                pointers.len() as c_int,
                &mut out,
            )
        })?;
        let program =
            NonNull::new(out).ok_or_else(|| TchError::Torch("cutting returned nothing".into()))?;
        // SAFETY: a live program.
        let count = unsafe { ffi::hearth_jit_cut_pieces(program.as_ptr()) };
        let mut cut = CutForward {
            program,
            pieces: Vec::new(),
        };
        for k in 0..count {
            let mut piece = Piece::default();
            let (mut inputs, mut outputs) = (0i64, 0i64);
            // SAFETY: a live program and piece index; the callback gets
            // `piece` back, which outlives the call.
            check(unsafe {
                ffi::hearth_jit_cut_piece(
                    cut.program.as_ptr(),
                    k,
                    &mut inputs,
                    &mut outputs,
                    on_name,
                    &mut piece as *mut Piece as *mut c_void,
                )
            })?;
            piece.inputs = inputs as usize;
            piece.outputs = outputs as usize;
            cut.pieces.push(piece);
        }
        Ok(cut)
    }
}

impl CutForward {
    /// The pieces, in forward order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// Runs piece `k` on `inputs` (as many as it takes), giving its outputs.
    pub fn run(&self, k: usize, inputs: &[Tensor]) -> Result<Vec<Tensor>, TchError> {
        let handles: Vec<*mut C_tensor> =
            inputs.iter().map(|t| t.as_ptr() as *mut C_tensor).collect();
        let mut out: Vec<Tensor> = Vec::new();
        // SAFETY: a live program and tensors; the callback gets `out` back.
        check(unsafe {
            ffi::hearth_jit_cut_run(
                self.program.as_ptr(),
                k as c_int,
                handles.as_ptr(),
                handles.len() as c_int,
                on_tensor,
                &mut out as *mut Vec<Tensor> as *mut c_void,
            )
        })?;
        Ok(out)
    }
}
