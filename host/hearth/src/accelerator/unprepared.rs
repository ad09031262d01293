//! Catching what was left out of `prepare` before it wastes a run. An
//! optimizer the accelerator was not given steps on every micro-batch
//! (accumulation silently off), its scheduler sets nothing, and checkpoints
//! miss its state; a model it was not given on several processes has its
//! gradients never averaged, so the processes' copies drift apart. Both
//! train without an error, and wrongly. The first synchronising backward
//! pass checks once (`AcceleratorBuilder::check_prepared(false)` turns it
//! off).

use super::{lock, Accelerator, BackwardError};
use crate::parallel::data_parallel::names_list;
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use tch::Tensor;

/// What the check needs: the trained models' parameters, as prepared.
pub(super) struct PreparedCheck {
    on: bool,
    done: Cell<bool>,
    models: RefCell<Vec<TrainedModel>>,
}

struct TrainedModel {
    parameters: Vec<(String, Tensor)>,
    /// FSDP replaced its parameters with shards that only optimizers
    /// prepared after it hold.
    sharded: bool,
}

impl PreparedCheck {
    pub(super) fn new(on: bool) -> Self {
        Self {
            on,
            done: Cell::new(false),
            models: RefCell::new(Vec::new()),
        }
    }

    /// Notes a model prepared for training (not for evaluation). Handles
    /// to its parameters are kept only while the check is still to come,
    /// and not for a sharded model, whose check needs none.
    pub(super) fn note_model(&self, parameters: &[(String, Tensor)], sharded: bool) {
        if !self.on || self.done.get() {
            return;
        }
        let parameters = match sharded {
            true => Vec::new(),
            false => (parameters.iter())
                .map(|(n, p)| (n.clone(), p.shallow_clone()))
                .collect(),
        };
        self.models.borrow_mut().push(TrainedModel {
            parameters,
            sharded,
        });
    }
}

/// Where a tensor's elements live: the same parameter has the same one
/// wherever it is held (`None` for an empty tensor, which has none).
fn place(t: &Tensor) -> Option<usize> {
    (t.numel() > 0).then(|| t.data_ptr() as usize)
}

const PREPARE_BOTH: &str =
    "pass the model and its optimizer to the same `acc.prepare((model, optimizer, ...))`";

impl Accelerator {
    /// Once, on the first backward pass that synchronises: refuses a step
    /// that would silently do less than asked.
    pub(super) fn check_prepared(&self) -> Result<(), BackwardError> {
        let check = &self.unprepared;
        if !check.on || check.done.get() || !self.sync_gradients() {
            return Ok(());
        }
        check.done.set(true);
        let checked = self
            .check_optimizers_prepared()
            .and_then(|()| self.check_models_prepared());
        check.models.borrow_mut().clear();
        checked
    }

    /// Every trainable parameter of a prepared model is in a prepared
    /// optimizer, and every prepared scheduler has one, when accumulation
    /// or a schedule depends on it.
    fn check_optimizers_prepared(&self) -> Result<(), BackwardError> {
        let steps = self.state.num_steps();
        let schedulers = &self.registered.schedulers;
        if steps == 1 && schedulers.is_empty() {
            return Ok(());
        }
        if schedulers.iter().any(|s| !lock(s).is_bound()) {
            return Err(BackwardError::Unprepared {
                problem: "a prepared scheduler is bound to no optimizer, so the learning rate it \
                          computes reaches nothing"
                    .into(),
                fix: "prepare the optimizer before the scheduler, or in the same `prepare` call"
                    .into(),
            });
        }
        let held: HashSet<usize> = self.optimized().iter().filter_map(place).collect();
        let models = self.unprepared.models.borrow();
        let left_out: Vec<String> = if models.iter().any(|m| m.sharded) {
            // Sharded parameters are held only as the shards an optimizer
            // prepared after the model steps: any prepared optimizer will do.
            match self.optimizers.is_empty() {
                true => vec!["(a sharded model's parameters)".into()],
                false => Vec::new(),
            }
        } else {
            models
                .iter()
                .flat_map(|m| &m.parameters)
                .filter(|(_, p)| p.requires_grad())
                .filter(|(_, p)| place(p).is_some_and(|at| !held.contains(&at)))
                .map(|(name, _)| name.clone())
                .collect()
        };
        if left_out.is_empty() {
            return Ok(());
        }
        let because = match steps {
            1 => "a scheduler is prepared".to_string(),
            n => format!("gradient_accumulation_steps is {n}"),
        };
        Err(BackwardError::Unprepared {
            problem: format!(
                "{} of a prepared model {} in no prepared optimizer, and {because}: an optimizer \
                 left out of `prepare` steps on every micro-batch instead of once per \
                 accumulation group, no prepared scheduler changes its learning rate, and \
                 checkpoints hold none of its state",
                names_list(&left_out),
                if left_out.len() == 1 { "is" } else { "are" },
            ),
            fix: PREPARE_BOTH.into(),
        })
    }

    /// On several processes, every parameter a prepared optimizer steps
    /// belongs to a prepared model, so that its gradients are averaged.
    fn check_models_prepared(&self) -> Result<(), BackwardError> {
        let models = self.unprepared.models.borrow();
        if self.num_processes() < 2 || models.iter().any(|m| m.sharded) {
            return Ok(());
        }
        let synced: HashSet<usize> = models
            .iter()
            .flat_map(|m| &m.parameters)
            .filter_map(|(_, p)| place(p))
            .collect();
        let stray = self
            .optimized()
            .iter()
            .filter(|p| p.requires_grad())
            .filter(|p| place(p).is_some_and(|at| !synced.contains(&at)))
            .map(|p| format!("{:?}", p.size()))
            .collect::<Vec<_>>();
        if stray.is_empty() {
            return Ok(());
        }
        Err(BackwardError::Unprepared {
            problem: format!(
                "a prepared optimizer steps {} parameter{} (of shape {}) that belong to no \
                 prepared model: on these {} processes their gradients are never averaged, so \
                 each process's copy drifts apart from the others",
                stray.len(),
                if stray.len() == 1 { "" } else { "s" },
                stray.iter().take(4).cloned().collect::<Vec<_>>().join(", "),
                self.num_processes(),
            ),
            fix: format!("{PREPARE_BOTH} (a tch model: its VarStore)"),
        })
    }

    /// Every parameter the prepared optimizers step.
    fn optimized(&self) -> Vec<Tensor> {
        self.optimizers
            .iter()
            .flat_map(|o| lock(o).inner.parameters())
            .collect()
    }
}
