//! `PreparedModel`: a model placed on the accelerator's device whose
//! forward pass runs under the configured mixed precision.

use super::TensorTree;
use crate::models::{Model, ModuleTree, Unit};
use crate::ops::AutocastGuard;
use crate::precision::MixedPrecision;
use tch::{Device, Tensor};

/// A model prepared by the accelerator. Its forward pass runs under
/// autocast when mixed precision is on and returns float32 outputs (as
/// Accelerate's `convert_to_fp32` wrapper). Get the model back with
/// [`Accelerator::unwrap_model`](super::Accelerator::unwrap_model).
pub struct PreparedModel<M> {
    inner: M,
    device: Device,
    precision: MixedPrecision,
}

impl<M: Model> PreparedModel<M> {
    pub(super) fn new(inner: M, device: Device, precision: MixedPrecision) -> Self {
        // Parameters not yet on the device move there (in place, so every
        // handle to them, the optimizer's included, sees the move).
        tch::no_grad(|| {
            for (_, mut p) in inner.named_parameters() {
                if p.device() != device {
                    let moved = p.to_device(device);
                    p.set_data(&moved);
                }
            }
        });
        Self {
            inner,
            device,
            precision,
        }
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    pub(super) fn into_inner(self) -> M {
        self.inner
    }

    /// The mixed precision the forward pass runs under.
    pub fn precision(&self) -> MixedPrecision {
        self.precision
    }
}

impl<M: Model> Model for PreparedModel<M> {
    fn module_tree(&self) -> &ModuleTree {
        self.inner.module_tree()
    }
    fn units(&self) -> Vec<&dyn Unit> {
        self.inner.units()
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.inner.named_parameters()
    }
    fn forward_t(&self, tokens: &Tensor, train: bool) -> Tensor {
        match self.precision.autocast_kind(self.device) {
            Some(kind) => {
                let _guard =
                    AutocastGuard::new(self.device, kind).expect("autocast kinds are valid");
                self.inner.forward_t(tokens, train).to_fp32()
            }
            None => self.inner.forward_t(tokens, train),
        }
    }
}
