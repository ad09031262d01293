//! `[optimizer]`: AdamW, Adam or SGD, weight decay (and which parameters
//! are exempt from it) and gradient clipping.

use super::{only_for, ConfigError, Invalid};
use serde::Deserialize;

/// Which optimizer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    /// AdamW with decoupled weight decay (default).
    #[default]
    Adamw,
    /// Adam with L2 weight decay added to the gradient.
    Adam,
    /// SGD with optional momentum and Nesterov.
    Sgd,
}

/// The `[optimizer]` section. Defaults are PyTorch's for the chosen kind.
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct OptimizerSection {
    /// `adamw` (default), `adam` or `sgd`.
    #[serde(default)]
    pub kind: OptimizerKind,
    /// Learning rate (default 1e-3).
    pub lr: Option<f64>,
    /// Weight decay (default 0.01 for AdamW, 0 for Adam and SGD).
    pub weight_decay: Option<f64>,
    /// Parameters whose name contains one of these strings go in a second
    /// parameter group without weight decay (e.g. `["bias", "ln"]`).
    #[serde(default)]
    pub no_decay: Vec<String>,
    /// AdamW: `[beta1, beta2]` (default `[0.9, 0.999]`).
    pub betas: Option<[f64; 2]>,
    /// AdamW: denominator term (default 1e-8).
    pub eps: Option<f64>,
    /// SGD: momentum (default 0).
    pub momentum: Option<f64>,
    /// SGD: dampening (default 0).
    pub dampening: Option<f64>,
    /// SGD: Nesterov momentum (default false).
    pub nesterov: Option<bool>,
    /// Clip the gradients' total L2 norm to this value (default: no clipping).
    pub max_grad_norm: Option<f64>,
}

impl OptimizerSection {
    /// The learning rate.
    pub fn lr(&self) -> f64 {
        self.lr.unwrap_or(1e-3)
    }
    /// The weight decay for the chosen kind.
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay.unwrap_or(match self.kind {
            OptimizerKind::Adamw => 0.01,
            OptimizerKind::Adam | OptimizerKind::Sgd => 0.0,
        })
    }
    /// Splits named parameters into the groups `no_decay` describes: the
    /// rest first, then (when any matched) those without weight decay.
    pub fn param_groups(&self, named: Vec<(String, tch::Tensor)>) -> Vec<crate::optim::ParamGroup> {
        let exempt: Vec<&str> = self.no_decay.iter().map(String::as_str).collect();
        crate::optim::no_decay_groups(named, &exempt)
    }
    /// AdamW betas.
    pub fn betas(&self) -> (f64, f64) {
        let [b1, b2] = self.betas.unwrap_or([0.9, 0.999]);
        (b1, b2)
    }
    /// AdamW eps.
    pub fn eps(&self) -> f64 {
        self.eps.unwrap_or(1e-8)
    }

    pub(super) fn validate(&self, invalid: &Invalid) -> Result<(), ConfigError> {
        if !(self.lr() > 0.0 && self.lr().is_finite()) {
            return Err(invalid(
                "optimizer.lr",
                format!("must be a positive number, got {}", self.lr()),
            ));
        }
        if self.weight_decay().is_nan() || self.weight_decay() < 0.0 {
            return Err(invalid(
                "optimizer.weight-decay",
                "must not be negative".into(),
            ));
        }
        if let Some(max) = self.max_grad_norm {
            if max.is_nan() || max <= 0.0 {
                return Err(invalid(
                    "optimizer.max-grad-norm",
                    format!("must be positive, got {max}"),
                ));
            }
        }
        match self.kind {
            OptimizerKind::Adamw | OptimizerKind::Adam => {
                only_for(&self.momentum, "optimizer.momentum", "\"sgd\"", invalid)?;
                only_for(&self.dampening, "optimizer.dampening", "\"sgd\"", invalid)?;
                only_for(&self.nesterov, "optimizer.nesterov", "\"sgd\"", invalid)?;
                let (b1, b2) = self.betas();
                if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
                    return Err(invalid(
                        "optimizer.betas",
                        format!("must lie in [0, 1), got [{b1}, {b2}]"),
                    ));
                }
            }
            OptimizerKind::Sgd => {
                only_for(
                    &self.betas,
                    "optimizer.betas",
                    "\"adamw\" or \"adam\"",
                    invalid,
                )?;
                only_for(&self.eps, "optimizer.eps", "\"adamw\" or \"adam\"", invalid)?;
                let momentum = self.momentum.unwrap_or(0.0);
                if self.nesterov == Some(true)
                    && (momentum <= 0.0 || self.dampening.unwrap_or(0.0) != 0.0)
                {
                    return Err(invalid(
                        "optimizer.nesterov",
                        "needs a positive momentum and zero dampening (as in PyTorch)".into(),
                    ));
                }
            }
        }
        Ok(())
    }
}
