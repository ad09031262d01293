//! `PreparedModel`: a model placed on the accelerator's device whose
//! forward pass runs under the configured mixed precision.

use super::TensorTree;
use crate::models::{Model, ModuleTree, Unit};
use crate::parallel::{BufferBroadcast, Unitwise, UnitwiseError};
use crate::precision::MixedPrecision;
use hearth_comm::DistError;
use hearth_ops::AutocastGuard;
use std::rc::{Rc, Weak};
use tch::{Device, Tensor};

/// Why a prepared model's forward pass failed: a collective it runs
/// (another process stopped or hangs) or a unit's recomputation setup.
/// [`PreparedModel::try_forward_t`] returns it; `Model::forward_t`, which
/// cannot, panics with it.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Sending rank 0's buffers (DDP's `broadcast_buffers`) failed.
    #[error("broadcasting the model's buffers from rank 0 (broadcast_buffers) failed")]
    BroadcastBuffers(#[source] DistError),
    /// Unit-wise execution (FULL_SHARD's gathers) failed.
    #[error(transparent)]
    Unitwise(#[from] UnitwiseError),
    /// The model's forward pass failed where it returns its error (a
    /// TorchScript model's).
    #[error("the model's forward pass failed: {0}")]
    Torch(tch::TchError),
}

/// A model prepared by the accelerator. Its forward pass runs under
/// autocast when mixed precision is on and returns float32 outputs (as
/// Accelerate's `convert_to_fp32` wrapper). Under FULL_SHARD or
/// activation checkpointing it runs unit by unit ([`Unitwise`]). Get the
/// model back with [`Accelerator::unwrap_model`](super::Accelerator::unwrap_model).
pub struct PreparedModel<M> {
    /// Shared only with the weak handles unit-wise backward recomputes with.
    inner: Rc<M>,
    device: Device,
    precision: MixedPrecision,
    unitwise: Option<Rc<Unitwise>>,
    /// Counted at `prepare`, while every parameter was whole (FULL_SHARD
    /// releases them between uses).
    num_parameters: i64,
    /// Sends rank 0's buffers before each training forward pass (DDP's
    /// `broadcast_buffers`).
    buffer_broadcast: Option<BufferBroadcast>,
}

impl<M: Model> PreparedModel<M> {
    /// `inner`, of `num_parameters` parameters, run on `device`; moved
    /// there first when `place` (`device_placement`).
    pub(super) fn new(
        inner: M,
        num_parameters: i64,
        device: Device,
        place: bool,
        precision: MixedPrecision,
    ) -> Self {
        // Parameters and buffers not yet on the device move there (in place, so every
        // handle to them, the optimizer's included, sees the move; those
        // FULL_SHARD released on the device already are empty there).
        tch::no_grad(|| {
            for (_, mut p) in inner.named_state() {
                if place && p.device() != device {
                    let moved = p.to_device(device);
                    p.set_data(&moved);
                }
            }
        });
        Self {
            num_parameters,
            inner: Rc::new(inner),
            device,
            precision,
            unitwise: None,
            buffer_broadcast: None,
        }
    }

    /// Sends rank 0's buffers with `broadcast` before each training
    /// forward pass from now on.
    pub(super) fn set_buffer_broadcast(&mut self, broadcast: Option<BufferBroadcast>) {
        self.buffer_broadcast = broadcast;
    }

    /// Runs the forward pass unit by unit from now on.
    pub(super) fn set_unitwise(&mut self, unitwise: Rc<Unitwise>) {
        self.unitwise = Some(unitwise);
    }

    /// Its unit-wise execution, if it runs so.
    pub(super) fn unitwise(&self) -> Option<&Rc<Unitwise>> {
        self.unitwise.as_ref()
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The model (its parameters whole: the caller gathered them first
    /// under FULL_SHARD).
    pub(super) fn into_inner(self) -> M {
        Rc::try_unwrap(self.inner)
            .ok()
            .expect("unit-wise execution holds weak handles only")
    }

    /// The mixed precision the forward pass runs under.
    pub fn precision(&self) -> MixedPrecision {
        self.precision
    }
}

impl<M: Model + 'static> PreparedModel<M> {
    fn run(&self, tokens: &Tensor, train: bool) -> Result<Tensor, ForwardError> {
        if let (true, Some(broadcast)) = (train, &self.buffer_broadcast) {
            broadcast.run().map_err(ForwardError::BroadcastBuffers)?;
        }
        let Some(unitwise) = &self.unitwise else {
            return self
                .inner
                .try_forward_t(tokens, train)
                .map_err(ForwardError::Torch);
        };
        let handle: Weak<dyn Model> = Rc::downgrade(&self.inner) as Weak<dyn Model>;
        let autocast = self
            .precision
            .autocast_kind(self.device)
            .map(|k| (self.device, k));
        Ok(unitwise.forward(&*self.inner, handle, tokens, train, autocast)?)
    }

    /// The forward pass under autocast, with its outputs left in the
    /// precision autocast gave them (no `convert_to_fp32`): for a loss that
    /// upcasts inside its own kernel, as [`crate::train::lm_loss`] does on
    /// a GPU, sparing a float32 copy of the logits and its gradient.
    /// Panics where [`try_forward_t_unconverted`](Self::try_forward_t_unconverted)
    /// returns an error.
    pub fn forward_t_unconverted(&self, tokens: &Tensor, train: bool) -> Tensor {
        self.try_forward_t_unconverted(tokens, train)
            .unwrap_or_else(|e| panic!("{}", hearth_ops::error_chain(&e)))
    }

    /// [`forward_t_unconverted`](Self::forward_t_unconverted), with a
    /// failed collective (under FULL_SHARD, or DDP's `broadcast_buffers`)
    /// returned as an error instead of a panic.
    pub fn try_forward_t_unconverted(
        &self,
        tokens: &Tensor,
        train: bool,
    ) -> Result<Tensor, ForwardError> {
        match self.precision.autocast_kind(self.device) {
            Some(kind) => {
                let _guard =
                    AutocastGuard::new(self.device, kind).expect("autocast kinds are valid");
                self.run(tokens, train)
            }
            None => self.run(tokens, train),
        }
    }

    /// The forward pass (`Model::forward_t`: float32 outputs under mixed
    /// precision), with a failed collective (under FULL_SHARD, or DDP's
    /// `broadcast_buffers`) returned as an error: `Model::forward_t`
    /// cannot return one, so it panics with it.
    pub fn try_forward_t(&self, tokens: &Tensor, train: bool) -> Result<Tensor, ForwardError> {
        let out = self.try_forward_t_unconverted(tokens, train)?;
        Ok(match self.precision.autocast_kind(self.device) {
            Some(_) => out.to_fp32(),
            None => out,
        })
    }
}

impl<M: Model + 'static> Model for PreparedModel<M> {
    fn module_tree(&self) -> &ModuleTree {
        self.inner.module_tree()
    }
    fn units(&self) -> Vec<&dyn Unit> {
        self.inner.units()
    }
    fn cut_at(&self, units: &[String]) -> Result<(), String> {
        self.inner.cut_at(units)
    }
    fn materialize(&self, names: Option<&[String]>) -> Result<(), String> {
        self.inner.materialize(names)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.inner.named_parameters()
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.inner.named_buffers()
    }
    fn num_parameters(&self) -> i64 {
        self.num_parameters
    }
    /// Panics where [`PreparedModel::try_forward_t`] returns an error.
    fn forward_t(&self, tokens: &Tensor, train: bool) -> Tensor {
        self.try_forward_t(tokens, train)
            .unwrap_or_else(|e| panic!("{}", hearth_ops::error_chain(&e)))
    }
}

impl super::Accelerator {
    /// Whether `model` was dispatched over a device map of more than one
    /// entry (Accelerate's `verify_device_map`, which looks for an
    /// `hf_device_map` of more than one entry). Such a model is for
    /// inference: a `DispatchedModel` cannot be prepared for training, so
    /// Accelerate's refusal to train it on several processes holds by type.
    pub fn verify_device_map(&self, model: &crate::big_model::DispatchedModel) -> bool {
        model.hf_device_map().len() > 1
    }
}
