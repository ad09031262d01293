//! {{name}}: a hearth learning-rate schedule. Each parameter group's rate
//! is its base rate times `gamma` for every `step-size` optimizer steps
//! taken (PyTorch's `StepLR`).
//!
//! Build and install it with `hearth plugins build` and `hearth plugins
//! install .`; test it on this machine with `cargo test`.
use hearth_guest::{export_scheduler, Scheduler};

struct Plugin {
    base_lrs: Vec<f64>,
    step_size: u64,
    gamma: f64,
}

impl Scheduler for Plugin {
    fn create(options_json: &str, base_lrs: Vec<f64>, _total_steps: Option<u64>) -> Result<Self, String> {
        // Declared in plugin.toml ([options.step-size], [options.gamma]):
        // hearth has checked the types and filled in the defaults.
        let options: serde_json::Value = serde_json::from_str(options_json).map_err(|e| e.to_string())?;
        let step_size = options["step-size"].as_u64().filter(|n| *n > 0).ok_or("`step-size` must be a whole number above 0")?;
        let gamma = options["gamma"].as_f64().ok_or("`gamma` must be a number")?;
        Ok(Self { base_lrs, step_size, gamma })
    }

    fn lrs(&self, step: u64) -> Vec<f64> {
        let factor = self.gamma.powi((step / self.step_size) as i32);
        self.base_lrs.iter().map(|lr| lr * factor).collect()
    }
}

export_scheduler!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_drops_by_gamma_every_step_size_steps() {
        let s = Plugin::create(r#"{"step-size": 10, "gamma": 0.5}"#, vec![0.1, 1.0], None).unwrap();
        assert_eq!(s.lrs(9), [0.1, 1.0]);
        assert_eq!(s.lrs(10), [0.05, 0.5]);
        assert_eq!(s.lrs(25), [0.025, 0.25]);
    }
}
