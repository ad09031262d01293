//! The gradient round both strategies share (a long file: the round, the
//! hooks that drive it and their tests read together): every process starts from
//! rank 0's parameters, and after a backward pass that ends an accumulation
//! group the gradients are reduced across processes bucket by bucket — DDP
//! all-reduces buckets of about `bucket_cap_mb` to their mean on every
//! process ([`super::ddp`]); sharding reduce-scatters one unit per bucket,
//! each process keeping the mean of the rows it owns ([`super::sharded`]).
//!
//! The buckets first follow the parameters in reverse order (DDP's guess at
//! the order backward produces gradients); after the first sync they are
//! rebuilt in the order rank 0's gradients came in. During a backward
//! pass that syncs (a `Round`), a hook on every parameter reports when
//! autograd has accumulated its gradient; a bucket whose gradients are all
//! in starts its all-reduce at once, while backward goes on computing the
//! others. Buckets start strictly in order, on every process the same (the
//! collectives must match): one that is ready waits for those before it.
//! What is not ready when backward returns (a parameter without a gradient
//! on this process, say) starts then; the round then waits for all of them.

use super::ddp::bucket;
use super::ddp::comm_hook::{self, Collective, CommHook};
use super::ddp::power_sgd::PowerSgd;
use super::ddp::DdpOptions;
use super::sharded::UnitShard;
use hearth_comm::{DistError, ProcessGroup};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use tch::{Kind, Tensor};

/// What gradient averaging has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SyncStats {
    /// Times the gradients were averaged (one per optimizer step).
    pub syncs: u64,
    /// All-reduces started (buckets × syncs; DDP).
    pub all_reduces: u64,
    /// Reduce-scatters started (units × syncs; sharding).
    pub reduce_scatters: u64,
    /// Of those, the ones started inside backward while gradients were
    /// still to come: communication overlapping computation.
    pub overlapped: u64,
    /// Bytes this process sent into those collectives.
    pub bytes: u64,
    /// Units all-gathered whole before a use (FULL_SHARD).
    pub gathers: u64,
    /// Bytes this process sent into those all-gathers.
    pub gather_bytes: u64,
    /// Of those, the ones started ahead of use (FULL_SHARD's prefetch).
    pub prefetched: u64,
    /// Units recomputed in backward (activation checkpointing, FULL_SHARD).
    pub recomputed: u64,
    /// The most units of one model held whole at once since the optimizer
    /// was prepared (FULL_SHARD): saves and `get_state_dict` gather one at
    /// a time, so training's own peak bounds it.
    pub most_gathered: u64,
    /// The bytes of those units' whole parameters at that moment (what
    /// `hearth model plan` calls `whole_bytes`).
    pub most_gathered_bytes: u64,
}

/// A fresh id for a model's hooks.
fn next_id() -> u64 {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// What a bucket's collective does.
pub(crate) enum Reduction {
    /// DDP: every process gets the mean of every gradient.
    AllReduce(DdpOptions),
    /// Sharding: one bucket per unit (`units[b]` is bucket `b`), each
    /// process keeps the mean of its rows as its shard's gradient and the
    /// whole gradients are dropped.
    ReduceScatter(Vec<UnitShard>),
}

/// The gradient averaging of one prepared model.
pub struct GradientSync {
    /// Names this model's parameters to the hooks.
    id: u64,
    /// The parameters, by the index their hook reports (reverse of the
    /// order they were given in).
    params: Vec<Tensor>,
    /// Their names, by the same index (empty for sharded units).
    names: Vec<String>,
    /// Parameters that required no gradient when the model was prepared,
    /// by name: sent from rank 0 like the others, never averaged (left out
    /// of the buckets, as PyTorch's DDP leaves them out).
    frozen: Vec<(String, Tensor)>,
    /// Parameters that some process had no gradient for in the last
    /// round, where the options do not allow that.
    unused: Vec<String>,
    /// The parameters of each bucket, in the order the buckets start.
    buckets: Vec<Vec<usize>>,
    /// The bucket of each parameter.
    bucket_of: Vec<usize>,
    /// The buckets were rebuilt in the order gradients came in.
    rebuilt: bool,
    reduction: Reduction,
    /// The PowerSGD state, when DDP's comm hook is PowerSGD.
    power_sgd: Option<PowerSgd>,
    /// Under `gradient_as_bucket_view`: each bucket's buffer (its
    /// gradients, then a flag per parameter), which the gradients are
    /// views of.
    bucket_views: Vec<Tensor>,
    stats: SyncStats,
}

impl GradientSync {
    /// Makes every process start from rank 0's `parameters` (broadcast in
    /// buckets), hooks them so that a backward pass that syncs learns when their gradients
    /// are in, and returns the averaging for them. Parameters that require
    /// no gradient now are broadcast too, but left out of the buckets: a
    /// frozen backbone costs nothing per step (unfreezing one later is an
    /// error at the next sync: prepare the model after unfreezing).
    pub fn new(
        group: &dyn ProcessGroup,
        parameters: Vec<(String, Tensor)>,
        options: DdpOptions,
    ) -> Result<Self, DistError> {
        let id = next_id();
        let (mut parameters, frozen): (Vec<_>, Vec<_>) =
            parameters.into_iter().partition(|(_, p)| p.requires_grad());
        // Backward produces the last parameters' gradients first: the
        // first guess at the order, until a backward pass shows the real one.
        parameters.reverse();
        let order: Vec<usize> = (0..parameters.len()).collect();
        let (names, parameters) = parameters.into_iter().unzip();
        let mut sync = Self {
            id,
            buckets: Vec::new(),
            bucket_of: Vec::new(),
            params: parameters,
            names,
            frozen,
            unused: Vec::new(),
            rebuilt: false,
            reduction: Reduction::AllReduce(options),
            power_sgd: (options.comm_hook == CommHook::PowerSgd)
                .then(|| PowerSgd::new(options.comm_state_option)),
            bucket_views: Vec::new(),
            stats: SyncStats::default(),
        };
        sync.set_buckets(&order);
        sync.start_from_rank_0(group)?;
        sync.hook(id);
        Ok(sync)
    }

    /// The sharded reduction of `units` (laid out for this process): one
    /// bucket per unit, the last unit first (backward reaches it first);
    /// with `sync_module_states` every process starts from rank 0's
    /// parameters.
    pub fn sharded(
        group: &dyn ProcessGroup,
        units: Vec<UnitShard>,
        sync_module_states: bool,
    ) -> Result<Self, DistError> {
        let id = next_id();
        let mut units = units;
        units.reverse();
        let mut params = Vec::new();
        let mut buckets = Vec::new();
        for unit in &units {
            let start = params.len();
            params.extend(unit.params.iter().map(|p| p.full.shallow_clone()));
            buckets.push((start..params.len()).collect());
        }
        let mut sync = Self {
            id,
            bucket_of: Vec::new(),
            buckets,
            params,
            names: Vec::new(),
            frozen: Vec::new(),
            unused: Vec::new(),
            rebuilt: false,
            reduction: Reduction::ReduceScatter(units),
            power_sgd: None,
            bucket_views: Vec::new(),
            stats: SyncStats::default(),
        };
        sync.index_buckets();
        if sync_module_states {
            sync.start_from_rank_0(group)?;
            // Offloaded shards are copies: they take rank 0's values too.
            for unit in sync.units().iter().filter(|u| u.offloaded()) {
                unit.write_back(group.process_index());
            }
        }
        sync.hook(id);
        Ok(sync)
    }

    /// The parameters that some process had no gradient for in the last
    /// synchronising backward pass, when `find_unused_parameters` and
    /// `static_graph` are off; emptied by the call.
    pub(crate) fn take_unused(&mut self) -> Vec<String> {
        std::mem::take(&mut self.unused)
    }

    /// The units of a sharded reduction, in bucket order.
    pub fn units(&self) -> &[UnitShard] {
        match &self.reduction {
            Reduction::ReduceScatter(units) => units,
            Reduction::AllReduce(_) => &[],
        }
    }

    /// Overwrites every parameter with rank 0's, bucket by bucket.
    fn start_from_rank_0(&self, group: &dyn ProcessGroup) -> Result<(), DistError> {
        self.take_parameters_from(group, 0)
    }

    /// Overwrites every parameter with process `root`'s, bucket by bucket
    /// (every process calls it with the same root).
    pub(crate) fn take_parameters_from(
        &self,
        group: &dyn ProcessGroup,
        root: usize,
    ) -> Result<(), DistError> {
        if group.num_processes() == 1 {
            return Ok(());
        }
        for b in 0..self.buckets.len() {
            let bucket = self.bucket(b);
            let mut flat = tch::no_grad(|| bucket::flatten(bucket.iter().map(|p| p.detach())));
            group.broadcast(&mut flat, root)?;
            tch::no_grad(|| {
                for (p, value) in bucket.iter().zip(bucket::unflatten(&flat, &bucket)) {
                    p.detach().copy_(&value);
                }
            });
        }
        tch::no_grad(|| {
            (self.frozen.iter()).try_for_each(|(_, p)| group.broadcast(&mut p.detach(), root))
        })
    }

    /// The parameters left out of the averaging: they required no gradient
    /// when the model was prepared.
    pub fn frozen(&self) -> impl Iterator<Item = &Tensor> {
        self.frozen.iter().map(|(_, p)| p)
    }

    /// Refuses a parameter that was frozen when the model was prepared and
    /// now has a gradient: it would not be averaged.
    fn check_still_frozen(&self, group: &dyn ProcessGroup) -> Result<(), DistError> {
        match self.frozen.iter().find(|(_, p)| p.grad().defined()) {
            None => Ok(()),
            Some((name, _)) => Err(DistError::Mismatch {
                op: "gradient sync",
                rank: group.process_index(),
                message: format!(
                    "parameter `{name}` required no gradient when the model was prepared, so \
                     DDP does not average it, and it has one now: prepare the model after \
                     unfreezing it (as with PyTorch's DDP)"
                ),
            }),
        }
    }

    /// Puts the gradient hook on every parameter.
    fn hook(&self, id: u64) {
        for (index, p) in self.params.iter().enumerate() {
            // Without its hook a parameter is never reported ready: its
            // bucket then starts after backward, which is still correct.
            if let Err(e) =
                hearth_ops::on_grad_accumulated(p, gradient_accumulated, id, index as u64)
            {
                tracing::warn!("gradient hook not set, its bucket waits for backward: {e}");
            }
        }
    }

    /// The parameters averaged.
    pub fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    /// What averaging has done so far.
    pub fn stats(&self) -> SyncStats {
        self.stats
    }

    /// Replaces every gradient with its mean over the processes, all
    /// buckets started now (as after a backward pass without hooks).
    pub fn sync(&mut self, group: &dyn ProcessGroup) -> Result<(), DistError> {
        Round::new(std::slice::from_mut(self), group).finish()
    }

    /// The parameters of bucket `b`.
    fn bucket(&self, b: usize) -> Vec<Tensor> {
        self.buckets[b]
            .iter()
            .map(|&i| self.params[i].shallow_clone())
            .collect()
    }

    /// Cuts the parameters, taken in `order`, into buckets.
    fn set_buckets(&mut self, order: &[usize]) {
        let Reduction::AllReduce(options) = &self.reduction else {
            unreachable!("only DDP cuts buckets by size")
        };
        self.buckets = bucket::buckets(order, &self.params, options.bucket_cap_mb);
        self.bucket_views = if options.gradient_as_bucket_view {
            (self.buckets.iter())
                .map(|b| {
                    let p = &self.params[b[0]];
                    let numel: usize = b.iter().map(|&i| self.params[i].numel()).sum();
                    Tensor::zeros([(numel + b.len()) as i64], (p.kind(), p.device()))
                })
                .collect()
        } else {
            Vec::new()
        };
        self.index_buckets();
    }

    /// Notes the bucket of each parameter.
    fn index_buckets(&mut self) {
        self.bucket_of = vec![0; self.params.len()];
        for (b, bucket) in self.buckets.iter().enumerate() {
            for &i in bucket {
                self.bucket_of[i] = b;
            }
        }
    }

    /// After the first round, rebuilds the buckets in the order the
    /// gradients came in on rank 0 (PyTorch DDP's `rebuild_buckets`), so
    /// that the first bucket is the first to be ready. Every process takes
    /// rank 0's order: the buckets must match.
    fn rebuild(&mut self, group: &dyn ProcessGroup, arrived: &[usize]) -> Result<(), DistError> {
        self.rebuilt = true;
        let mut order = arrived.to_vec();
        let mut listed = vec![false; self.params.len()];
        for &i in &order {
            listed[i] = true;
        }
        // Parameters without a gradient on rank 0 keep their place, last.
        order.extend((0..self.params.len()).filter(|&i| !listed[i]));
        let bytes: Vec<u8> = order
            .iter()
            .flat_map(|&i| (i as u32).to_le_bytes())
            .collect();
        let bytes = group.broadcast_bytes(bytes, 0)?;
        let order: Vec<usize> = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
            .collect();
        let mut seen = vec![false; self.params.len()];
        let valid = order.len() == self.params.len()
            && order
                .iter()
                .all(|&i| i < seen.len() && !std::mem::replace(&mut seen[i], true));
        if !valid {
            return Err(DistError::Mismatch {
                op: "gradient sync",
                rank: group.process_index(),
                message: format!(
                    "rank 0 ordered {} parameters for the buckets, this process prepared {}: \
                     prepare the same model on every process",
                    order.len(),
                    self.params.len()
                ),
            });
        }
        match &mut self.reduction {
            Reduction::AllReduce(_) => self.set_buckets(&order),
            Reduction::ReduceScatter(units) => {
                // Units keep their parameters; they start in the order
                // their last gradient came in.
                let mut position = vec![0; self.params.len()];
                for (at, &i) in order.iter().enumerate() {
                    position[i] = at;
                }
                let last = |b: &Vec<usize>| b.iter().map(|&i| position[i]).max().unwrap_or(0);
                let mut pairs: Vec<(Vec<usize>, UnitShard)> = std::mem::take(&mut self.buckets)
                    .into_iter()
                    .zip(units.drain(..))
                    .collect();
                pairs.sort_by_key(|(b, _)| last(b));
                for (bucket, unit) in pairs {
                    self.buckets.push(bucket);
                    units.push(unit);
                }
                self.index_buckets();
            }
        }
        Ok(())
    }
}

/// The averaging of the gradients of one backward pass, over the buckets of
/// every model in it (in order: the first model's, then the next's).
///
/// [`during`](Self::during) runs the backward pass with the buckets
/// started as their gradients come in; [`finish`](Self::finish) starts the
/// rest and waits for all. Every gradient is then the mean over the
/// processes. A parameter without a gradient counts as zero; it gets the
/// mean when some process had a gradient for it, and keeps none otherwise
/// (so every process ends with the same gradients). Dropped unfinished
/// (backward failed), its started collectives are abandoned.
pub(crate) struct Round<'s, 'g> {
    group: &'g dyn ProcessGroup,
    models: &'s mut [GradientSync],
    /// Per model, per bucket: parameters whose gradient is not in yet.
    waiting: Vec<Vec<usize>>,
    /// Per model, per parameter: its gradient is in (or none will come:
    /// it does not require one).
    seen: Vec<Vec<bool>>,
    /// Per model: the parameters whose hooks reported, in that order.
    arrived: Vec<Vec<usize>>,
    /// The next bucket to start, as (model, bucket).
    next: (usize, usize),
    started: Vec<Started<'g>>,
    /// The first failure during backward.
    error: Option<DistError>,
    /// A joined process matching the others' round (see [`Round::shadow`]).
    shadow: bool,
}

/// A bucket whose all-reduce is under way.
struct Started<'g> {
    model: usize,
    bucket: usize,
    collective: Collective<'g>,
    kind: Kind,
    /// Gradients reported when it started, if that was inside backward.
    after_gradients: Option<usize>,
}

impl<'s, 'g> Round<'s, 'g> {
    /// A round over the buckets of `models`, none started yet.
    pub(crate) fn new(models: &'s mut [GradientSync], group: &'g dyn ProcessGroup) -> Self {
        let mut waiting: Vec<Vec<usize>> = models
            .iter()
            .map(|m| m.buckets.iter().map(Vec::len).collect())
            .collect();
        // A parameter that requires no gradient gets none (no hook fires):
        // it must not hold its bucket back. Being ready earlier on one
        // process than another changes when, not in what order, buckets start.
        let seen = models
            .iter()
            .zip(&mut waiting)
            .map(|(m, waiting)| {
                m.params
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let frozen = !p.requires_grad();
                        if frozen {
                            waiting[m.bucket_of[i]] -= 1;
                        }
                        frozen
                    })
                    .collect()
            })
            .collect();
        Self {
            group,
            arrived: vec![Vec::new(); models.len()],
            models,
            waiting,
            seen,
            next: (0, 0),
            started: Vec::new(),
            error: None,
            shadow: false,
        }
    }

    /// A process that has run out of inputs (inside `join_uneven_inputs`)
    /// takes part in a round the others started: the same collectives,
    /// bucket by bucket, with zero gradients that count as present
    /// (PyTorch's `_match_all_reduce_for_bwd_pass`: the others' means are
    /// divided by every process, the joined ones included). Its own
    /// gradients are left as they are.
    pub(crate) fn shadow(
        models: &'s mut [GradientSync],
        group: &'g dyn ProcessGroup,
    ) -> Result<(), DistError> {
        let mut round = Self::new(models, group);
        round.shadow = true;
        round.finish()
    }

    /// Runs `backward` while the gradient hooks of this round's models are
    /// live: each bucket starts once all its gradients are in and every
    /// bucket before it has started.
    pub(crate) fn during<R>(&mut self, backward: impl FnOnce() -> R) -> R {
        let this: *mut (dyn Ready + '_) = self;
        // SAFETY: only the lifetime is erased. The pointer is in `LIVE` only
        // until `_disarm` drops, before `during` returns; `self` stays
        // mutably borrowed (unused here) all that time.
        let this: *mut (dyn Ready + 'static) = unsafe { std::mem::transmute(this) };
        let ids: Vec<u64> = self.models.iter().map(|m| m.id).collect();
        live().extend(ids.iter().map(|&id| (id, LiveRound(this))));
        struct Disarm(Vec<u64>);
        impl Drop for Disarm {
            fn drop(&mut self) {
                live().retain(|(id, _)| !self.0.contains(id));
            }
        }
        let _disarm = Disarm(ids);
        backward()
    }

    /// Starts the buckets not started yet, waits for every all-reduce and
    /// writes the means into the gradients; after a model's first round,
    /// rebuilds its buckets in the order its gradients came in.
    pub(crate) fn finish(mut self) -> Result<(), DistError> {
        let _span = crate::profiling::span("hearth::gradient_sync");
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        while self.next.0 < self.models.len() {
            self.start_next(None)?;
        }
        let group = self.group;
        let reported: usize = self.arrived.iter().map(Vec::len).sum();
        for started in std::mem::take(&mut self.started) {
            let model = &mut self.models[started.model];
            if started.after_gradients.is_some_and(|n| n < reported) {
                model.stats.overlapped += 1;
            }
            let reduced = started.collective.wait(model.power_sgd.as_mut(), group)?;
            if self.shadow {
                continue;
            }
            match &model.reduction {
                Reduction::AllReduce(options) => {
                    // Through the wrapper's kind, as PyTorch copies the
                    // hook's result into the wrapped bucket first.
                    let reduced = match options.comm_wrapper.kind() {
                        Some(wrapped) => reduced.to_kind(wrapped),
                        None => reduced,
                    }
                    .to_kind(started.kind);
                    let missing = bucket::write_means(
                        group,
                        &model.bucket(started.bucket),
                        &reduced,
                        model.bucket_views.get(started.bucket),
                    )?;
                    if !options.allows_unused_parameters() {
                        let bucket = &model.buckets[started.bucket];
                        let names = missing.iter().map(|&i| model.names[bucket[i]].clone());
                        model.unused.extend(names);
                    }
                }
                Reduction::ReduceScatter(units) => super::sharded::write_gradient_shard(
                    group,
                    &units[started.bucket],
                    &reduced.to_kind(started.kind),
                )?,
            }
        }
        for (model, arrived) in self.models.iter_mut().zip(&self.arrived) {
            model.check_still_frozen(group)?;
            model.stats.syncs += u64::from(!self.shadow);
            if let Some(state) = &mut model.power_sgd {
                state.end_round();
            }
            if !model.rebuilt {
                model.rebuild(group, arrived)?;
            }
        }
        Ok(())
    }

    /// Starts the all-reduce of the next bucket and moves on to the one
    /// after it; `after_gradients` when inside backward.
    fn start_next(&mut self, after_gradients: Option<usize>) -> Result<(), DistError> {
        let _span = crate::profiling::span("hearth::bucket_reduce_start");
        let (m, b) = self.next;
        let model = &mut self.models[m];
        let started = match &model.reduction {
            Reduction::AllReduce(options) => {
                let bucket = model.bucket(b);
                let wire = comm_hook::Wire {
                    hook: options.comm_hook,
                    wrapper: options.comm_wrapper,
                    flag_present: !options.allows_unused_parameters(),
                };
                let (collective, kind, bytes) = comm_hook::start(
                    self.group,
                    wire,
                    model.power_sgd.as_mut(),
                    b,
                    &bucket,
                    self.shadow,
                    model.bucket_views.get(b),
                )?;
                model.stats.all_reduces += 1;
                model.stats.bytes += bytes;
                Some((collective, kind))
            }
            Reduction::ReduceScatter(units) => {
                assert!(!self.shadow, "sharded models do not join");
                match super::sharded::start(self.group, &units[b], None)? {
                    Some((pending, kind, bytes)) => {
                        model.stats.reduce_scatters += 1;
                        model.stats.bytes += bytes;
                        Some((Collective::One(pending), kind))
                    }
                    // A unit of frozen parameters alone sends nothing.
                    None => None,
                }
            }
        };
        self.next = if b + 1 < model.buckets.len() {
            (m, b + 1)
        } else {
            (m + 1, 0)
        };
        if let Some((collective, kind)) = started {
            self.started.push(Started {
                model: m,
                bucket: b,
                collective,
                kind,
                after_gradients,
            });
        }
        Ok(())
    }
}

/// What a gradient hook tells the round it belongs to.
trait Ready {
    /// The gradient of parameter `index` of model `id` is in.
    fn ready(&mut self, id: u64, index: usize);
}

impl Ready for Round<'_, '_> {
    fn ready(&mut self, id: u64, index: usize) {
        let Some(m) = self.models.iter().position(|model| model.id == id) else {
            return;
        };
        if self.error.is_some() || index >= self.seen[m].len() {
            return;
        }
        let bucket = self.models[m].bucket_of[index];
        if self.seen[m][index] {
            if (m, bucket) < self.next {
                // The bucket was sent with the gradient as it was then.
                self.error = Some(DistError::Mismatch {
                    op: "gradient sync",
                    rank: self.group.process_index(),
                    message: "a parameter's gradient was accumulated twice in one backward \
                              pass that syncs (its bucket was already sent): call backward \
                              once per sync step"
                        .into(),
                });
            }
            return;
        }
        self.seen[m][index] = true;
        self.arrived[m].push(index);
        self.waiting[m][bucket] -= 1;
        let reported = self.arrived.iter().map(Vec::len).sum();
        while self.next.0 < self.models.len() && self.waiting[self.next.0][self.next.1] == 0 {
            if let Err(e) = self.start_next(Some(reported)) {
                self.error = Some(e);
                return;
            }
        }
    }
}

/// A round's address while its backward pass runs.
struct LiveRound(*mut (dyn Ready + 'static));

// SAFETY: a hook may run on an autograd device thread (CUDA tensors) while
// the thread that owns the round runs the CPU part of backward or waits for
// it; every use of the pointer happens under `LIVE`'s lock (one hook at a
// time, and `Disarm` takes it too), and the MPI world is initialised for
// serialised calls from any thread.
unsafe impl Send for LiveRound {}

/// The rounds whose backward pass is running, by model id.
static LIVE: Mutex<Vec<(u64, LiveRound)>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<(u64, LiveRound)>> {
    LIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The gradient hook of every synced parameter: tells a live round, if any
/// (outside a round — `no_sync`, a plain `loss.backward()` — nothing).
extern "C" fn gradient_accumulated(id: u64, index: u64) {
    // A panic must not unwind into libtorch; the bucket then simply starts
    // after backward.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let rounds = live();
        if let Some((_, round)) = rounds.iter().find(|(live_id, _)| *live_id == id) {
            // SAFETY: see `Round::during`; the lock is held for the call.
            unsafe { (*round.0).ready(id, index as usize) }
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::super::ddp::CommHook;
    use super::*;
    use hearth_comm::{Pending, ReduceOp, SingleProcess};
    use tch::Device;

    fn param(n: i64) -> Tensor {
        Tensor::ones([n], (Kind::Float, Device::Cpu)).set_requires_grad(true)
    }

    fn named(params: Vec<Tensor>) -> Vec<(String, Tensor)> {
        (params.into_iter().enumerate())
            .map(|(i, p)| (format!("p{i}"), p))
            .collect()
    }

    #[test]
    fn a_world_of_one_keeps_its_gradients_and_counts_the_syncs() {
        let (a, b, unused) = (param(3), param(2), param(4));
        (&a * 2.0 + 0.0).sum(Kind::Float).backward();
        (&b * 3.0).sum(Kind::Float).backward();
        let mut sync = GradientSync::new(
            &SingleProcess,
            named(vec![
                a.shallow_clone(),
                b.shallow_clone(),
                unused.shallow_clone(),
            ]),
            DdpOptions::default(),
        )
        .unwrap();
        sync.sync(&SingleProcess).unwrap();
        assert_eq!(Vec::<f32>::try_from(a.grad()).unwrap(), vec![2.0; 3]);
        assert_eq!(Vec::<f32>::try_from(b.grad()).unwrap(), vec![3.0; 2]);
        assert!(!unused.grad().defined(), "no process had a gradient for it");
        let stats = sync.stats();
        assert_eq!(
            (stats.syncs, stats.all_reduces, stats.overlapped),
            (1, 1, 0)
        );
        assert_eq!(stats.bytes, ((3 + 2 + 4 + 3) * 4) as u64);
    }

    /// A world of one that notes, at each all-reduce started, the size of
    /// the bucket and which of `watched` have a gradient by then.
    struct Recording {
        watched: Vec<Tensor>,
        log: Mutex<Vec<(i64, Vec<bool>)>>,
    }

    impl ProcessGroup for Recording {
        fn process_index(&self) -> usize {
            0
        }
        fn num_processes(&self) -> usize {
            1
        }
        fn local_process_index(&self) -> usize {
            0
        }
        fn num_local_processes(&self) -> usize {
            1
        }
        fn backend(&self) -> &'static str {
            "recording"
        }
        fn all_reduce_start(&self, t: &Tensor, _: ReduceOp) -> Result<Pending<'_>, DistError> {
            let defined = self.watched.iter().map(|p| p.grad().defined()).collect();
            self.log.lock().unwrap().push((t.numel() as i64, defined));
            Ok(Pending::ready(t.copy()))
        }
    }

    impl Recording {
        fn new(watched: &[&Tensor]) -> Self {
            Self {
                watched: watched.iter().map(|t| t.shallow_clone()).collect(),
                log: Mutex::default(),
            }
        }

        /// Drops what was noted so far and returns it.
        fn take(&self) -> Vec<(i64, Vec<bool>)> {
            std::mem::take(&mut *self.log.lock().unwrap())
        }

        /// The averaging of `params`, one parameter per bucket.
        fn sync_over(&self, params: Vec<Tensor>) -> GradientSync {
            let options = DdpOptions {
                bucket_cap_mb: 1e-6,
                ..Default::default()
            };
            GradientSync::new(self, named(params), options).unwrap()
        }

        /// One backward pass of `loss` in a round over `sync`.
        fn round(&self, sync: &mut GradientSync, loss: impl FnOnce() -> Tensor) {
            let mut round = Round::new(std::slice::from_mut(sync), self);
            round.during(|| loss().backward());
            round.finish().unwrap();
        }
    }

    /// `near_input` feeds `near_output`, each used twice.
    fn chain(near_input: &Tensor, near_output: &Tensor) -> Tensor {
        let x = Tensor::ones([3], (Kind::Float, Device::Cpu));
        let hidden = (&x * near_input + &x * near_input).tanh().sum(Kind::Float);
        (hidden * near_output + near_output * 2.0).sum(Kind::Float)
    }

    /// The gradients a plain backward pass of `chain` gives.
    fn plain_gradients() -> (Vec<f32>, Vec<f32>) {
        let (input, output) = (param(3), param(1));
        chain(&input, &output).backward();
        (
            Vec::<f32>::try_from(input.grad()).unwrap(),
            Vec::<f32>::try_from(output.grad()).unwrap(),
        )
    }

    #[test]
    fn a_bucket_starts_inside_backward_as_soon_as_its_gradients_are_in() {
        let (input, output) = (param(3), param(1));
        let group = Recording::new(&[&input, &output]);
        let mut sync = group.sync_over(vec![input.shallow_clone(), output.shallow_clone()]);
        group.round(&mut sync, || chain(&input, &output));
        // `output`'s bucket (1 value + its flag) started while `input` had
        // no gradient yet: it overlapped the rest of backward.
        assert_eq!(
            group.take(),
            vec![(2, vec![false, true]), (4, vec![true, true])]
        );
        let stats = sync.stats();
        assert_eq!(
            (stats.syncs, stats.all_reduces, stats.overlapped),
            (1, 2, 1)
        );
        // The gradients are backward's (a parameter used twice included).
        let (want_input, want_output) = plain_gradients();
        assert_eq!(Vec::<f32>::try_from(input.grad()).unwrap(), want_input);
        assert_eq!(Vec::<f32>::try_from(output.grad()).unwrap(), want_output);

        // A backward pass outside a round (no_sync, plain backward)
        // starts nothing; the next round sends what both accumulated.
        chain(&input, &output).backward();
        assert!(group.take().is_empty());
        group.round(&mut sync, || chain(&input, &output));
        let three_passes: Vec<f32> = want_output.iter().map(|g| 3.0 * g).collect();
        assert_eq!(Vec::<f32>::try_from(output.grad()).unwrap(), three_passes);
    }

    #[test]
    fn buckets_are_rebuilt_in_the_order_gradients_came_in() {
        // Given in the order that makes the reverse-order guess wrong: the
        // first bucket holds `input`, whose gradient comes last.
        let (mut input, mut output) = (param(3), param(1));
        let group = Recording::new(&[&input, &output]);
        let mut sync = group.sync_over(vec![output.shallow_clone(), input.shallow_clone()]);
        group.round(&mut sync, || chain(&input, &output));
        // A ready bucket waits for the ones before it: nothing started
        // until `input`'s gradient was in, then both, in order.
        assert_eq!(
            group.take(),
            vec![(4, vec![true, true]), (2, vec![true, true])]
        );
        assert_eq!(sync.stats().overlapped, 0);
        // From the second round on, the buckets follow the gradients.
        input.zero_grad();
        output.zero_grad();
        group.round(&mut sync, || chain(&input, &output));
        let sizes: Vec<i64> = group.take().iter().map(|e| e.0).collect();
        assert_eq!(sizes, vec![2, 4]);
        assert_eq!(sync.stats().overlapped, 1);
    }

    #[test]
    fn a_bucket_without_gradients_starts_after_backward_and_a_frozen_parameter_is_left_out() {
        let (input, output, unused) = (param(3), param(1), param(5));
        let frozen = Tensor::ones([7], (Kind::Float, Device::Cpu));
        let group = Recording::new(&[&input, &output, &unused]);
        // Buckets: unused | output | input (the frozen one is in none).
        let mut sync = group.sync_over(vec![
            input.shallow_clone(),
            output.shallow_clone(),
            unused.shallow_clone(),
            frozen.shallow_clone(),
        ]);
        assert_eq!(sync.frozen().count(), 1);
        group.round(&mut sync, || chain(&input, &output));
        let sizes: Vec<i64> = group.take().iter().map(|e| e.0).collect();
        assert_eq!(sizes, vec![6, 2, 4], "still in bucket order");
        // `unused` held back every bucket until backward returned.
        assert_eq!(sync.stats().overlapped, 0);
        assert!(!unused.grad().defined());

        // Rebuilt: output | input, then the one that sent no gradient
        // (unused); only `input` ends backward.
        group.round(&mut sync, || chain(&input, &output));
        let sizes: Vec<i64> = group.take().iter().map(|e| e.0).collect();
        assert_eq!(sizes, vec![2, 4, 6]);
        assert_eq!(sync.stats().overlapped, 1);
    }

    #[test]
    fn a_gradient_accumulated_after_its_bucket_was_sent_is_refused() {
        let (input, output) = (param(3), param(1));
        let group = Recording::new(&[&input, &output]);
        let mut sync = group.sync_over(vec![input.shallow_clone(), output.shallow_clone()]);
        let mut round = Round::new(std::slice::from_mut(&mut sync), &group);
        round.during(|| {
            chain(&input, &output).backward();
            chain(&input, &output).backward();
        });
        let err = round.finish().unwrap_err().to_string();
        assert!(err.contains("accumulated twice"), "{err}");
    }

    #[test]
    fn the_16_bit_hooks_round_the_gradients() {
        let p = param(1);
        (&p * 1.0001).sum(Kind::Float).backward();
        let options = DdpOptions {
            comm_hook: CommHook::Bf16,
            ..Default::default()
        };
        let mut sync =
            GradientSync::new(&SingleProcess, named(vec![p.shallow_clone()]), options).unwrap();
        sync.sync(&SingleProcess).unwrap();
        // bfloat16 has 8 bits of mantissa: 1.0001 rounds to 1.
        assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), vec![1.0]);
        assert_eq!(
            sync.stats().bytes,
            4,
            "two 16-bit values: the gradient and its flag"
        );
    }
}
