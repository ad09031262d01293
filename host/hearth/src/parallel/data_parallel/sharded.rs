//! FSDP in the accelerator's data parallelism: a prepared model's units
//! from the wrap policy (agreed by every process), laid out in shards —
//! SHARD_GRAD_OP through [`GradientSync::sharded`], FULL_SHARD through
//! [`FullShard`] and unit-wise execution — the HYBRID groups, whole
//! parameters gathered on demand (`summon`, `whole_copies`) and optimizers
//! wrapped to step shards.

use super::DataParallel;
use crate::models::ModuleTree;
use crate::optim::Optimizer;
use crate::parallel::fsdp::{plan_units, ShardingError};
use crate::parallel::sharded::{ShardedOptimizer, UnitShard};
use crate::parallel::{FullShard, FullShardOptions, GradientSync, Prefetch, ReadWeights, Unitwise};
use hearth_comm::{HybridGroup, ProcessGroup};
use std::rc::Rc;
use tch::Tensor;

/// How a prepared model is sharded: what it must run with and its units.
#[derive(Default)]
pub(crate) struct ModelSharding {
    /// The unit-wise execution the model must run with (FULL_SHARD,
    /// activation checkpointing).
    pub unitwise: Option<Rc<Unitwise>>,
    /// Its sharded units (handles; empty when it is not sharded), for
    /// sharded checkpoints.
    pub units: Vec<UnitShard>,
    /// The wrap policy's unit paths, when the model runs unit by unit: a
    /// model whose units are not fixed is cut at them ([`crate::models::Model::cut_at`]).
    pub cut_at: Option<Vec<String>>,
}

/// The HYBRID strategies' groups: the shards spread over each machine's
/// processes, replicated across machines.
pub(crate) struct Hybrid {
    group: HybridGroup,
    /// Every process's (replica, rank among its machine's processes).
    places: Vec<(usize, usize)>,
}

impl DataParallel {
    /// Shards the model `tree` describes (its `parameters` named): asks the
    /// wrap policy for its units — also in a world of one, so that a bad
    /// policy stops every run, and with NO_SHARD too — checks that every
    /// process got the same units, and, with several processes, lays each
    /// unit out in shards: SHARD_GRAD_OP reduce-scatters its gradients from
    /// now on, FULL_SHARD also releases its whole parameters, to be gathered
    /// around each use. Without FSDP, or with NO_SHARD,
    /// [`register`](Self::register) (the parameters of ignored modules left
    /// out). Returns the unit-wise execution the model must run with
    /// (FULL_SHARD, activation checkpointing), which needs a model whose
    /// units hearth can run (`runs_units`), and its sharded units.
    pub(crate) fn register_model(
        &self,
        group: &dyn ProcessGroup,
        tree: &ModuleTree,
        parameters: Vec<(String, Tensor)>,
        runs_units: bool,
        device: tch::Device,
        read: ReadWeights<'_>,
    ) -> Result<ModelSharding, ShardingError> {
        let Some(settings) = &self.strategy.fsdp else {
            self.register(group, parameters)?;
            return Ok(ModelSharding::default());
        };
        let world = group.num_processes();
        let full_shard = settings.sharding_strategy.shards_parameters();
        // Refused in a world of one too: a job must not work on one
        // process and fail on two.
        if (full_shard || settings.activation_checkpointing) && !runs_units {
            let (what, instead) = if full_shard {
                let strategy = settings.sharding_strategy;
                let zero2 = match strategy.hybrid() {
                    true => "HYBRID_SHARD_ZERO2",
                    false => "SHARD_GRAD_OP",
                };
                (strategy.as_str(), zero2)
            } else {
                ("activation checkpointing", "no activation checkpointing")
            };
            return Err(ShardingError::Unitwise(format!(
                "{what} runs the model unit by unit, and hearth cannot run the units of a model whose \
                 forward pass is your own code (a VarStore); prepare a hearth `Model` (GPT, MLP, \
                 TorchScript, or your type implementing `Model` and its `units`), or use {instead}"
            )));
        }
        let plan = agreed(group, plan_units(tree, settings, &self.plugin_path))?;
        let cut_at: Vec<String> = plan.iter().map(|(path, _)| path.clone()).collect();
        let checkpointing = |units: Vec<UnitShard>| ModelSharding {
            unitwise: settings.activation_checkpointing.then(|| {
                let unitwise = Rc::new(Unitwise::new(None, true));
                self.unitwise.borrow_mut().push(unitwise.clone());
                unitwise
            }),
            units,
            // Checked in a world of one too: a model that cannot run unit
            // by unit must not train on one process and fail on two.
            cut_at: (settings.activation_checkpointing || full_shard).then(|| cut_at.clone()),
        };
        let in_units: std::collections::HashSet<&str> = plan
            .iter()
            .flat_map(|(_, names)| names.iter().map(String::as_str))
            .collect();
        let outside: Vec<String> = parameters
            .iter()
            .map(|(n, _)| n.clone())
            .filter(|n| !in_units.contains(n.as_str()))
            .collect();
        read(&outside).map_err(ShardingError::Weights)?;
        if settings.sync_module_states && world > 1 {
            // Parameters no unit holds (ignored modules') take rank 0's
            // values too: under cpu-ram-efficient-loading the other
            // processes never built them.
            for (_, p) in parameters
                .iter()
                .filter(|(n, _)| !in_units.contains(n.as_str()))
            {
                group.broadcast(&mut p.detach(), 0)?;
            }
        }
        if !settings.sharding_strategy.shards() {
            let kept: std::collections::HashSet<&str> = plan
                .iter()
                .flat_map(|(_, names)| names.iter().map(String::as_str))
                .collect();
            let tensors = parameters
                .into_iter()
                .filter(|(n, _)| kept.contains(n.as_str()))
                .collect();
            self.register(group, tensors)?;
            return Ok(checkpointing(Vec::new()));
        }
        let known = |p: &Tensor| {
            self.units
                .borrow()
                .iter()
                .flat_map(|u| u.params.iter().map(|q| q.full.data_ptr()))
                .any(|q| q == p.data_ptr())
        };
        // cpu-offload on a GPU shards a world of one too: its shards,
        // gradients and optimizer state then live in host memory (what
        // ZeRO-Offload does for one GPU); on the CPU they are there anyway.
        let offload = settings.cpu_offload && device.is_cuda();
        // So does a mixed-precision policy (FSDP casts in a world of one).
        let policy = settings.mixed_precision_policy;
        if (world == 1 && !offload && policy.is_none()) || parameters.iter().all(|(_, p)| known(p))
        {
            read(&in_units.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .map_err(ShardingError::Weights)?;
            return Ok(checkpointing(Vec::new()));
        }
        // The processes the shards are spread over: all, or (HYBRID) this
        // machine's.
        let group = match settings.sharding_strategy.hybrid() {
            true => &self.hybrid(group)?.group as &dyn ProcessGroup,
            false => group,
        };
        let (rank, world) = (group.process_index(), group.num_processes());
        let by_name: std::collections::HashMap<&str, &Tensor> =
            parameters.iter().map(|(n, p)| (n.as_str(), p)).collect();
        let units: Vec<UnitShard> = plan
            .into_iter()
            .map(|(path, names)| {
                let params = names
                    .into_iter()
                    .filter_map(|n| by_name.get(n.as_str()).map(|p| (n, p.shallow_clone())))
                    .collect();
                UnitShard::new(path, params, rank, world)
            })
            .filter(|u| !u.params.is_empty())
            .collect();
        if full_shard {
            let full = FullShard::new(
                group.duplicate()?,
                units,
                read,
                FullShardOptions {
                    reshard_after_forward: settings.reshard_after_forward,
                    sync_module_states: settings.sync_module_states,
                    device,
                    offload,
                    policy,
                    prefetch: Prefetch {
                        forward: settings.forward_prefetch,
                        backward: settings.backward_prefetch,
                    },
                },
            )?;
            let units = full.units();
            let unitwise = Rc::new(Unitwise::new(Some(full), settings.activation_checkpointing));
            self.unitwise.borrow_mut().push(unitwise.clone());
            return Ok(ModelSharding {
                unitwise: Some(unitwise),
                units,
                cut_at: Some(cut_at),
            });
        }
        let mut units = units;
        for unit in &units {
            let names: Vec<String> = unit.params.iter().map(|p| p.name.clone()).collect();
            read(&names).map_err(ShardingError::Weights)?;
        }
        if offload {
            units.iter_mut().for_each(|u| u.own_shards(device, true));
        }
        let handles: Vec<UnitShard> = units.iter().map(UnitShard::shallow_clone).collect();
        self.units
            .borrow_mut()
            .extend(units.iter().map(UnitShard::shallow_clone));
        let sync = GradientSync::sharded(group, units, settings.sync_module_states)?;
        self.models.borrow_mut().push(sync);
        Ok(checkpointing(handles))
    }

    /// The HYBRID groups, made on first use (every process calls it at the
    /// same point), by this process's machine name.
    fn hybrid(&self, world: &dyn ProcessGroup) -> Result<&Hybrid, ShardingError> {
        if let Some(hybrid) = self.hybrid.get() {
            return Ok(hybrid);
        }
        let (group, places) =
            HybridGroup::by_machine(world, &hearth_comm::environment::node_name())?;
        Ok(self.hybrid.get_or_init(|| Hybrid { group, places }))
    }

    /// Process `rank`'s place among the holders of shards: which copy of
    /// the shards it holds (its machine, under HYBRID; else 0) and its rank
    /// among the processes sharing them.
    pub(crate) fn shard_place(&self, rank: usize) -> (usize, usize) {
        self.hybrid.get().map_or((0, rank), |h| h.places[rank])
    }

    /// The unit-wise executions that shard (FULL_SHARD).
    pub(crate) fn full_shards(&self) -> Vec<Rc<Unitwise>> {
        self.unitwise
            .borrow()
            .iter()
            .filter(|u| u.full_shard().is_some())
            .cloned()
            .collect()
    }

    /// Each FULL_SHARD parameter's kind and shape when whole (its shards'
    /// own kind: what a save writes), by name.
    pub(crate) fn whole_shapes(&self) -> std::collections::HashMap<String, (tch::Kind, Vec<i64>)> {
        self.full_shards()
            .iter()
            .filter_map(|u| u.full_shard().map(FullShard::units))
            .flatten()
            .flat_map(|unit| {
                let kind = unit.shard_kind();
                unit.params
                    .iter()
                    .map(|p| (p.name.clone(), (kind, p.shape.clone())))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// A stream of `params` whole (see [`WholeStream`]).
    pub(crate) fn whole_stream<'p>(&self, params: &'p [(String, Tensor)]) -> WholeStream<'p> {
        let units: Vec<(Rc<Unitwise>, Vec<UnitShard>)> = self
            .full_shards()
            .into_iter()
            .map(|u| {
                let units = u.full_shard().map(FullShard::units).unwrap_or_default();
                (u, units)
            })
            .collect();
        let owners = params
            .iter()
            .map(|(name, _)| {
                units.iter().enumerate().find_map(|(w, (_, shards))| {
                    shards.iter().enumerate().find_map(|(u, unit)| {
                        let k = unit.params.iter().position(|p| &p.name == name)?;
                        Some((w, u, k))
                    })
                })
            })
            .collect();
        WholeStream {
            params,
            units,
            owners,
            current: None,
            asked: 0,
        }
    }

    /// Runs `f` with every FULL_SHARD model's parameters whole (FSDP's
    /// `summon_full_params`), then releases them.
    pub(crate) fn with_full_params<R>(
        &self,
        f: impl FnOnce() -> R,
    ) -> Result<R, crate::parallel::UnitwiseError> {
        let _summoned = self.summon()?;
        Ok(f())
    }

    /// `params` (name and tensor) as CPU tensors — what a
    /// FULL_STATE_DICT save writes. FULL_SHARD parameters are gathered
    /// unit by unit and copied (every process must call it: it
    /// all-gathers), so at most one unit more than training holds is ever
    /// whole; the others are taken as they are, copied by `copy` when given. With
    /// `keep` false the process only takes part in the gathers and gets
    /// nothing.
    pub(crate) fn whole_copies(
        &self,
        params: &[(String, Tensor)],
        keep: bool,
        mut copy: Option<&mut dyn FnMut(&Tensor) -> Tensor>,
    ) -> Result<Vec<(String, Tensor)>, crate::parallel::UnitwiseError> {
        let cpu = |t: &Tensor| t.detach().to_device(tch::Device::Cpu);
        let mut whole: Vec<Option<Tensor>> = params.iter().map(|_| None).collect();
        for unitwise in self.full_shards() {
            unitwise.each_unit_whole(|unit| {
                if !keep {
                    return;
                }
                // The model's handles see the gathered storage: match by it.
                let at: std::collections::HashMap<usize, usize> = params
                    .iter()
                    .enumerate()
                    .filter(|(_, (_, t))| t.numel() > 0)
                    .map(|(j, (_, t))| (t.data_ptr() as usize, j))
                    .collect();
                for p in &unit.params {
                    if let Some(&j) = at.get(&(p.full.data_ptr() as usize)) {
                        whole[j] = Some(match copy.as_deref_mut() {
                            Some(copy) => copy(&p.full),
                            None => cpu(&p.full).copy(),
                        });
                    }
                }
            })?;
        }
        if !keep {
            return Ok(Vec::new());
        }
        Ok(params
            .iter()
            .zip(whole)
            .map(|((name, t), w)| {
                let t = w.unwrap_or_else(|| match copy.as_deref_mut() {
                    Some(copy) => copy(t),
                    None => cpu(t),
                });
                (name.clone(), t)
            })
            .collect())
    }

    /// Gathers every FULL_SHARD model's parameters whole until the
    /// returned guard drops (every process must call it: it all-gathers).
    pub(crate) fn summon(&self) -> Result<Summoned, crate::parallel::UnitwiseError> {
        let summoned = Summoned {
            units: self.full_shards(),
            write_back: false,
        };
        for u in &summoned.units {
            u.gather_all()?;
        }
        Ok(summoned)
    }

    /// Refuses to shard parameters an optimizer already holds: it was
    /// prepared before the model and would step the whole parameters,
    /// whose gradients sharding drops.
    pub(crate) fn check_not_held(
        &self,
        held: &[Tensor],
        parameters: &[(String, Tensor)],
    ) -> Result<(), ShardingError> {
        let sharding = self.fsdp().is_some_and(|s| s.sharding_strategy.shards());
        let ptrs: std::collections::HashSet<usize> =
            held.iter().map(|t| t.data_ptr() as usize).collect();
        match parameters.iter().find(|(_, p)| ptrs.contains(&(p.data_ptr() as usize))) {
            Some((name, _)) if sharding => Err(ShardingError::Optimizer(format!(
                "an optimizer prepared before the model holds `{name}`; prepare the model first \
                 (or list it before the optimizer in the same prepare call), as with Accelerate's FSDP"
            ))),
            _ => Ok(()),
        }
    }

    /// `inner` as it steps: over the shards of the sharded parameters it
    /// holds (with a channel of its own among the processes), or
    /// unchanged when none of its parameters is sharded.
    pub(crate) fn wrap_optimizer(
        &self,
        group: &dyn ProcessGroup,
        inner: Box<dyn Optimizer>,
    ) -> Result<Box<dyn Optimizer>, ShardingError> {
        let full = self.full_shards();
        // Whole parameters are recognised by their storage: gather them.
        let wrapped = self
            .with_full_params(|| {
                let params: Vec<usize> = inner
                    .parameters()
                    .iter()
                    .map(|p| p.data_ptr() as usize)
                    .collect();
                let holds = |u: &UnitShard| {
                    u.params
                        .iter()
                        .any(|p| params.contains(&(p.full.data_ptr() as usize)))
                };
                let mut units: Vec<UnitShard> = self
                    .units
                    .borrow()
                    .iter()
                    .filter(|u| holds(u))
                    .map(UnitShard::shallow_clone)
                    .collect();
                let full_units: Vec<UnitShard> = full
                    .iter()
                    .flat_map(|u| u.full_shard().map(FullShard::units).unwrap_or_default())
                    .filter(|u| holds(u))
                    .collect();
                let gather_after_step = full_units.is_empty();
                units.extend(full_units);
                if units.is_empty() {
                    return Ok(inner);
                }
                let channel = self.shard_group(group).duplicate()?;
                let sharded = ShardedOptimizer::new(inner, channel, units, gather_after_step)
                    .map_err(ShardingError::Optimizer)?;
                Ok(Box::new(sharded) as Box<dyn Optimizer>)
            })
            .map_err(|e| ShardingError::Unitwise(hearth_ops::error_chain(&e)))?;
        // Training's peak of whole units is counted from here.
        for unitwise in &full {
            unitwise.reset_most_gathered();
        }
        if !full.is_empty() {
            hearth_ops::return_freed_host_memory();
        }
        wrapped
    }

    /// The group sharded models reduce their gradients in: `world`, or the
    /// HYBRID group.
    pub(crate) fn shard_group<'a>(&'a self, world: &'a dyn ProcessGroup) -> &'a dyn ProcessGroup {
        match self.hybrid.get() {
            Some(h) => &h.group,
            None => world,
        }
    }
}

/// FULL_SHARD models' parameters held whole; released when dropped.
pub(crate) struct Summoned {
    units: Vec<Rc<Unitwise>>,
    write_back: bool,
}

impl Summoned {
    /// Releases them after copying this process's rows of the whole
    /// parameters (written meanwhile, by a load) into its shards.
    pub(crate) fn write_back(mut self) {
        self.write_back = true;
    }
}

impl Drop for Summoned {
    fn drop(&mut self) {
        for u in &self.units {
            u.release_all(self.write_back);
        }
    }
}

/// `plan` once every process has the same: each process's units (or its
/// error) are gathered, so that a policy that failed, timed out or chose
/// otherwise on one process stops them all with the same message instead
/// of leaving the others waiting in a collective.
fn agreed(
    group: &dyn ProcessGroup,
    plan: Result<Vec<(String, Vec<String>)>, ShardingError>,
) -> Result<Vec<(String, Vec<String>)>, ShardingError> {
    if group.num_processes() == 1 {
        return plan;
    }
    let mine: Result<&Vec<(String, Vec<String>)>, String> =
        plan.as_ref().map_err(|e| hearth_ops::error_chain(e));
    let bytes = serde_json::to_vec(&mine).expect("a plan serialises");
    let all = group.all_gather_bytes(&bytes)?;
    let me = group.process_index();
    for (rank, theirs) in all.iter().enumerate() {
        if rank == me {
            continue;
        }
        let theirs: Result<Vec<(String, Vec<String>)>, String> = serde_json::from_slice(theirs)
            .map_err(|e| {
                ShardingError::Disagree(format!("rank {rank} sent an unreadable plan: {e}"))
            })?;
        match (&plan, theirs) {
            (Err(_), _) => {}
            (Ok(_), Err(message)) => {
                return Err(ShardingError::Disagree(format!(
                    "on rank {rank}: {message}"
                )))
            }
            (Ok(ours), Ok(theirs)) if *ours != theirs => {
                return Err(ShardingError::Disagree(format!(
                    "rank {rank}'s wrap policy chose other units than rank {me}'s; \
                     every process must load the same policy plugin with the same options"
                )))
            }
            _ => {}
        }
    }
    plan
}

/// `params` whole, one at a time, in an order every process follows (each
/// must ask for the same tensors in the same order: FULL_SHARD's gathers
/// are collectives): the FULL_SHARD unit of the tensor asked for is
/// gathered when it is not the one held, and the one before released
/// (unless training held it), so at most one unit more than training holds
/// is whole. A streamed save fetches the tensors it writes through it.
pub(crate) struct WholeStream<'p> {
    params: &'p [(String, Tensor)],
    units: Vec<(Rc<Unitwise>, Vec<UnitShard>)>,
    /// Each tensor's (unit-wise execution, shard unit, parameter in it).
    owners: Vec<Option<(usize, usize, usize)>>,
    /// The unit whole now, and whether training held it before.
    current: Option<(usize, usize, bool)>,
    /// How many tensors were asked for.
    asked: usize,
}

impl WholeStream<'_> {
    /// Tensor `j` whole (a handle to the model's own, valid until the next
    /// call): gathered with its unit when it is sharded.
    pub(crate) fn get(&mut self, j: usize) -> Result<Tensor, crate::parallel::UnitwiseError> {
        self.asked += 1;
        let Some((w, u, k)) = self.owners[j] else {
            return Ok(self.params[j].1.shallow_clone());
        };
        if self.current.map(|(cw, cu, _)| (cw, cu)) != Some((w, u)) {
            self.release_current();
            let held = self.units[w].0.gather_unit(u)?;
            self.current = Some((w, u, held));
        }
        Ok(self.units[w].1[u].params[k].full.shallow_clone())
    }

    /// Takes part in the gathers of the tensors of `order` not asked for
    /// yet (those after `asked` of them), then releases what it gathered:
    /// what a process that writes nothing, or whose write stopped, does.
    pub(crate) fn finish(mut self, order: &[usize]) -> Result<(), crate::parallel::UnitwiseError> {
        for &j in order.iter().skip(self.asked) {
            let _ = self.get(j)?;
        }
        self.release_current();
        Ok(())
    }

    fn release_current(&mut self) {
        if let Some((w, u, held)) = self.current.take() {
            if !held {
                self.units[w].1[u].release();
            }
        }
    }
}
