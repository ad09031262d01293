//! Unit-wise execution against one ordinary backward pass.

use super::execution::{grad_enabled, under};
use super::Unitwise;
use crate::models::Model;
use std::rc::Weak;
use tch::{Device, Kind, Tensor};

#[test]
fn a_parameter_is_under_its_module_only() {
    let _rng = crate::global_rng();
    assert!(under("blocks.1.fc.weight", &["blocks.1"]));
    assert!(!under("blocks.10.fc.weight", &["blocks.1"]));
    assert!(under("tok.weight", &["tok", "pos"]));
    assert!(under("anything", &[""]));
}

/// Two units, the first with dropout: run unit-wise, the gradients
/// must be those of one ordinary backward pass with the same seed,
/// which holds only if the recomputation replays the dropout mask.
struct Net {
    vs: tch::nn::VarStore,
    tree: crate::models::ModuleTree,
    a: Layer,
    b: Layer,
}
struct Layer {
    path: &'static str,
    linear: tch::nn::Linear,
    dropout: bool,
}
impl crate::models::Unit for Layer {
    fn modules(&self) -> Vec<&str> {
        vec![self.path]
    }
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let y = tch::nn::Module::forward(&self.linear, x).tanh();
        if self.dropout {
            y.dropout(0.5, train)
        } else {
            y
        }
    }
}
impl Model for Net {
    fn module_tree(&self) -> &crate::models::ModuleTree {
        &self.tree
    }
    fn units(&self) -> Vec<&dyn crate::models::Unit> {
        vec![&self.a, &self.b]
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        crate::models::sorted_variables(&self.vs)
    }
}

fn net() -> Net {
    tch::manual_seed(1);
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let linear = |name: &str| tch::nn::linear(vs.root() / name, 8, 8, Default::default());
    let (a, b) = (linear("a"), linear("b"));
    let tree = crate::models::ModuleTree::from_variables(
        &crate::models::declaration_order(&vs),
        "Net",
        &[],
    );
    Net {
        a: Layer {
            path: "a",
            linear: a,
            dropout: true,
        },
        b: Layer {
            path: "b",
            linear: b,
            dropout: false,
        },
        vs,
        tree,
    }
}

fn grads(net: &Net) -> Vec<Tensor> {
    net.named_parameters()
        .iter()
        .map(|(_, p)| p.grad().copy())
        .collect()
}

#[test]
fn unit_wise_backward_gives_one_backward_passs_gradients_dropout_replayed() {
    let _rng = crate::global_rng();
    let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    let whole = net();
    tch::manual_seed(5);
    whole
        .forward_t(&x, true)
        .pow_tensor_scalar(2)
        .sum(Kind::Float)
        .backward();

    let net = std::rc::Rc::new(net());
    let unitwise = Unitwise::new(None, true);
    tch::manual_seed(5);
    let handle: Weak<dyn Model> = std::rc::Rc::downgrade(&net) as Weak<dyn Model>;
    let y = unitwise.forward(&*net, handle, &x, true, None).unwrap();
    // Nothing of the units is in the graph: only the output's leaf.
    assert!(y.is_leaf() && y.requires_grad());
    y.pow_tensor_scalar(2).sum(Kind::Float).backward();
    unitwise.backward().unwrap();
    assert_eq!(unitwise.stats().recomputed, 2);
    for (got, want) in grads(&net).iter().zip(grads(&whole)) {
        assert!(got.allclose(&want, 1e-6, 1e-7, false), "{got} vs {want}");
    }
}

#[test]
fn grad_mode_is_seen() {
    let _rng = crate::global_rng();
    assert!(grad_enabled());
    assert!(!tch::no_grad(grad_enabled));
}
