//! Unit-wise execution (FSDP-NOTES design (b)): a prepared model's forward
//! pass runs its units ([`crate::models::Unit`]) one after another without
//! building a graph, keeping only each unit's input; the accelerator's
//! backward then recomputes the units in reverse order, with a graph, one
//! at a time, each fed the gradient of its output.
//!
//! This is activation checkpointing at the granularity of the model's
//! units, and it is how FULL_SHARD (ZeRO-3) holds whole parameters only
//! for the unit at work: the shards a unit needs are all-gathered just
//! before it runs and released once the last unit needing them ran — in
//! forward, and again in backward, where a shard unit's gradients are
//! reduce-scattered as soon as the first model unit using it (the last
//! one backward reaches) was recomputed. Since no graph outlives one
//! unit, releasing a parameter never breaks a saved activation.
//!
//! Randomness replays: the generator's state before each unit is kept and
//! restored for its recomputation, so dropout masks are the same twice.

use super::fsdp::{BackwardPrefetch, MixedPrecisionPolicy};
use super::sharded::{self, UnitShard};
use super::SyncStats;
use crate::models::Model;
use hearth_comm::{DistError, ProcessGroup};
use hearth_ops::AutocastGuard;
use std::cell::{Cell, RefCell};
use std::rc::Weak;
use tch::{Device, Kind, Tensor};

/// What FULL_SHARD adds to unit-wise execution: the shards, and when each
/// is gathered and released.
pub struct FullShard {
    /// Its own channel among the processes.
    group: Box<dyn ProcessGroup>,
    /// The wrap policy's units, their shards in storage of their own.
    units: Vec<UnitShard>,
    /// False keeps gathered units whole from forward until backward
    /// released them (FSDP2's `reshard_after_forward=False`).
    reshard_after_forward: bool,
    /// FSDP's mixed precision: what units are gathered in for use and
    /// what their gradients are reduced in.
    policy: Option<MixedPrecisionPolicy>,
    /// When the next unit's gather starts, ahead of its use.
    prefetch: Prefetch,
}

/// FULL_SHARD's prefetching: the all-gather of the units the next model
/// unit needs starts before the current one computes, so it can overlap
/// (FSDP's `forward_prefetch` and `backward_prefetch`). At most the
/// current unit and the next are gathered or in flight at once (what
/// FSDP1's `limit_all_gathers` guarantees).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// In forward, before the current unit runs.
    pub forward: bool,
    /// In backward, before (BACKWARD_PRE) or after (BACKWARD_POST) the
    /// current unit's gradients are computed.
    pub backward: BackwardPrefetch,
}

impl Default for Prefetch {
    fn default() -> Self {
        Self {
            forward: false,
            backward: BackwardPrefetch::NoPrefetch,
        }
    }
}

/// All-gathers started ahead of use, by shard unit.
type Ahead<'g> = Vec<(usize, hearth_comm::Pending<'g>)>;

/// How FULL_SHARD places, casts and prefetches (from the FSDP settings).
#[derive(Debug, Clone, Copy)]
pub struct FullShardOptions {
    /// False keeps gathered units whole from forward until backward.
    pub reshard_after_forward: bool,
    /// Every process first takes rank 0's values.
    pub sync_module_states: bool,
    /// Where the model trains: the shards go there (the whole parameters
    /// may still be elsewhere: they are released onto it).
    pub device: Device,
    /// The shards live in host memory instead (see [`UnitShard::own_shards`]).
    pub offload: bool,
    /// FSDP's mixed precision.
    pub policy: Option<MixedPrecisionPolicy>,
    /// When gathers start ahead of use.
    pub prefetch: Prefetch,
}

impl FullShard {
    /// Takes `units` (laid out for this process, parameters whole), gives
    /// their shards storage of their own and releases their whole
    /// parameters, as `options` say.
    pub fn new(
        group: Box<dyn ProcessGroup>,
        mut units: Vec<UnitShard>,
        options: FullShardOptions,
    ) -> Result<Self, DistError> {
        // Blocks this large go back to the system once freed, so that a
        // unit released below no longer counts (see free_large_blocks_at_once).
        hearth_ops::free_large_blocks_at_once(4 << 20);
        // Unit by unit: rank 0's values received, the shards taken, the
        // whole parameters freed, so that a process that never built its
        // weights (cpu-ram-efficient-loading) holds one unit whole at most.
        for unit in &mut units {
            if options.sync_module_states {
                for p in &unit.params {
                    let mut t = p.full.detach();
                    group.broadcast(&mut t, 0)?;
                }
            }
            unit.own_shards(options.device, options.offload);
            unit.release_on(Some(options.device));
        }
        hearth_ops::return_freed_host_memory();
        Ok(Self {
            group,
            units,
            reshard_after_forward: options.reshard_after_forward,
            policy: options.policy,
            prefetch: options.prefetch,
        })
    }

    /// Bytes of this process's shards of the parameters.
    pub fn shard_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        self.units
            .iter()
            .flat_map(|u| &u.params)
            .map(|p| bytes(&p.shard))
            .sum()
    }

    /// Handles to the units (for the sharded optimizer).
    pub fn units(&self) -> Vec<UnitShard> {
        self.units.iter().map(UnitShard::shallow_clone).collect()
    }
}

/// The model units' inputs kept by one forward pass, for its backward.
struct Tape {
    model: Weak<dyn Model>,
    /// Each model unit's input.
    inputs: Vec<Tensor>,
    /// The generator's state before each model unit ran.
    rng: Vec<Tensor>,
    /// What forward returned: a leaf whose gradient backward starts from.
    output: Tensor,
    train: bool,
    autocast: Option<(Device, Kind)>,
}

/// Which shard units each model unit needs, and the first and last model
/// unit needing each shard unit.
struct Uses {
    per_unit: Vec<Vec<usize>>,
    first: Vec<Option<usize>>,
    last: Vec<Option<usize>>,
}

/// Unit-wise execution of one prepared model.
pub struct Unitwise {
    full_shard: Option<FullShard>,
    uses: RefCell<Option<Uses>>,
    tapes: RefCell<Vec<Tape>>,
    stats: Cell<SyncStats>,
}

/// Why unit-wise execution failed (the model's forward cannot return an
/// error, so forward panics with it; backward returns it).
#[derive(Debug, thiserror::Error)]
pub enum UnitwiseError {
    /// A collective failed.
    #[error("FULL_SHARD: {op} of unit `{unit}` failed")]
    Dist {
        /// What was being done.
        op: &'static str,
        /// The shard unit's path.
        unit: String,
        /// The failure.
        #[source]
        source: DistError,
    },
    /// libtorch failed recomputing a unit. Its message is part of this
    /// one (not a `source`), so that a check of the text, such as
    /// [`crate::accelerator::is_out_of_memory`] in
    /// `find_executable_batch_size`, sees an out-of-memory error.
    #[error("recomputing model unit {unit} in backward failed: {error}")]
    Torch {
        /// The model unit's index.
        unit: usize,
        /// The failure.
        error: tch::TchError,
    },
}

/// Whether autograd records operations now (read by setting it and
/// putting it back: libtorch has no getter that tch exposes).
fn grad_enabled() -> bool {
    // SAFETY: plain calls on libtorch's thread-local grad mode, restored at once.
    unsafe {
        let previous = torch_sys::at_grad_set_enabled(0);
        torch_sys::at_grad_set_enabled(previous);
        previous != 0
    }
}

/// Whether parameter `name` belongs to one of `modules`.
fn under(name: &str, modules: &[&str]) -> bool {
    modules.iter().any(|m| {
        m.is_empty()
            || name
                .strip_prefix(m)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

impl Unitwise {
    /// Unit-wise execution, sharded with `full_shard` or (activation
    /// checkpointing alone) with whole parameters.
    pub fn new(full_shard: Option<FullShard>) -> Self {
        Self {
            full_shard,
            uses: RefCell::default(),
            tapes: RefCell::default(),
            stats: Cell::default(),
        }
    }

    /// The FULL_SHARD part, if sharded.
    pub fn full_shard(&self) -> Option<&FullShard> {
        self.full_shard.as_ref()
    }

    /// Reduce-scatters, gathers and recomputations done so far.
    pub fn stats(&self) -> SyncStats {
        self.stats.get()
    }

    fn count(&self, f: impl FnOnce(&mut SyncStats)) {
        let mut stats = self.stats.get();
        f(&mut stats);
        self.stats.set(stats);
    }

    fn compute_uses(&self, model: &dyn Model) {
        if self.uses.borrow().is_some() {
            return;
        }
        let units = self.full_shard.as_ref().map_or(&[][..], |f| &f.units[..]);
        let mut first = vec![None; units.len()];
        let mut last = vec![None; units.len()];
        let per_unit = model
            .units()
            .iter()
            .enumerate()
            .map(|(k, unit)| {
                let modules = unit.modules();
                let needed: Vec<usize> = units
                    .iter()
                    .enumerate()
                    .filter(|(_, u)| u.params.iter().any(|p| under(&p.name, &modules)))
                    .map(|(i, _)| i)
                    .collect();
                for &i in &needed {
                    first[i].get_or_insert(k);
                    last[i] = Some(k);
                }
                needed
            })
            .collect();
        *self.uses.borrow_mut() = Some(Uses {
            per_unit,
            first,
            last,
        });
    }

    /// The kind shard unit `unit` is gathered in: `exact`ly (the shards'
    /// own kind, for saving and loading), else for use.
    fn gather_kind(fs: &FullShard, unit: &UnitShard, exact: bool) -> Kind {
        match fs.policy {
            Some(policy) if !exact => policy.param_dtype.kind(),
            _ => unit.shard_kind(),
        }
    }

    /// Gathers the units `which` (see [`gather_kind`](Self::gather_kind)),
    /// finishing those whose all-gather is in `ahead` (prefetched).
    fn gather_as<'g>(
        &'g self,
        which: &[usize],
        exact: bool,
        ahead: &mut Ahead<'g>,
    ) -> Result<(), UnitwiseError> {
        let Some(fs) = &self.full_shard else {
            return Ok(());
        };
        for &i in which {
            let unit = &fs.units[i];
            let dist = |source| UnitwiseError::Dist {
                op: "all-gather",
                unit: unit.path.clone(),
                source,
            };
            let bytes = match ahead.iter().position(|(j, _)| *j == i) {
                Some(at) => {
                    let (_, pending) = ahead.remove(at);
                    unit.gather_finish(pending.wait().map_err(dist)?);
                    0 // counted when it started
                }
                None if unit.is_gathered_in(Self::gather_kind(fs, unit, exact)) => continue,
                None => unit
                    .gather(fs.group.as_ref(), Self::gather_kind(fs, unit, exact))
                    .map_err(dist)?,
            };
            let held = fs.units.iter().filter(|u| u.is_gathered()).count() as u64;
            self.count(|s| {
                s.gathers += 1;
                s.gather_bytes += bytes;
                s.most_gathered = s.most_gathered.max(held);
            });
        }
        Ok(())
    }

    /// Starts the all-gathers, for use, of the units `which` that are
    /// neither gathered nor started yet (a prefetch), into `ahead`.
    fn prefetch<'g>(&'g self, which: &[usize], ahead: &mut Ahead<'g>) -> Result<(), UnitwiseError> {
        let Some(fs) = &self.full_shard else {
            return Ok(());
        };
        for &i in which {
            let unit = &fs.units[i];
            let kind = Self::gather_kind(fs, unit, false);
            if unit.is_gathered_in(kind) || ahead.iter().any(|(j, _)| *j == i) {
                continue;
            }
            let (pending, bytes) =
                unit.gather_start(fs.group.as_ref(), kind)
                    .map_err(|source| UnitwiseError::Dist {
                        op: "all-gather",
                        unit: unit.path.clone(),
                        source,
                    })?;
            ahead.push((i, pending));
            self.count(|s| {
                s.prefetched += 1;
                s.gather_bytes += bytes;
            });
        }
        Ok(())
    }

    /// The forward and backward prefetch settings (none without FULL_SHARD).
    fn prefetching(&self) -> Prefetch {
        self.full_shard
            .as_ref()
            .map_or(Prefetch::default(), |f| f.prefetch)
    }

    /// Gathers every shard unit whole (FSDP's `summon_full_params`): for
    /// saving, loading and unwrapping. Nothing without FULL_SHARD.
    pub fn gather_all(&self) -> Result<(), UnitwiseError> {
        let n = self.full_shard.as_ref().map_or(0, |f| f.units.len());
        self.gather_as(&(0..n).collect::<Vec<_>>(), true, &mut Vec::new())
    }

    /// Runs `f` on each shard unit in turn, its whole parameters gathered
    /// for it and released after it (unless held before): at most one
    /// unit more than before is whole at any time. Nothing without
    /// FULL_SHARD.
    pub fn each_unit_whole(&self, mut f: impl FnMut(&UnitShard)) -> Result<(), UnitwiseError> {
        let Some(fs) = &self.full_shard else {
            return Ok(());
        };
        for (i, unit) in fs.units.iter().enumerate() {
            let held = unit.is_gathered_in(unit.shard_kind());
            self.gather_as(&[i], true, &mut Vec::new())?;
            f(unit);
            if !held {
                unit.release();
            }
        }
        Ok(())
    }

    /// Forgets the most units held whole so far (summoning them all at
    /// `prepare` is not training's peak).
    pub fn reset_most_gathered(&self) {
        self.count(|s| s.most_gathered = 0);
    }

    /// Releases every shard unit, after copying this process's rows of
    /// the whole parameters into its shards when `write_back` (they were
    /// loaded while gathered).
    pub fn release_all(&self, write_back: bool) {
        let Some(fs) = &self.full_shard else {
            return;
        };
        let rank = fs.group.process_index();
        for unit in &fs.units {
            if unit.is_gathered() {
                if write_back {
                    unit.write_back(rank);
                }
                unit.release();
            }
        }
    }

    /// Runs `model`'s units on `tokens`. When autograd records (training),
    /// each unit runs without a graph and its input is kept; the result is
    /// then a new leaf that requires grad, which
    /// [`backward`](Self::backward) takes its gradient from. `handle`
    /// (the same model) is what backward recomputes with.
    pub fn forward(
        &self,
        model: &dyn Model,
        handle: Weak<dyn Model>,
        tokens: &Tensor,
        train: bool,
        autocast: Option<(Device, Kind)>,
    ) -> Result<Tensor, UnitwiseError> {
        self.compute_uses(model);
        let uses = self.uses.borrow();
        let uses = uses.as_ref().expect("computed above");
        let record = grad_enabled();
        let keep = record
            && !self
                .full_shard
                .as_ref()
                .is_some_and(|f| f.reshard_after_forward);
        let mut x = tokens.shallow_clone();
        let mut inputs = Vec::new();
        let mut rng = Vec::new();
        let device = tokens.device();
        let units = model.units();
        // Backward starts with the last model unit: what it uses stays
        // gathered (as FSDP keeps the root's parameters after forward).
        let ends: Vec<Option<usize>> = if record {
            let last = units.len().checked_sub(1);
            uses.last
                .iter()
                .map(|&l| l.filter(|&l| Some(l) != last))
                .collect()
        } else {
            uses.last.clone()
        };
        let prefetch = self.prefetching();
        let mut ahead = Vec::new();
        for (k, unit) in units.iter().enumerate() {
            self.gather_as(&uses.per_unit[k], false, &mut ahead)?;
            if let Some(next) = uses.per_unit.get(k + 1).filter(|_| prefetch.forward) {
                self.prefetch(next, &mut ahead)?;
            }
            if record {
                inputs.push(x.shallow_clone());
                rng.push(
                    hearth_ops::rng_state(device)
                        .map_err(|error| UnitwiseError::Torch { unit: k, error })?,
                );
                x = tch::no_grad(|| unit.forward_t(&x, train));
            } else {
                x = unit.forward_t(&x, train);
            }
            if !keep {
                self.release_after(uses, k, &ends);
            }
        }
        if !record {
            return Ok(x);
        }
        let output = if x.is_floating_point() {
            x.detach().set_requires_grad(true)
        } else {
            x
        };
        self.tapes.borrow_mut().push(Tape {
            model: handle,
            inputs,
            rng,
            output: output.shallow_clone(),
            train,
            autocast,
        });
        Ok(output)
    }

    /// Releases the shard units needed by model unit `k` whose use ends
    /// there (`ends[i] == Some(k)`).
    fn release_after(&self, uses: &Uses, k: usize, ends: &[Option<usize>]) {
        let Some(fs) = &self.full_shard else {
            return;
        };
        for &i in &uses.per_unit[k] {
            if ends[i] == Some(k) {
                fs.units[i].release();
            }
        }
    }

    /// True when a forward pass kept inputs that backward has not used.
    pub fn pending(&self) -> bool {
        !self.tapes.borrow().is_empty()
    }

    /// After the loss's own backward pass: recomputes, in reverse, the
    /// units of every forward pass whose output got a gradient, each
    /// fed the gradient of its output, so that the parameters' gradients
    /// accumulate as one backward pass through the whole model would
    /// leave them. Under FULL_SHARD a shard unit's gradients are then
    /// reduce-scattered (their mean over processes added to this
    /// process's shard gradients) and its whole parameters released.
    /// Forward passes whose output got no gradient are forgotten.
    pub fn backward(&self) -> Result<(), UnitwiseError> {
        let tapes = std::mem::take(&mut *self.tapes.borrow_mut());
        let uses = self.uses.borrow();
        for tape in tapes.into_iter().rev() {
            let mut grad = tape.output.grad();
            let Some(model) = tape.model.upgrade() else {
                continue;
            };
            if !grad.defined() {
                continue;
            }
            let uses = uses.as_ref().expect("a forward pass computed them");
            let units = model.units();
            if self.full_shard.is_some() {
                self.count(|s| s.syncs += 1);
            }
            let prefetch = self.prefetching();
            let mut ahead = Vec::new();
            let previous = |k: usize| k.checked_sub(1).map(|p| &uses.per_unit[p][..]);
            for k in (0..units.len()).rev() {
                self.gather_as(&uses.per_unit[k], false, &mut ahead)?;
                if let (BackwardPrefetch::BackwardPre, Some(before)) =
                    (prefetch.backward, previous(k))
                {
                    self.prefetch(before, &mut ahead)?;
                }
                let input = &tape.inputs[k];
                let input = if input.is_floating_point() {
                    input.detach().set_requires_grad(true)
                } else {
                    input.shallow_clone()
                };
                let torch = |error| UnitwiseError::Torch { unit: k, error };
                let device = input.device();
                let now = hearth_ops::rng_state(device).map_err(torch)?;
                hearth_ops::set_rng_state(device, &tape.rng[k]).map_err(torch)?;
                let output = tch::with_grad(|| {
                    let _guard = tape.autocast.map(|(d, kind)| {
                        AutocastGuard::new(d, kind).expect("autocast kinds are valid")
                    });
                    units[k].forward_t(&input, tape.train)
                });
                hearth_ops::set_rng_state(device, &now).map_err(torch)?;
                self.count(|s| s.recomputed += 1);
                if output.requires_grad() {
                    let surrogate = (output.to_kind(grad.kind()) * &grad).sum(Kind::Float);
                    surrogate.f_backward().map_err(torch)?;
                }
                if let (BackwardPrefetch::BackwardPost, Some(before)) =
                    (prefetch.backward, previous(k))
                {
                    self.prefetch(before, &mut ahead)?;
                }
                if k > 0 {
                    grad = input.grad();
                    if !grad.defined() {
                        grad = input.zeros_like();
                    }
                }
                self.reduce_and_release(uses, k)?;
            }
        }
        Ok(())
    }

    /// Reduce-scatters the gradients of the shard units model unit `k`
    /// was the first to use, and releases them.
    fn reduce_and_release(&self, uses: &Uses, k: usize) -> Result<(), UnitwiseError> {
        let Some(fs) = &self.full_shard else {
            return Ok(());
        };
        let group = fs.group.as_ref();
        for &i in &uses.per_unit[k] {
            if uses.first[i] != Some(k) {
                continue;
            }
            let unit = &fs.units[i];
            let dist = |source| UnitwiseError::Dist {
                op: "gradient reduce-scatter",
                unit: unit.path.clone(),
                source,
            };
            let reduce = fs.policy.map(|p| p.reduce_dtype.kind());
            let (pending, _, bytes) = sharded::start(group, unit, reduce).map_err(dist)?;
            let reduced = pending.wait().map_err(dist)?;
            sharded::write_gradient_shard(group, unit, &reduced).map_err(dist)?;
            unit.release();
            self.count(|s| {
                s.reduce_scatters += 1;
                s.bytes += bytes;
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parameter_is_under_its_module_only() {
        let _rng = crate::global_rng();
        assert!(under("blocks.1.fc.weight", &["blocks.1"]));
        assert!(!under("blocks.10.fc.weight", &["blocks.1"]));
        assert!(under("tok.weight", &["tok", "pos"]));
        assert!(under("anything", &[""]));
    }

    /// Two units, the first with dropout: run unit-wise, the gradients
    /// must be those of one ordinary backward pass with the same seed,
    /// which holds only if the recomputation replays the dropout mask.
    struct Net {
        vs: tch::nn::VarStore,
        tree: crate::models::ModuleTree,
        a: Layer,
        b: Layer,
    }
    struct Layer {
        path: &'static str,
        linear: tch::nn::Linear,
        dropout: bool,
    }
    impl crate::models::Unit for Layer {
        fn modules(&self) -> Vec<&str> {
            vec![self.path]
        }
        fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
            let y = tch::nn::Module::forward(&self.linear, x).tanh();
            if self.dropout {
                y.dropout(0.5, train)
            } else {
                y
            }
        }
    }
    impl Model for Net {
        fn module_tree(&self) -> &crate::models::ModuleTree {
            &self.tree
        }
        fn units(&self) -> Vec<&dyn crate::models::Unit> {
            vec![&self.a, &self.b]
        }
        fn named_parameters(&self) -> Vec<(String, Tensor)> {
            crate::models::sorted_variables(&self.vs)
        }
    }

    fn net() -> Net {
        tch::manual_seed(1);
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let linear = |name: &str| tch::nn::linear(vs.root() / name, 8, 8, Default::default());
        let (a, b) = (linear("a"), linear("b"));
        let tree = crate::models::ModuleTree::from_variables(
            &crate::models::declaration_order(&vs),
            "Net",
            &[],
        );
        Net {
            a: Layer {
                path: "a",
                linear: a,
                dropout: true,
            },
            b: Layer {
                path: "b",
                linear: b,
                dropout: false,
            },
            vs,
            tree,
        }
    }

    fn grads(net: &Net) -> Vec<Tensor> {
        net.named_parameters()
            .iter()
            .map(|(_, p)| p.grad().copy())
            .collect()
    }

    #[test]
    fn unit_wise_backward_gives_one_backward_passs_gradients_dropout_replayed() {
        let _rng = crate::global_rng();
        let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
        let whole = net();
        tch::manual_seed(5);
        whole
            .forward_t(&x, true)
            .pow_tensor_scalar(2)
            .sum(Kind::Float)
            .backward();

        let net = std::rc::Rc::new(net());
        let unitwise = Unitwise::new(None);
        tch::manual_seed(5);
        let handle: Weak<dyn Model> = std::rc::Rc::downgrade(&net) as Weak<dyn Model>;
        let y = unitwise.forward(&*net, handle, &x, true, None).unwrap();
        // Nothing of the units is in the graph: only the output's leaf.
        assert!(y.is_leaf() && y.requires_grad());
        y.pow_tensor_scalar(2).sum(Kind::Float).backward();
        unitwise.backward().unwrap();
        assert_eq!(unitwise.stats().recomputed, 2);
        for (got, want) in grads(&net).iter().zip(grads(&whole)) {
            assert!(got.allclose(&want, 1e-6, 1e-7, false), "{got} vs {want}");
        }
    }

    #[test]
    fn grad_mode_is_seen() {
        let _rng = crate::global_rng();
        assert!(grad_enabled());
        assert!(!tch::no_grad(grad_enabled));
    }
}
