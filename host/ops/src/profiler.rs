//! Safe bindings to libtorch's Kineto profiler (`host/ops/csrc/profiler.cpp`):
//! the calls torch.profiler makes (prepare, enable, disable), the recorded
//! result, and `record_function` spans.

use super::{ffi, foreach::check};
use std::ffi::{c_void, CStr, CString};
use std::os::raw::{c_char, c_int};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use tch::TchError;

/// What Kineto records and how (torch.profiler's arguments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KinetoConfig {
    /// CPU operators.
    pub cpu: bool,
    /// CUDA kernels, copies and runtime calls.
    pub cuda: bool,
    /// Input shapes of each operator.
    pub record_shapes: bool,
    /// Tensor memory (de)allocations.
    pub profile_memory: bool,
    /// Source stacks (of TorchScript code; native callers have none).
    pub with_stack: bool,
    /// FLOPs estimated for matrix products and convolutions.
    pub with_flops: bool,
    /// Module hierarchy (of TorchScript modules).
    pub with_modules: bool,
}

impl KinetoConfig {
    fn call(
        &self,
        f: unsafe extern "C" fn(c_int, bool, bool, bool, bool, bool) -> *mut c_char,
    ) -> Result<(), TchError> {
        let activities = c_int::from(self.cpu) | (c_int::from(self.cuda) << 1);
        // SAFETY: plain values in, an error string (or null) out.
        check(unsafe {
            f(
                activities,
                self.record_shapes,
                self.profile_memory,
                self.with_stack,
                self.with_flops,
                self.with_modules,
            )
        })
    }
}

/// Profilers recording now (in any thread): spans are only made then.
static RECORDING: AtomicUsize = AtomicUsize::new(0);

/// Starts Kineto up without recording (torch.profiler's warm-up).
pub fn prepare(config: &KinetoConfig) -> Result<(), TchError> {
    config.call(ffi::hearth_profiler_prepare)
}

/// Starts recording on this thread.
pub fn enable(config: &KinetoConfig) -> Result<(), TchError> {
    config.call(ffi::hearth_profiler_enable)?;
    RECORDING.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Adds `key` with JSON text `value` to the top-level object of the trace
/// being recorded.
pub fn add_metadata(key: &str, value: &str) -> Result<(), TchError> {
    let nul = |what: &str| TchError::Convert(format!("profiler metadata {what} has a NUL byte"));
    let (key, value) = (
        CString::new(key).map_err(|_| nul("key"))?,
        CString::new(value).map_err(|_| nul("value"))?,
    );
    // SAFETY: two NUL-terminated strings, copied by the callee.
    check(unsafe { ffi::hearth_profiler_add_metadata(key.as_ptr(), value.as_ptr()) })
}

/// Stops the recording this thread started and returns what it recorded.
pub fn disable() -> Result<KinetoResult, TchError> {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` receives an owned ProfilerResult.
    let status = check(unsafe { ffi::hearth_profiler_disable(&mut out) });
    RECORDING.fetch_sub(1, Ordering::SeqCst);
    status?;
    Ok(KinetoResult(out))
}

/// What one recording holds (libtorch's `ProfilerResult`).
#[derive(Debug)]
pub struct KinetoResult(*mut c_void);

// SAFETY: the result is plain data, owned by this handle alone.
unsafe impl Send for KinetoResult {}

impl KinetoResult {
    /// Writes the Chrome trace JSON (what torch.profiler's
    /// `export_chrome_trace` writes).
    pub fn save(&self, path: &Path) -> Result<(), TchError> {
        let path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| TchError::FileFormat(format!("{} has a NUL byte", path.display())))?;
        // SAFETY: a live result and a NUL-terminated path.
        check(unsafe { ffi::hearth_profiler_save(self.0, path.as_ptr()) })
    }

    /// Every recorded event, in the order Kineto lists them.
    pub fn events(&self) -> Result<Vec<KinetoEvent>, TchError> {
        extern "C" fn on_event(
            ctx: *mut c_void,
            name: *const c_char,
            start_ns: u64,
            duration_ns: u64,
            thread: u64,
            activity: u8,
            device_type: c_int,
            flops: u64,
            bytes: i64,
        ) {
            // SAFETY: `ctx` is the Vec below; `name` lives for this call.
            let events = unsafe { &mut *(ctx as *mut Vec<KinetoEvent>) };
            let name = unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
            events.push(KinetoEvent {
                name,
                start_ns,
                duration_ns,
                thread,
                activity,
                on_cpu: device_type == 0,
                flops,
                bytes,
            });
        }
        let mut events: Vec<KinetoEvent> = Vec::new();
        let ctx = &mut events as *mut Vec<KinetoEvent> as *mut c_void;
        // SAFETY: a live result; the callback only runs during this call.
        check(unsafe { ffi::hearth_profiler_events(self.0, ctx, on_event) })?;
        Ok(events)
    }
}

impl Drop for KinetoResult {
    fn drop(&mut self) {
        // SAFETY: owned, freed once.
        unsafe { ffi::hearth_profiler_result_free(self.0) }
    }
}

/// One event Kineto recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct KinetoEvent {
    /// Operator, span or kernel name (`aten::addmm`, `ProfilerStep#3`).
    pub name: String,
    /// Start, in nanoseconds of the profiler's clock.
    pub start_ns: u64,
    /// Duration in nanoseconds.
    pub duration_ns: u64,
    /// The thread it started on.
    pub thread: u64,
    /// Kineto's activity type (0: CPU operator, 1: user annotation, ...).
    pub activity: u8,
    /// Ran on the host (else on a device).
    pub on_cpu: bool,
    /// FLOPs estimated (`with_flops`), else 0.
    pub flops: u64,
    /// Bytes (de)allocated, for memory events (`profile_memory`).
    pub bytes: i64,
}

/// A `record_function(name)` span on this thread, ended when dropped:
/// it shows in a trace under its name. Costs nothing when no profiler
/// records.
#[must_use = "the span ends when this guard is dropped"]
pub struct Span(*mut c_void);

/// Opens a span named `name` if a profiler is recording.
pub fn span(name: &str) -> Option<Span> {
    span_named(|| name.to_string())
}

/// [`span`] with a name made only when a profiler is recording.
pub fn span_named(name: impl FnOnce() -> String) -> Option<Span> {
    if RECORDING.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let name = name();
    let name = CString::new(name).ok()?;
    // SAFETY: a NUL-terminated name, copied by the callee.
    let handle = unsafe { ffi::hearth_span_enter(name.as_ptr()) };
    (!handle.is_null()).then_some(Span(handle))
}

impl Drop for Span {
    fn drop(&mut self) {
        // SAFETY: made by hearth_span_enter, ended once, on its thread
        // (`Span` is neither Send nor Sync).
        unsafe { ffi::hearth_span_exit(self.0) }
    }
}
