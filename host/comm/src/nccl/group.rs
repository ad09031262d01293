//! The NCCL group itself: creating the communicator and its stream, its
//! state, aborting it, the timeout and its roll call, and dropping it.

use crate::process_group::{DistError, ReduceOp};
use crate::roll_call::{self, RollCall};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;
use cudarc::nccl::result as nc;
use cudarc::nccl::sys as ncsys;
use std::cell::Cell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::Kind;

/// The oldest NCCL whose `ncclConfig_t` layout this build knows (2.28,
/// what torch 2.11 ships).
const MIN_NCCL_VERSION: i32 = 22800;

/// What a process knows of its place before the communicator exists.
#[derive(Debug, Clone, Copy)]
pub struct NcclPlace {
    /// Index of this process in the world.
    pub rank: usize,
    /// Number of processes in the world.
    pub world_size: usize,
    /// Index of this process on its machine.
    pub local_rank: usize,
    /// Number of processes on its machine.
    pub local_world_size: usize,
    /// The CUDA device this process's tensors live on.
    pub device: usize,
}

/// A world of processes joined by NCCL, one GPU each.
pub struct NcclGroup {
    pub(super) comm: ncsys::ncclComm_t,
    pub(super) stream: cusys::CUstream,
    pub(super) context: cusys::CUcontext,
    /// The device whose primary context `context` is (released on drop).
    cu_device: cusys::CUdevice,
    pub(super) place: NcclPlace,
    pub(super) timeout: Duration,
    /// Set once the communicator was aborted (a timeout or an error).
    pub(super) aborted: Cell<bool>,
    /// What delivered the world's unique id (the store, or MPI), kept
    /// alive as long as any communicator made from the world's (rank 0's
    /// store serves until then, and MPI must not be finalised before), and
    /// called a roll over after a timeout.
    rendezvous: Option<Rendezvous>,
    /// The world rank of each rank of this group (a split group's are a
    /// subset), and the number of processes in the world.
    world_ranks: Arc<Vec<usize>>,
    world_size: usize,
}

/// The world's rendezvous, shared by the groups made from the world's.
type Rendezvous = Arc<Mutex<Box<dyn RollCall>>>;

// SAFETY: the raw handles are owned by this group, which is used by one
// thread at a time (`ProcessGroup` is `Send`, not `Sync`); NCCL and the
// CUDA driver allow a communicator and a stream to move between threads
// as long as they are not used concurrently.
unsafe impl Send for NcclGroup {}

pub(super) fn unsupported(op: &'static str, message: String) -> DistError {
    DistError::Unsupported {
        op,
        backend: "nccl",
        message,
    }
}

pub(super) fn nccl_failed(op: &'static str, e: nc::NcclError) -> DistError {
    // SAFETY: ncclGetErrorString returns a static C string.
    let text = unsafe { std::ffi::CStr::from_ptr(ncsys::ncclGetErrorString(e.0)) };
    unsupported(
        op,
        format!("NCCL error {:?}: {}", e.0, text.to_string_lossy()),
    )
}

pub(super) fn driver_failed(op: &'static str, e: cu::DriverError) -> DistError {
    unsupported(op, format!("CUDA driver: {e}"))
}

/// Why NCCL cannot be used in this process, or `None` when it can: the
/// NVIDIA driver (`libcuda.so`) and `libnccl.so` must load.
pub fn nccl_unavailable() -> Option<String> {
    // SAFETY: the probes only try to open the libraries.
    if !unsafe { cusys::is_culib_present() } {
        return Some("the NVIDIA driver (libcuda.so) is not installed on this machine".into());
    }
    if !unsafe { ncsys::is_culib_present() } {
        return Some(
            "libnccl.so was not found (hearth links it to the nvidia-nccl wheel beside torch at build time; rebuild with `make build`, or put a libnccl.so on LD_LIBRARY_PATH)"
                .into(),
        );
    }
    None
}

/// The NCCL type of a libtorch kind.
pub(super) fn nccl_type(kind: Kind) -> Option<ncsys::ncclDataType_t> {
    use ncsys::ncclDataType_t::*;
    Some(match kind {
        Kind::Float => ncclFloat32,
        Kind::Half => ncclFloat16,
        Kind::BFloat16 => ncclBfloat16,
        Kind::Double => ncclFloat64,
        Kind::Int64 => ncclInt64,
        Kind::Int => ncclInt32,
        Kind::Uint8 => ncclUint8,
        Kind::Int8 => ncclInt8,
        _ => return None,
    })
}

/// The NCCL reduction of `op` on `kind`: a mean is NCCL's average, which
/// integer tensors do not have (as with MPI).
pub(super) fn nccl_op(op: ReduceOp, kind: Kind) -> Option<ncsys::ncclRedOp_t> {
    use ncsys::ncclRedOp_t::*;
    Some(match op {
        ReduceOp::Sum => ncclSum,
        ReduceOp::Max => ncclMax,
        ReduceOp::Min => ncclMin,
        ReduceOp::Mean
            if matches!(
                kind,
                Kind::Float | Kind::Half | Kind::BFloat16 | Kind::Double
            ) =>
        {
            ncclAvg
        }
        ReduceOp::Mean => return None,
    })
}

pub(super) fn aborted(op: &'static str) -> DistError {
    unsupported(
        op,
        "the communicator was aborted after an earlier failure; the process group cannot be used any more".into(),
    )
}

impl NcclGroup {
    /// Creates this process's communicator on `place.device`. Rank 0 makes
    /// the unique id and `share_id(Some(id))` sends it; the other ranks get
    /// it from `share_id(None)`. Creating the communicator and every
    /// collective give up after `timeout`.
    pub fn init(
        place: NcclPlace,
        timeout: Duration,
        share_id: impl FnOnce(Option<Vec<u8>>) -> Result<Vec<u8>, DistError>,
    ) -> Result<Self, DistError> {
        if let Some(why) = nccl_unavailable() {
            return Err(unsupported("init", why));
        }
        let deadline = Instant::now() + timeout;
        // SAFETY: plain driver calls; the context and stream are owned by
        // the group built below, whose drop releases them.
        let (cu_device, context, stream) = unsafe {
            cu::init().map_err(|e| driver_failed("init", e))?;
            let device =
                cu::device::get(place.device as i32).map_err(|e| driver_failed("init", e))?;
            let context = cu::primary_ctx::retain(device).map_err(|e| driver_failed("init", e))?;
            let stream = cu::ctx::set_current(context)
                .and_then(|()| cu::stream::create(cu::stream::StreamKind::NonBlocking));
            match stream {
                Ok(stream) => (device, context, stream),
                Err(e) => {
                    let _ = cu::primary_ctx::release(device);
                    return Err(driver_failed("init", e));
                }
            }
        };
        // Marked aborted until the communicator exists: dropped early, the
        // group only releases the stream and the context.
        let mut group = Self {
            comm: std::ptr::null_mut(),
            stream,
            context,
            cu_device,
            place,
            timeout,
            aborted: Cell::new(true),
            rendezvous: None,
            world_ranks: Arc::new((0..place.world_size).collect()),
            world_size: place.world_size,
        };
        let version = nc::get_nccl_version().map_err(|e| nccl_failed("init", e))?;
        if version < MIN_NCCL_VERSION {
            return Err(unsupported(
                "init",
                format!("NCCL {version} is older than 2.28, the oldest this build of hearth knows; install torch 2.11's nvidia-nccl wheel"),
            ));
        }
        let id = if place.rank == 0 {
            let id = nc::get_uniqueid().map_err(|e| nccl_failed("init", e))?;
            share_id(Some(id.internal.iter().map(|&b| b as u8).collect()))?
        } else {
            share_id(None)?
        };
        let internal: [std::ffi::c_char; 128] = id
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| DistError::Mismatch {
                op: "init",
                rank: place.rank,
                message: format!(
                    "the NCCL unique id from rank 0 has {} bytes, not 128",
                    id.len()
                ),
            })?;
        let mut config = default_config();
        config.blocking = 0;
        // SAFETY: `comm` and `config` outlive the call; a non-blocking
        // init completes in the background and is polled below. NCCL may
        // set `comm` before failing: it is aborted then.
        let started = unsafe {
            nc::comm_init_rank_config(
                &mut group.comm,
                place.world_size as i32,
                ncsys::ncclUniqueId { internal },
                place.rank as i32,
                &mut config,
            )
        };
        if let Err(e) = started {
            if !group.comm.is_null() {
                // SAFETY: a communicator NCCL handed back, aborted once.
                unsafe { ncsys::ncclCommAbort(group.comm) };
            }
            return Err(nccl_failed("init", e));
        }
        group.aborted.set(false);
        group.settle("init", deadline)?;
        Ok(group)
    }

    /// Keeps `rendezvous` (the store or MPI group that carried the unique
    /// id) alive as long as the group: rank 0's store serves until then,
    /// and MPI is finalised only after the communicator is destroyed. A
    /// timed-out collective calls its roll over it.
    pub(crate) fn keeping(mut self, rendezvous: impl RollCall + 'static) -> Self {
        self.rendezvous = Some(Arc::new(Mutex::new(Box::new(rendezvous))));
        self
    }

    /// This group (made from `parent`'s: a duplicate, or a split whose
    /// ranks are `parent_ranks` of the parent's) with the parent's
    /// rendezvous, so that its timeouts call the roll too, among its own
    /// members.
    pub(super) fn made_from(mut self, parent: &NcclGroup, parent_ranks: &[usize]) -> Self {
        self.rendezvous = parent.rendezvous.clone();
        self.world_ranks = Arc::new(
            parent_ranks
                .iter()
                .map(|&r| parent.world_ranks[r])
                .collect(),
        );
        self.world_size = parent.world_size;
        self
    }

    /// The communicator's state: `Ok(true)` while an operation is still
    /// being enqueued or created, `Ok(false)` when idle; an NCCL error
    /// aborts it. An aborted communicator (freed by NCCL) is never touched.
    pub(super) fn in_progress(&self, op: &'static str) -> Result<bool, DistError> {
        if self.aborted.get() {
            return Err(aborted(op));
        }
        let mut state = ncsys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator.
        let rc = unsafe { ncsys::ncclCommGetAsyncError(self.comm, &mut state) };
        if rc != ncsys::ncclResult_t::ncclSuccess {
            state = rc;
        }
        match state.result() {
            Ok(nc::NcclStatus::InProgress) => Ok(true),
            Ok(_) => Ok(false),
            Err(e) => {
                self.abort();
                Err(nccl_failed(op, e))
            }
        }
    }

    /// Waits until the communicator has no operation in progress (a
    /// non-blocking init, launch or finalize), aborting it on an error or
    /// at `deadline`.
    pub(super) fn settle(&self, op: &'static str, deadline: Instant) -> Result<(), DistError> {
        match self.idle_by(op, deadline)? {
            true => Ok(()),
            false => Err(self.timed_out(op)),
        }
    }

    /// Whether the communicator has no operation in progress by
    /// `deadline` (polled; an NCCL error aborts it and is returned).
    fn idle_by(&self, op: &'static str, deadline: Instant) -> Result<bool, DistError> {
        let mut pause = Duration::from_micros(20);
        while self.in_progress(op)? {
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(true)
    }

    pub(super) fn abort(&self) {
        crate::process_group::mark_collectives_broken();
        if !self.aborted.replace(true) {
            // SAFETY: a live communicator, aborted once.
            unsafe { ncsys::ncclCommAbort(self.comm) };
        }
    }

    /// The error of a collective that timed out, after aborting the
    /// communicator and calling a roll over the rendezvous (once per
    /// process; later timeouts give the first one's answer).
    pub(super) fn timed_out(&self, op: &'static str) -> DistError {
        self.abort();
        let me = self.world_ranks[self.place.rank];
        let peers: Vec<usize> = self
            .world_ranks
            .iter()
            .copied()
            .filter(|&r| r != me)
            .collect();
        let window = roll_call::window(self.timeout);
        let silent = self.rendezvous.as_ref().map(|r| {
            roll_call::silent_once(|| {
                let rendezvous = r.lock().unwrap_or_else(|p| p.into_inner());
                rendezvous.silent_ranks(window, &peers)
            })
        });
        DistError::Timeout {
            op,
            timeout: self.timeout,
            rank: me,
            world: self.world_size,
            silent,
        }
    }
}

/// NCCL's `NCCL_CONFIG_INITIALIZER` for the 2.28 layout: every setting
/// left to NCCL.
fn default_config() -> ncsys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    ncsys::ncclConfig_t {
        size: std::mem::size_of::<ncsys::ncclConfig_t>(),
        magic: 0xcafebeef,
        version: 22809,
        blocking: UNDEF,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

impl Drop for NcclGroup {
    /// Finalizes the communicator (which waits for its peers) under a
    /// deadline, then frees it; on an error or past the deadline it is
    /// aborted instead, so a process never hangs on its way out.
    fn drop(&mut self) {
        // SAFETY: owned handles, released once; an aborted communicator
        // was freed by NCCL and is not touched.
        unsafe {
            let _ = cu::ctx::set_current(self.context);
            if !self.aborted.get() {
                let deadline = Instant::now() + self.timeout.min(Duration::from_secs(60));
                // A finalize that does not end in time is aborted without a
                // roll call: the process is on its way out.
                let finalized = nc::comm_finalize(self.comm).is_ok()
                    && matches!(self.idle_by("destroy", deadline), Ok(true));
                if finalized {
                    let _ = ncsys::ncclCommDestroy(self.comm);
                } else {
                    self.abort();
                }
            }
            let _ = cu::stream::destroy(self.stream);
            let _ = cu::primary_ctx::release(self.cu_device);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// build.rs links the torch wheel's `libnccl.so.2` where cudarc looks;
    /// without it, NCCL could never load (no GPU is needed to see that).
    #[test]
    fn libnccl_loads_through_the_link_on_the_rpath() {
        // SAFETY: only opens the library.
        assert!(unsafe { ncsys::is_culib_present() });
        let version = nc::get_nccl_version().unwrap();
        assert!(version >= MIN_NCCL_VERSION, "NCCL {version}");
    }

    #[test]
    fn kinds_and_reductions_map_as_nccl_needs() {
        assert_eq!(
            nccl_type(Kind::BFloat16),
            Some(ncsys::ncclDataType_t::ncclBfloat16)
        );
        assert_eq!(nccl_type(Kind::Bool), None, "a sum of bools is no bool");
        assert_eq!(
            nccl_op(ReduceOp::Mean, Kind::Half),
            Some(ncsys::ncclRedOp_t::ncclAvg)
        );
        assert_eq!(nccl_op(ReduceOp::Mean, Kind::Int64), None);
        assert_eq!(std::mem::size_of::<ncsys::ncclConfig_t>(), 80);
    }
}
