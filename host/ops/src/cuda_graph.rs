//! CUDA graphs: libtorch's `at::cuda::CUDAGraph` (what `torch.cuda.graph`
//! wraps), so that a training step whose shapes never change is launched
//! as one graph instead of hundreds of kernels.
//!
//! The C++ side (`csrc/cuda_graph.cpp`) calls libtorch_cuda by symbol, and
//! hearth does not link libtorch_cuda (see [`super::cuda`]), so build.rs
//! makes it a shared library of its own, embedded in the binary; it is
//! written to an anonymous memory file and opened from there the first
//! time a graph is asked for, after libtorch_cuda is loaded. The same
//! library holds hearth's bfloat16 cross-entropy kernels
//! ([`super::cuda_loss`]).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// Why a CUDA graph could not be made or run.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GraphError {
    /// This process cannot use CUDA graphs (why, in words).
    #[error("CUDA graphs are unavailable: {0}")]
    Unavailable(String),
    /// libtorch refused (its message).
    #[error("CUDA graph: {0}")]
    Torch(String),
}

type Status = *mut c_char;
type FreeError = unsafe extern "C" fn(*mut c_char);
type NewGraph = unsafe extern "C" fn(*mut *mut c_void) -> Status;
type DeleteGraph = unsafe extern "C" fn(*mut c_void);
type StreamSwitch = unsafe extern "C" fn() -> Status;
type GraphCall = unsafe extern "C" fn(*mut c_void) -> Status;
type DeviceQuery =
    unsafe extern "C" fn(c_int, *mut c_char, usize, *mut c_int, *mut c_int) -> Status;
pub(crate) type DeviceCheck = unsafe extern "C" fn(c_int) -> Status;
pub(crate) type CrossEntropy =
    unsafe extern "C" fn(*mut c_void, *mut c_void, i64, *mut *mut c_void) -> Status;

/// The library's functions, resolved once.
pub(crate) struct Library {
    free_error: FreeError,
    new: NewGraph,
    delete: DeleteGraph,
    enter_side_stream: StreamSwitch,
    leave_side_stream: StreamSwitch,
    capture_begin: GraphCall,
    capture_end: GraphCall,
    replay: GraphCall,
    device: DeviceQuery,
    pub(crate) cross_entropy_available: DeviceCheck,
    pub(crate) cross_entropy_bf16: CrossEntropy,
}

impl Library {
    pub(crate) fn check(&self, status: Status) -> Result<(), GraphError> {
        if status.is_null() {
            return Ok(());
        }
        // SAFETY: a non-null status is a NUL-terminated strdup'd message.
        let text = unsafe { CStr::from_ptr(status) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: freed once, by the library that allocated it.
        unsafe { (self.free_error)(status) };
        Err(GraphError::Torch(text))
    }
}

pub(crate) fn library() -> Result<&'static Library, GraphError> {
    static LIBRARY: OnceLock<Result<Library, GraphError>> = OnceLock::new();
    LIBRARY.get_or_init(open).as_ref().map_err(Clone::clone)
}

#[cfg(not(hearth_cuda_graph))]
fn open() -> Result<Library, GraphError> {
    Err(GraphError::Unavailable(
        "this hearth was built without them (the cuda feature off, or no CUDA runtime headers beside torch at build time)".into(),
    ))
}

#[cfg(hearth_cuda_graph)]
fn open() -> Result<Library, GraphError> {
    if !super::cuda::is_available() {
        return Err(GraphError::Unavailable(format!(
            "no CUDA device (libtorch_cuda {})",
            super::cuda::runtime()
        )));
    }
    load_embedded()
}

/// Opens the embedded library and resolves its functions, without asking
/// for a GPU: what `host/hearth/tests/cuda/graphs.rs` checks on a machine without one (after
/// loading libtorch_cuda itself, which the library needs).
#[doc(hidden)]
pub fn check_embedded_library() -> Result<(), GraphError> {
    #[cfg(hearth_cuda_graph)]
    {
        load_embedded().map(|_| ())
    }
    #[cfg(not(hearth_cuda_graph))]
    {
        open().map(|_| ())
    }
}

#[cfg(hearth_cuda_graph)]
fn load_embedded() -> Result<Library, GraphError> {
    static IMAGE: &[u8] = include_bytes!(env!("HEARTH_CUDA_GRAPH_LIB"));
    let unavailable =
        |what: &str, e: std::io::Error| GraphError::Unavailable(format!("{what}: {e}"));
    // SAFETY: a plain syscall with a valid C string.
    let fd = unsafe { libc::memfd_create(c"hearth_cuda_graph".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(unavailable("memfd_create", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a new descriptor this function owns.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    std::io::Write::write_all(&mut file, IMAGE)
        .map_err(|e| unavailable("writing the library", e))?;
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
    // SAFETY: a valid path; the handle stays open for the process's life.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    drop(file);
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local message or null.
        let error = unsafe { libc::dlerror() };
        let text = if error.is_null() {
            "dlopen failed".to_string()
        } else {
            // SAFETY: non-null and NUL-terminated.
            unsafe { CStr::from_ptr(error) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(GraphError::Unavailable(format!(
            "the embedded CUDA graph library did not load: {text}"
        )));
    }
    macro_rules! symbol {
        ($name:literal, $type:ty) => {{
            // SAFETY: a valid handle and C string.
            let ptr = unsafe { libc::dlsym(handle, concat!($name, "\0").as_ptr().cast()) };
            if ptr.is_null() {
                return Err(GraphError::Unavailable(format!("{} is missing", $name)));
            }
            // SAFETY: the symbol is the extern "C" function of that name in
            // csrc/cuda_graph.cpp, whose signature the field declares.
            unsafe { std::mem::transmute::<*mut c_void, $type>(ptr) }
        }};
    }
    Ok(Library {
        free_error: symbol!("hearth_cg_free_error", FreeError),
        new: symbol!("hearth_cg_new", NewGraph),
        delete: symbol!("hearth_cg_delete", DeleteGraph),
        enter_side_stream: symbol!("hearth_cg_enter_side_stream", StreamSwitch),
        leave_side_stream: symbol!("hearth_cg_leave_side_stream", StreamSwitch),
        capture_begin: symbol!("hearth_cg_capture_begin", GraphCall),
        capture_end: symbol!("hearth_cg_capture_end", GraphCall),
        replay: symbol!("hearth_cg_replay", GraphCall),
        device: symbol!("hearth_cg_device", DeviceQuery),
        cross_entropy_available: symbol!("hearth_ce_available", DeviceCheck),
        cross_entropy_bf16: symbol!("hearth_ce_bf16", CrossEntropy),
    })
}

/// Whether this process can capture CUDA graphs, and if not why.
pub fn available() -> Result<(), GraphError> {
    library().map(|_| ())
}

/// GPU `index`'s name and compute capability (`"NVIDIA H200"`, (9, 0)).
pub fn device_properties(index: usize) -> Result<(String, (i32, i32)), GraphError> {
    let lib = library()?;
    let mut name = [0 as c_char; 256];
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the buffer's length is passed; the ints are written.
    lib.check(unsafe {
        (lib.device)(
            index as c_int,
            name.as_mut_ptr(),
            name.len(),
            &mut major,
            &mut minor,
        )
    })?;
    // SAFETY: snprintf NUL-terminated it within the buffer.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Ok((name, (major, minor)))
}

/// Runs `f` with a side stream current (the device idle before and after):
/// warm-up before a capture runs so, as `torch.cuda.graph`'s documentation
/// asks, and so does the capture itself.
pub fn on_side_stream<R>(f: impl FnOnce() -> R) -> Result<R, GraphError> {
    let lib = library()?;
    // SAFETY: no arguments; errors come back as messages.
    lib.check(unsafe { (lib.enter_side_stream)() })?;
    let result = f();
    // SAFETY: as above.
    lib.check(unsafe { (lib.leave_side_stream)() })?;
    Ok(result)
}

/// One captured CUDA graph: the kernels that the closure given to
/// [`CudaGraph::capture`] launched, with the memory they used kept in a
/// pool of the graph's own, so [`replay`](Self::replay) repeats them on the
/// same addresses.
pub struct CudaGraph {
    raw: *mut c_void,
    lib: &'static Library,
}

impl CudaGraph {
    /// Captures what `f` launches on the CUDA device (on a side stream:
    /// nothing runs; call [`replay`](Self::replay) to run it). `f` must not
    /// read a tensor's value on the host or synchronise: libtorch refuses
    /// that during a capture, and the capture fails.
    pub fn capture<R, E>(f: impl FnOnce() -> Result<R, E>) -> Result<(Self, R), CaptureError<E>> {
        let lib = library().map_err(CaptureError::Graph)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes a new graph's pointer.
        lib.check(unsafe { (lib.new)(&mut raw) })
            .map_err(CaptureError::Graph)?;
        let graph = Self { raw, lib };
        let captured = on_side_stream(|| -> Result<R, CaptureError<E>> {
            // SAFETY: a live graph, on the side stream.
            lib.check(unsafe { (lib.capture_begin)(graph.raw) })
                .map_err(CaptureError::Graph)?;
            let result = f();
            // SAFETY: ends the capture begun above, whatever `f` did.
            let ended = lib.check(unsafe { (lib.capture_end)(graph.raw) });
            let value = result.map_err(CaptureError::Step)?;
            ended.map_err(CaptureError::Graph)?;
            Ok(value)
        })
        .map_err(CaptureError::Graph)??;
        Ok((graph, captured))
    }

    /// Launches the captured kernels again on the current stream.
    pub fn replay(&self) -> Result<(), GraphError> {
        // SAFETY: a live, captured graph.
        self.lib.check(unsafe { (self.lib.replay)(self.raw) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: made by `new`, deleted once.
        unsafe { (self.lib.delete)(self.raw) }
    }
}

/// Why [`CudaGraph::capture`] failed: the graph machinery, or the captured
/// step itself.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError<E> {
    /// Making, capturing or instantiating the graph failed.
    #[error(transparent)]
    Graph(GraphError),
    /// The step being captured failed.
    #[error(transparent)]
    Step(E),
}
