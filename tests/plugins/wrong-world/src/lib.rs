//! A scheduler component: loading it as a tracker must be refused.
wit_bindgen::generate!({ path: "../../../wit", world: "hearth:plugin/scheduler-plugin" });

use exports::hearth::plugin::scheduler::{Guest, GuestSchedule, Schedule};

struct Constant(Vec<f64>);

impl GuestSchedule for Constant {
    fn create(_options: String, base: Vec<f64>, _total: Option<u64>) -> Result<Schedule, String> {
        Ok(Schedule::new(Constant(base)))
    }
    fn lrs(&self, _step: u64) -> Vec<f64> {
        self.0.clone()
    }
    fn observe(&self, _metric: f64) {}
    fn save(&self) -> Vec<u8> {
        Vec::new()
    }
    fn load(&self, _state: Vec<u8>) -> Result<(), String> {
        Ok(())
    }
}

struct Component;

impl Guest for Component {
    type Schedule = Constant;
}

export!(Component);
