//! Unit-wise execution's forward and backward passes.

use super::execution::{backward_from, grad_enabled, leaves, Tape};
use super::{Unitwise, UnitwiseError};
use crate::models::Model;
use crate::parallel::fsdp::BackwardPrefetch;
use hearth_ops::AutocastGuard;
use std::rc::Weak;
use tch::{Device, Kind, Tensor};

impl Unitwise {
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
        // Units stay whole from forward to backward (reshard_after_forward = false).
        let hold = record
            && !self
                .full_shard
                .as_ref()
                .is_some_and(|f| f.reshard_after_forward);
        let keep_graphs = record && !self.recompute;
        let mut x = vec![tokens.shallow_clone()];
        let (mut inputs, mut outputs, mut rng) = (Vec::new(), Vec::new(), Vec::new());
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
            let torch = |error| UnitwiseError::Torch { unit: k, error };
            if keep_graphs {
                let leaves = leaves(&x);
                x = unit.forward_all(&leaves, train).map_err(torch)?;
                inputs.push(leaves);
                outputs.push(x.iter().map(Tensor::shallow_clone).collect());
            } else if record {
                inputs.push(x.iter().map(Tensor::shallow_clone).collect());
                rng.push(hearth_ops::rng_state(device).map_err(torch)?);
                x = tch::no_grad(|| unit.forward_all(&x, train)).map_err(torch)?;
            } else {
                x = unit.forward_all(&x, train).map_err(torch)?;
            }
            if !hold {
                self.release_after(uses, k, &ends, keep_graphs);
            }
        }
        let x = match <[Tensor; 1]>::try_from(x) {
            Ok([x]) => x,
            Err(x) => {
                return Err(UnitwiseError::Torch {
                    unit: units.len().saturating_sub(1),
                    error: tch::TchError::Torch(format!(
                        "the last unit gave {} tensors, not the model's one output",
                        x.len()
                    )),
                })
            }
        };
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
            outputs,
            rng,
            output: output.shallow_clone(),
            train,
            autocast,
        });
        Ok(output)
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
        for mut tape in tapes.into_iter().rev() {
            let Some(model) = tape.model.upgrade() else {
                continue;
            };
            let mut grads = vec![tape.output.grad()];
            if !grads[0].defined() {
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
                let torch = |error| UnitwiseError::Torch { unit: k, error };
                let inputs = std::mem::take(&mut tape.inputs[k]);
                let (inputs, outputs) = match tape.outputs.get_mut(k) {
                    Some(kept) => (inputs, std::mem::take(kept)),
                    None => self.recompute(units[k], &tape, k, inputs)?,
                };
                backward_from(&outputs, &grads).map_err(torch)?;
                drop(outputs);
                if let (BackwardPrefetch::BackwardPost, Some(before)) =
                    (prefetch.backward, previous(k))
                {
                    self.prefetch(before, &mut ahead)?;
                }
                if k > 0 {
                    grads = inputs
                        .iter()
                        .map(|input| match (input.requires_grad(), input.grad()) {
                            (true, grad) if grad.defined() => grad,
                            // As one backward pass would: zeros, not none.
                            (true, _) => input.zeros_like(),
                            (false, _) => Tensor::new(),
                        })
                        .collect();
                }
                self.reduce_and_release(uses, k)?;
            }
        }
        Ok(())
    }

    /// Runs model unit `k` of `tape`'s forward pass again on its `inputs`,
    /// with a graph from new leaves, the generator as it was then: the
    /// leaves and the outputs.
    fn recompute(
        &self,
        unit: &dyn crate::models::Unit,
        tape: &Tape,
        k: usize,
        inputs: Vec<Tensor>,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>), UnitwiseError> {
        let torch = |error| UnitwiseError::Torch { unit: k, error };
        let inputs = leaves(&inputs);
        let device = inputs[0].device();
        let now = hearth_ops::rng_state(device).map_err(torch)?;
        hearth_ops::set_rng_state(device, &tape.rng[k]).map_err(torch)?;
        let outputs = tch::with_grad(|| {
            let _guard = tape
                .autocast
                .map(|(d, kind)| AutocastGuard::new(d, kind).expect("autocast kinds are valid"));
            unit.forward_all(&inputs, tape.train)
        });
        hearth_ops::set_rng_state(device, &now).map_err(torch)?;
        let outputs = outputs.map_err(torch)?;
        self.count(|s| s.recomputed += 1);
        Ok((inputs, outputs))
    }
}
