//! What was left out of `prepare` is refused on the first synchronising
//! backward pass, with the fix named, and allowed with
//! `check_prepared(false)`.

use crate::FakeWorld;
use hearth::accelerator::{Accelerator, AcceleratorBuilder, BackwardError, LrSchedule};
use hearth::ops::SgdHyper;
use hearth::optim::Sgd;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// A linear layer's variables, its forward pass and an SGD over them.
fn linear() -> (nn::VarStore, nn::Linear, Sgd) {
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root() / "layer", 3, 1, Default::default());
    let hyper = SgdHyper {
        lr: 0.1,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    let opt = Sgd::new(vs.trainable_variables(), hyper);
    (vs, layer, opt)
}

/// Two micro-batches, each one `acc.backward`: the second ends the
/// accumulation group when accumulating over two.
fn two_backwards(acc: &Accelerator, layer: &nn::Linear) -> Result<(), BackwardError> {
    let x = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
    for _ in 0..2 {
        acc.accumulate(|| acc.backward(&layer.forward(&x).sum(Kind::Float)))?;
    }
    Ok(())
}

fn accumulating(check: bool) -> Accelerator {
    Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_steps(2)
        .check_prepared(check)
        .build()
        .unwrap()
}

#[test]
fn an_optimizer_left_out_of_prepare_is_refused_under_accumulation_unless_deliberate() {
    let (vs, layer, _opt) = linear();
    let mut acc = accumulating(true);
    let _vs = acc.prepare(vs).unwrap();
    let err = two_backwards(&acc, &layer).unwrap_err().to_string();
    assert!(
        err.contains("`layer.weight`")
            && err.contains("in no prepared optimizer")
            && err.contains("gradient_accumulation_steps is 2")
            && err.contains("acc.prepare((model, optimizer")
            && err.contains(".check_prepared(false)"),
        "{err}"
    );

    let (vs, layer, _opt) = linear();
    let mut acc = accumulating(false);
    let _vs = acc.prepare(vs).unwrap();
    two_backwards(&acc, &layer).unwrap();

    // Prepared with its optimizer: no complaint.
    let (vs, layer, opt) = linear();
    let mut acc = accumulating(true);
    let (_vs, _opt) = acc.prepare((vs, opt)).unwrap();
    two_backwards(&acc, &layer).unwrap();
}

/// A constant learning rate.
struct Constant;

impl LrSchedule for Constant {
    fn lrs(&mut self, _step: u64) -> Result<Vec<f64>, hearth::plugins::PluginError> {
        Ok(vec![0.1])
    }
}

#[test]
fn a_scheduler_bound_to_no_optimizer_is_refused() {
    let (vs, layer, _opt) = linear();
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let schedule: Box<dyn LrSchedule> = Box::new(Constant);
    let (_vs, _sched) = acc.prepare((vs, schedule)).unwrap();
    let err = two_backwards(&acc, &layer).unwrap_err().to_string();
    assert!(
        err.contains("bound to no optimizer") && err.contains("prepare the optimizer"),
        "{err}"
    );
}

fn on_two(check: bool) -> AcceleratorBuilder {
    Accelerator::builder()
        .cpu(true)
        .process_group(Box::new(FakeWorld { rank: 1, n: 2 }))
        .check_prepared(check)
}

#[test]
fn a_model_left_out_of_prepare_on_two_processes_is_refused_unless_deliberate() {
    let (_vs, layer, opt) = linear();
    let mut acc = on_two(true).build().unwrap();
    let _opt = acc.prepare(opt).unwrap();
    let err = two_backwards(&acc, &layer).unwrap_err().to_string();
    assert!(
        err.contains("steps 2 parameters (of shape")
            && err.contains("[1, 3]")
            && err.contains("belong to no prepared model")
            && err.contains("on these 2 processes")
            && err.contains("VarStore")
            && err.contains(".check_prepared(false)"),
        "{err}"
    );

    let (_vs, layer, opt) = linear();
    let mut acc = on_two(false).build().unwrap();
    let _opt = acc.prepare(opt).unwrap();
    two_backwards(&acc, &layer).unwrap();
}
