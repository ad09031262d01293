//! A Rust user's frozen variables: a `VarStore` whose backbone requires no
//! gradient trains its head only, even with every variable handed to a
//! decaying AdamW and the gradients clipped, and a checkpoint holds what
//! trains, not the backbone.

use hearth_testkit as common;

use hearth::accelerator::Accelerator;
use hearth::ops::AdamHyper;
use hearth::optim::Adam;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

use crate::serial;

#[test]
fn a_varstores_frozen_variables_stay_frozen_and_out_of_its_checkpoints() {
    let _serial = serial();
    let dir = common::scratch("frozen-varstore");
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let backbone = nn::linear(vs.root() / "backbone", 4, 8, Default::default());
    let head = nn::linear(vs.root() / "head", 8, 1, Default::default());
    // State that never trains (as BatchNorm's running statistics).
    let _stats = (vs.root() / "stats").zeros_no_train("mean", &[2]);
    for (name, t) in vs.variables() {
        if name.starts_with("backbone.") {
            let _ = t.set_requires_grad(false);
        }
    }
    let before: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.detach().copy()))
        .collect();
    // Every variable, as a user may pass them: frozen ones get no state.
    let all: Vec<Tensor> = vs.variables().into_values().collect();
    let hyper = AdamHyper {
        lr: 1e-2,
        betas: (0.9, 0.999),
        weight_decay: 0.1,
        eps: 1e-8,
        decoupled: true,
    };
    let (vs, mut opt) = acc.prepare((vs, Adam::new(all, hyper))).unwrap();
    let x = Tensor::randn([16, 4], (Kind::Float, Device::Cpu));
    for _ in 0..3 {
        let loss = head
            .forward(&backbone.forward(&x).relu())
            .square()
            .mean(Kind::Float);
        acc.backward(&loss).unwrap();
        acc.clip_grad_norm_(&mut opt, 0.5, 2.0).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    let now = vs.variables();
    for (name, value) in &before {
        let moved = !now[name].equal(value);
        assert_eq!(moved, name.starts_with("head."), "{name}");
    }
    let saved = acc.save_state(Some(&dir.join("checkpoint"))).unwrap();
    let model = hearth::checkpoint::load_safetensors(&saved.join("model.safetensors"), Device::Cpu)
        .unwrap();
    let names: Vec<&str> = model.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["head.bias", "head.weight", "stats.mean"]);
    let state =
        hearth::checkpoint::load_safetensors(&saved.join("optimizer.safetensors"), Device::Cpu)
            .unwrap();
    // exp_avg, exp_avg_sq and step of the head's two variables alone.
    assert_eq!(state.len(), 6);
}
