//! [`Strategy`]: what a run's parallelism is, as one value. `hearth run`'s
//! config builds it once (`TrainConfig::strategy`), the accelerator takes
//! it whole (`AcceleratorBuilder::strategy`), and `data_parallel` runs it.
//! A new strategy is a field here beside its folder, and the code in
//! `data_parallel/` that registers models and runs backward under it.

use super::{DdpOptions, FsdpSettings};

/// A run's parallelism: how gradients are averaged across processes (DDP's
/// options, also under sharding for the parameters FSDP leaves whole) and,
/// when set, how models are sharded (FSDP). The default is DDP with its
/// defaults, which is also what a world of one runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Strategy {
    /// DDP's options (Accelerate's `DistributedDataParallelKwargs`).
    pub ddp: DdpOptions,
    /// FSDP's settings, resolved; `None` runs DDP.
    pub fsdp: Option<FsdpSettings>,
}

impl Strategy {
    /// True when models are sharded (FSDP, any sharding strategy).
    pub fn shards(&self) -> bool {
        self.fsdp.is_some()
    }

    /// What it is called in logs and summaries: `DDP`, or `FSDP
    /// (SHARD_GRAD_OP)`.
    pub fn name(&self) -> String {
        match &self.fsdp {
            None => "DDP".into(),
            Some(f) => format!("FSDP ({})", f.sharding_strategy),
        }
    }
}
