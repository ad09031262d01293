//! `reduce-on-plateau`: PyTorch's `ReduceLROnPlateau`, driven by `observe`.

use crate::options::Options;
use serde_json::json;

/// Its settings and its state.
pub struct Plateau {
    maximize: bool,
    relative: bool,
    factor: f64,
    patience: u64,
    threshold: f64,
    cooldown: u64,
    min_lrs: Vec<f64>,
    eps: f64,
    // State (saved and loaded).
    lrs: Vec<f64>,
    best: f64,
    bad: u64,
    cooldown_left: u64,
}

pub const OPTIONS: &[&str] = &[
    "mode",
    "factor",
    "patience",
    "threshold",
    "threshold-mode",
    "cooldown",
    "min-lr",
    "eps",
];

impl Plateau {
    pub fn new(o: &mut Options, base: &[f64]) -> Result<Self, String> {
        let maximize = match o.string("mode")?.as_deref() {
            None | Some("min") => false,
            Some("max") => true,
            Some(other) => {
                return Err(format!(
                    "`mode` must be \"min\" or \"max\", not \"{other}\""
                ))
            }
        };
        let relative = match o.string("threshold-mode")?.as_deref() {
            None | Some("rel") => true,
            Some("abs") => false,
            Some(other) => {
                return Err(format!(
                    "`threshold-mode` must be \"rel\" or \"abs\", not \"{other}\""
                ))
            }
        };
        let factor = o.number("factor")?.unwrap_or(0.1);
        if !(0.0..1.0).contains(&factor) {
            return Err(format!("`factor` must be in [0, 1), not {factor}"));
        }
        Ok(Self {
            maximize,
            relative,
            factor,
            patience: o.count("patience")?.unwrap_or(10),
            threshold: o.number("threshold")?.unwrap_or(1e-4),
            cooldown: o.count("cooldown")?.unwrap_or(0),
            min_lrs: o
                .numbers("min-lr", base.len())?
                .unwrap_or(vec![0.0; base.len()]),
            eps: o.number("eps")?.unwrap_or(1e-8),
            lrs: base.to_vec(),
            best: if maximize {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            },
            bad: 0,
            cooldown_left: 0,
        })
    }

    pub fn lrs(&self) -> Vec<f64> {
        self.lrs.clone()
    }

    fn is_better(&self, a: f64) -> bool {
        match (self.maximize, self.relative) {
            (false, true) => a < self.best * (1.0 - self.threshold),
            (false, false) => a < self.best - self.threshold,
            (true, true) => a > self.best * (self.threshold + 1.0),
            (true, false) => a > self.best + self.threshold,
        }
    }

    pub fn observe(&mut self, metric: f64) {
        if self.is_better(metric) {
            self.best = metric;
            self.bad = 0;
        } else {
            self.bad += 1;
        }
        if self.cooldown_left > 0 {
            self.cooldown_left -= 1;
            self.bad = 0;
        }
        if self.bad > self.patience {
            for (lr, min) in self.lrs.iter_mut().zip(&self.min_lrs) {
                let new = (*lr * self.factor).max(*min);
                if *lr - new > self.eps {
                    *lr = new;
                }
            }
            self.cooldown_left = self.cooldown;
            self.bad = 0;
        }
    }

    pub fn save(&self) -> Vec<u8> {
        // ±inf is not JSON: an untouched `best` is saved as null.
        let best = self.best.is_finite().then_some(self.best);
        json!({"lrs": self.lrs, "best": best, "bad": self.bad, "cooldown-left": self.cooldown_left})
            .to_string()
            .into_bytes()
    }

    pub fn load(&mut self, state: &[u8]) -> Result<(), String> {
        let v: serde_json::Value =
            serde_json::from_slice(state).map_err(|e| format!("state is not JSON: {e}"))?;
        let lrs: Option<Vec<f64>> = v["lrs"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect());
        let lrs = lrs
            .filter(|l| l.len() == self.lrs.len())
            .ok_or("state has no `lrs` for every group")?;
        self.lrs = lrs;
        self.best = v["best"].as_f64().unwrap_or(if self.maximize {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        });
        self.bad = v["bad"].as_u64().ok_or("state has no `bad`")?;
        self.cooldown_left = v["cooldown-left"]
            .as_u64()
            .ok_or("state has no `cooldown-left`")?;
        Ok(())
    }
}
