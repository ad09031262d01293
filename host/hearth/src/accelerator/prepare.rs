//! `Prepare`: what `Accelerator::prepare` accepts — models, optimizers,
//! data loaders and schedulers, alone or in tuples, in any order.

use super::{
    AcceleratedOptimizer, AcceleratedScheduler, Accelerator, LrSchedule, PreparedDataLoader,
    PreparedModel, TensorTree,
};
use crate::data::{BatchSource, DataLoader};
use crate::models::{Gpt, Mlp, Model, TorchScriptModel};
use crate::optim::{Adam, Optimizer, Sgd};
use hearth_plugins::{PluginError, SchedulerPlugin};

/// Why `prepare` failed.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// A scheduler could not give its first rates.
    #[error("the scheduler failed while being prepared")]
    Scheduler(#[source] PluginError),
    /// `split_batches` with a batch size the processes cannot share evenly.
    #[error("split_batches: the loader's batch size {batch_size} does not divide by the {processes} processes; use a multiple of {processes} or turn split_batches off")]
    SplitBatches {
        /// The loader's batch size.
        batch_size: usize,
        /// The number of processes.
        processes: usize,
    },
    /// The processes could not agree on the model's starting parameters.
    #[error("making every process start from rank 0's parameters failed")]
    Dist(#[source] hearth_comm::DistError),
    /// The model could not be sharded (the wrap policy, the units, the
    /// optimizer).
    #[error("preparing the model for sharding failed")]
    Sharding(#[source] super::ShardingError),
    /// The model's weights could not be read (a model loaded lazily).
    #[error("reading the model's weights failed: {0}")]
    Weights(String),
    /// A dispatching loader could not open its channel between processes.
    #[error("dispatch_batches: the processes could not open the loader's channel")]
    Dispatch(#[source] hearth_comm::DistError),
}

/// Something [`Accelerator::prepare`] can wrap. Preparing what is already
/// prepared returns it unchanged, so preparing twice is harmless.
pub trait Prepare: Sized {
    /// What preparing gives back.
    type Prepared;
    /// Schedulers are prepared after everything else in the same call, so
    /// they bind to an optimizer given beside them.
    const AFTER_OPTIMIZERS: bool = false;
    /// Prepares `self` for `acc`.
    fn prepare_with(self, acc: &mut Accelerator) -> Result<Self::Prepared, PrepareError>;
}

macro_rules! optimizer {
    ($($t:ty),*) => {$(
        impl Prepare for $t {
            type Prepared = AcceleratedOptimizer;
            fn prepare_with(self, acc: &mut Accelerator) -> Result<AcceleratedOptimizer, PrepareError> {
                acc.wrap_optimizer(Box::new(self))
            }
        }
    )*};
}
optimizer!(Adam, Sgd);

impl Prepare for Box<dyn Optimizer> {
    type Prepared = AcceleratedOptimizer;
    fn prepare_with(self, acc: &mut Accelerator) -> Result<AcceleratedOptimizer, PrepareError> {
        acc.wrap_optimizer(self)
    }
}

impl Prepare for AcceleratedOptimizer {
    type Prepared = AcceleratedOptimizer;
    fn prepare_with(self, acc: &mut Accelerator) -> Result<AcceleratedOptimizer, PrepareError> {
        acc.remember_optimizer(&self);
        Ok(self)
    }
}

macro_rules! model {
    ($($t:ty),*) => {$(
        impl Prepare for $t {
            type Prepared = PreparedModel<$t>;
            fn prepare_with(self, acc: &mut Accelerator) -> Result<PreparedModel<$t>, PrepareError> {
                prepare_model(self, acc)
            }
        }
    )*};
}

/// Places `model` on the accelerator's device and registers it for
/// gradient averaging or sharding. A model that FULL_SHARD shards, or whose
/// shards cpu-offload keeps in host memory, is sharded where it is first
/// (unit by unit, each unit's shard then moved), so that the device never
/// holds the whole model; any other is moved first, then registered.
fn prepare_model<M: Model + 'static>(
    model: M,
    acc: &mut Accelerator,
) -> Result<PreparedModel<M>, PrepareError> {
    prepare_model_as(model, acc, false)
}

/// The device `model` runs on once prepared: the accelerator's, or with
/// `device_placement` off (the model is not moved) its first parameter's.
fn placement<M: Model>(acc: &Accelerator, model: &M) -> tch::Device {
    let here = || model.named_parameters().first().map(|(_, p)| p.device());
    match acc.device_placement {
        true => acc.device(),
        false => here().unwrap_or(acc.device()),
    }
}

/// [`prepare_model`], or with `evaluation` only placed on the device,
/// run under the mixed precision and remembered for checkpoints: neither
/// made data-parallel nor sharded (Accelerate's `evaluation_mode`).
pub(super) fn prepare_model_as<M: Model + 'static>(
    model: M,
    acc: &mut Accelerator,
    evaluation: bool,
) -> Result<PreparedModel<M>, PrepareError> {
    let count = model.num_parameters();
    let (device, place, precision) = (
        placement(acc, &model),
        acc.device_placement,
        acc.mixed_precision(),
    );
    let wrap = move |model: M| PreparedModel::new(model, count, device, place, precision);
    let shard_first = acc.shards_before_placing() && !evaluation;
    if !shard_first {
        // Read whole before it is placed and registered; a model sharded
        // first is read one unit at a time, as it is sharded.
        model.materialize(None).map_err(PrepareError::Weights)?;
    }
    if evaluation {
        let prepared = wrap(model);
        let buffers = prepared.inner().named_buffers();
        let buffer_names = buffers.iter().map(|(n, _)| n.clone()).collect();
        let state = prepared
            .inner()
            .named_parameters()
            .into_iter()
            .chain(buffers);
        acc.remember_model(state.collect(), buffer_names, Vec::new());
        return Ok(prepared);
    }
    let register = |acc: &mut Accelerator, model: &M| {
        let parameters = model.named_parameters();
        let handles = parameters
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .collect();
        let read = |names: &[String]| model.materialize(Some(names));
        let sharding = acc.register_for_sync(model.module_tree(), handles, true, &read)?;
        // What no unit read (buffers, a model that was not sharded).
        model.materialize(None).map_err(PrepareError::Weights)?;
        Ok((parameters, sharding))
    };
    let (mut prepared, (parameters, sharding)) = if shard_first {
        let registered = register(acc, &model)?;
        (wrap(model), registered)
    } else {
        let prepared = wrap(model);
        let registered = register(acc, prepared.inner())?;
        (prepared, registered)
    };
    if let Some(units) = &sharding.cut_at {
        prepared
            .inner()
            .cut_at(units)
            .map_err(|why| PrepareError::Sharding(super::ShardingError::Cut(why)))?;
    }
    if let Some(unitwise) = sharding.unitwise {
        prepared.set_unitwise(unitwise);
    }
    let buffers = prepared.inner().named_buffers();
    let handles = buffers.iter().map(|(_, b)| b.shallow_clone()).collect();
    prepared.set_buffer_broadcast(acc.register_buffers(handles)?);
    // Checkpoints hold the buffers too (PyTorch's state_dict).
    let buffer_names = buffers.iter().map(|(n, _)| n.clone()).collect();
    acc.remember_trained_model(
        parameters.into_iter().chain(buffers).collect(),
        buffer_names,
        sharding.units,
    );
    Ok(prepared)
}

model!(Gpt, Mlp, TorchScriptModel, Box<dyn Model>);

/// A custom model's variables: moved to the accelerator's device. Run its
/// forward pass inside [`Accelerator::autocast`] for mixed precision. Its
/// module tree (for a wrap policy) is inferred from the variable names,
/// every module of class `Module`; declare classes with
/// [`VarStoreModel`](crate::models::VarStoreModel).
impl Prepare for tch::nn::VarStore {
    type Prepared = tch::nn::VarStore;
    fn prepare_with(self, acc: &mut Accelerator) -> Result<Self, PrepareError> {
        crate::models::VarStoreModel::new(self).prepare_with(acc)
    }
}

/// A custom model's variables with its modules' classes declared.
impl Prepare for crate::models::VarStoreModel {
    type Prepared = tch::nn::VarStore;
    fn prepare_with(mut self, acc: &mut Accelerator) -> Result<tch::nn::VarStore, PrepareError> {
        if acc.device_placement {
            self.vs.set_device(acc.device());
        }
        let variables = crate::models::sorted_variables(&self.vs);
        let handles = variables
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .collect();
        let sharding = acc.register_for_sync(&self.module_tree(), handles, false, &|_| Ok(()))?;
        // Variables made not to train (`zeros_no_train`: BatchNorm's
        // running statistics) are state, checkpointed as buffers are;
        // trainable ones a user froze are not.
        let trainable: std::collections::HashSet<usize> = self
            .vs
            .trainable_variables()
            .iter()
            .map(|t| t.data_ptr() as usize)
            .collect();
        let state = variables
            .iter()
            .filter(|(_, t)| !trainable.contains(&(t.data_ptr() as usize)))
            .map(|(n, _)| n.clone())
            .collect();
        acc.remember_trained_model(variables, state, sharding.units);
        Ok(self.vs)
    }
}

impl<M: Model + 'static> Prepare for PreparedModel<M> {
    type Prepared = PreparedModel<M>;
    fn prepare_with(self, _: &mut Accelerator) -> Result<Self, PrepareError> {
        Ok(self)
    }
}

impl<S: BatchSource> Prepare for DataLoader<S>
where
    S::Item: TensorTree,
{
    type Prepared = PreparedDataLoader<S>;
    fn prepare_with(self, acc: &mut Accelerator) -> Result<PreparedDataLoader<S>, PrepareError> {
        let shard = acc.shard();
        let batch_size = self.options().batch_size;
        if shard.split_batches && shard.num_processes > 1 && batch_size % shard.num_processes != 0 {
            return Err(PrepareError::SplitBatches {
                batch_size,
                processes: shard.num_processes,
            });
        }
        // Dispatching: the main process reads whole batches of its own.
        let dispatch = if acc.dispatch_batches && shard.num_processes > 1 {
            Some(acc.group.duplicate().map_err(PrepareError::Dispatch)?)
        } else {
            None
        };
        let loader = if dispatch.is_some() {
            self.sharded(crate::data::Shard {
                process_index: 0,
                num_processes: 1,
                ..shard
            })
        } else {
            self.sharded(shard)
        };
        acc.remember_loader(loader.handle());
        Ok(PreparedDataLoader::new(
            loader,
            acc.gradient_state().clone(),
            acc.device_placement.then(|| acc.device()),
            acc.non_blocking,
            dispatch,
        ))
    }
}

impl<S: BatchSource> Prepare for PreparedDataLoader<S>
where
    S::Item: TensorTree,
{
    type Prepared = PreparedDataLoader<S>;
    fn prepare_with(self, _: &mut Accelerator) -> Result<Self, PrepareError> {
        Ok(self)
    }
}

impl Prepare for SchedulerPlugin {
    type Prepared = AcceleratedScheduler;
    const AFTER_OPTIMIZERS: bool = true;
    fn prepare_with(self, acc: &mut Accelerator) -> Result<AcceleratedScheduler, PrepareError> {
        acc.wrap_scheduler(Box::new(self))
    }
}

impl Prepare for Box<dyn LrSchedule> {
    type Prepared = AcceleratedScheduler;
    const AFTER_OPTIMIZERS: bool = true;
    fn prepare_with(self, acc: &mut Accelerator) -> Result<AcceleratedScheduler, PrepareError> {
        acc.wrap_scheduler(self)
    }
}

impl Prepare for AcceleratedScheduler {
    type Prepared = AcceleratedScheduler;
    fn prepare_with(self, _: &mut Accelerator) -> Result<Self, PrepareError> {
        Ok(self)
    }
}

/// An element of a tuple between the two passes.
enum Stage<T: Prepare> {
    Done(T::Prepared),
    Later(T),
}

fn first<T: Prepare>(x: T, acc: &mut Accelerator) -> Result<Stage<T>, PrepareError> {
    Ok(if T::AFTER_OPTIMIZERS {
        Stage::Later(x)
    } else {
        Stage::Done(x.prepare_with(acc)?)
    })
}

fn second<T: Prepare>(s: Stage<T>, acc: &mut Accelerator) -> Result<T::Prepared, PrepareError> {
    match s {
        Stage::Done(p) => Ok(p),
        Stage::Later(x) => x.prepare_with(acc),
    }
}

macro_rules! tuple {
    ($($name:ident),+) => {
        impl<$($name: Prepare),+> Prepare for ($($name,)+) {
            type Prepared = ($($name::Prepared,)+);
            #[allow(non_snake_case)]
            fn prepare_with(self, acc: &mut Accelerator) -> Result<Self::Prepared, PrepareError> {
                let ($($name,)+) = self;
                $(let $name = first($name, acc)?;)+
                Ok(($(second($name, acc)?,)+))
            }
        }
    };
}
tuple!(A);
tuple!(A, B);
tuple!(A, B, C);
tuple!(A, B, C, D);
tuple!(A, B, C, D, E);
tuple!(A, B, C, D, E, F);
