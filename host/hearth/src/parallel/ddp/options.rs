//! The data-parallel settings that apply to hearth (Accelerate's
//! `DistributedDataParallelKwargs`), and the buffers kept equal to rank 0's.

use super::bucket::DEFAULT_BUCKET_CAP_MB;
use super::comm_hook::{CommHook, CommWrapper};
use super::power_sgd::PowerSgdOptions;
use hearth_comm::{DistError, ProcessGroup};
use tch::Tensor;

/// The data-parallel settings that apply to hearth (Accelerate's
/// `DistributedDataParallelKwargs`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    /// Gradients are averaged in buckets of about this many MiB (25, as
    /// PyTorch's default; left at 25, the first bucket holds at most
    /// [`FIRST_BUCKET_MB`](crate::parallel::FIRST_BUCKET_MB) as DDP's does).
    pub bucket_cap_mb: f64,
    /// Compression of the gradients on the wire.
    pub comm_hook: CommHook,
    /// A 16-bit cast around `comm_hook` (refused with [`CommHook::No`],
    /// where Accelerate registers no hook to wrap).
    pub comm_wrapper: CommWrapper,
    /// PowerSGD's settings (with [`CommHook::PowerSgd`] only).
    pub comm_state_option: PowerSgdOptions,
    /// Rank 0's buffers (BatchNorm's running statistics, say) are sent to
    /// every process before each training forward pass (PyTorch's
    /// default); off, each process keeps its own.
    pub broadcast_buffers: bool,
    /// Parameters may go without a gradient in a backward pass that
    /// syncs (PyTorch's `find_unused_parameters`): such a gradient counts
    /// as zero in the mean. Off (the default), a parameter that some
    /// process got no gradient for is an error naming it, as DDP's is.
    pub find_unused_parameters: bool,
    /// The model uses the same parameters in every step (PyTorch's
    /// `static_graph`): unused parameters are allowed, as with
    /// `find_unused_parameters`, since the set found in the first step
    /// holds for all (the buckets are rebuilt once, after the first step,
    /// either way).
    pub static_graph: bool,
    /// Gradients are views into the buckets that are all-reduced
    /// (PyTorch's `gradient_as_bucket_view`): once a gradient lives there
    /// (zeroed in place, or accumulated over `no_sync` micro-batches) it is
    /// not copied into a bucket before the all-reduce (without a comm hook),
    /// and the means are written into the buckets, so into the gradients.
    /// Numerically the same. Frozen parameters take room in the buckets too.
    pub gradient_as_bucket_view: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            bucket_cap_mb: DEFAULT_BUCKET_CAP_MB,
            comm_hook: CommHook::No,
            comm_wrapper: CommWrapper::No,
            comm_state_option: PowerSgdOptions::default(),
            broadcast_buffers: true,
            find_unused_parameters: false,
            static_graph: false,
            gradient_as_bucket_view: false,
        }
    }
}

impl DdpOptions {
    /// Whether a parameter may go without a gradient in a synchronising
    /// backward pass.
    pub fn allows_unused_parameters(&self) -> bool {
        self.find_unused_parameters || self.static_graph
    }

    /// Refuses combinations that would do nothing or what hearth cannot
    /// match; the message names the field and says what to set.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.bucket_cap_mb.is_finite() && self.bucket_cap_mb > 0.0) {
            return Err(format!(
                "bucket_cap_mb must be a positive number of MiB, not {}",
                self.bucket_cap_mb
            ));
        }
        match self.comm_hook {
            CommHook::BatchedPowerSgd => {
                return Err(
                    "comm_hook = batched_power_sgd: PyTorch's batched_powerSGD_hook \
                            fails its own check (it orthogonalises a 2-d matrix where \
                            _orthogonalize asserts 3-d), so there is nothing to match; use \
                            comm_hook = power_sgd, with batch_tensors_with_same_shape = true \
                            in comm_state_option to batch matrices of one shape"
                        .into(),
                )
            }
            CommHook::PowerSgd => self.comm_state_option.validate()?,
            CommHook::No if self.comm_wrapper != CommWrapper::No => {
                return Err(format!(
                    "comm_wrapper = {} wraps a comm hook, and comm_hook is no (Accelerate \
                     registers nothing then): set comm_hook = power_sgd, fp16 or bf16, or \
                     leave comm_wrapper out",
                    format!("{:?}", self.comm_wrapper).to_lowercase()
                ))
            }
            _ => {}
        }
        if self.comm_hook != CommHook::PowerSgd
            && self.comm_state_option != PowerSgdOptions::default()
        {
            return Err(
                "comm_state_option sets PowerSGD's state, and comm_hook is not power_sgd: \
                 set comm_hook = power_sgd, or leave comm_state_option out"
                    .into(),
            );
        }
        Ok(())
    }
}

/// A model's buffers kept equal to rank 0's: sent from it once when the
/// model is prepared and, under DDP's `broadcast_buffers`, before every
/// training forward pass.
pub struct BufferBroadcast {
    group: Box<dyn ProcessGroup>,
    buffers: Vec<Tensor>,
    /// Set while processes may have run out of inputs (inside
    /// `join_uneven_inputs`): a joined rank 0 sends nothing, so each
    /// process keeps its own until the join ends.
    paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl BufferBroadcast {
    /// `buffers` sent from rank 0 over a channel of their own in `group`,
    /// once now; none is sent while `paused` is set.
    pub fn new(
        group: &dyn ProcessGroup,
        buffers: Vec<Tensor>,
        paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Self, DistError> {
        let this = Self {
            group: group.duplicate()?,
            buffers,
            paused,
        };
        this.send()?;
        Ok(this)
    }

    /// Sends rank 0's buffers to every process (nothing while paused).
    pub fn run(&self) -> Result<(), DistError> {
        if self.paused.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        self.send()
    }

    fn send(&self) -> Result<(), DistError> {
        tch::no_grad(|| {
            self.buffers
                .iter()
                .try_for_each(|b| self.group.broadcast(&mut b.shallow_clone(), 0))
        })
    }
}
