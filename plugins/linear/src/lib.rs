//! The `linear` schedule, as transformers' `get_linear_schedule_with_warmup`:
//! the factor rises from 0 to 1 over `warmup-steps`, then falls linearly to
//! 0 at `total_steps`. Options: `{"warmup-steps": N}` (default 0).

use hearth_guest::{export_scheduler, Scheduler};

struct Linear {
    base: Vec<f64>,
    warmup: u64,
    total: u64,
}

impl Linear {
    fn factor(&self, step: u64) -> f64 {
        if step < self.warmup {
            return step as f64 / self.warmup.max(1) as f64;
        }
        let left = self.total.saturating_sub(step) as f64;
        (left / self.total.saturating_sub(self.warmup).max(1) as f64).max(0.0)
    }
}

impl Scheduler for Linear {
    fn create(
        options_json: &str,
        base_lrs: Vec<f64>,
        total_steps: Option<u64>,
    ) -> Result<Self, String> {
        let options: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(options_json)
                .map_err(|e| format!("options are not a JSON object: {e}"))?;
        let mut warmup = 0;
        for (key, value) in &options {
            match key.as_str() {
                "warmup-steps" => {
                    warmup = value
                        .as_u64()
                        .ok_or("`warmup-steps` must be a whole number ≥ 0")?
                }
                other => return Err(format!("unknown option `{other}` (known: warmup-steps)")),
            }
        }
        let total = total_steps.ok_or("needs the total number of steps")?;
        if warmup > total {
            return Err(format!(
                "`warmup-steps` ({warmup}) is more than the {total} steps of the run"
            ));
        }
        Ok(Linear {
            base: base_lrs,
            warmup,
            total,
        })
    }

    fn lrs(&self, step: u64) -> Vec<f64> {
        let f = self.factor(step);
        self.base.iter().map(|lr| lr * f).collect()
    }
}

export_scheduler!(Linear);
