//! DDP's options (Accelerate's `DistributedDataParallelKwargs`) against
//! PyTorch's own DDP on 2 gloo processes, run live: the oracle scripts in
//! `tests/oracles/ddp_*.py` print what PyTorch did, and hearth's children run
//! the same model under mpirun.

use hearth::parallel::{CommHook, CommWrapper, DdpOptions, PowerSgdOptions};
use hearth_testkit::{self as common, mpirun_ok, results, scratch, write_result, CHILD};
use tch::{Device, Kind, Tensor};

/// A linear layer the loss uses and one it does not, on each of 2 ranks
/// (inputs filled with rank + 1), with DDP's `find_unused_parameters` or
/// `static_graph` as the mode says: one backward pass.
#[test]
fn child_unused_parameters() {
    let Some(mode) = std::env::var(CHILD)
        .ok()
        .and_then(|m| m.strip_prefix("unused:").map(str::to_string))
    else {
        return; // only under mpirun
    };
    use tch::nn::{self, Module};
    let mut acc = common::child_builder()
        .ddp(hearth::parallel::DdpOptions {
            find_unused_parameters: mode == "find",
            static_graph: mode == "static",
            ..Default::default()
        })
        .build()
        .unwrap();
    let r = acc.process_index();
    let vs = nn::VarStore::new(Device::Cpu);
    let used = nn::linear(vs.root() / "used", 3, 2, Default::default());
    let _idle = nn::linear(vs.root() / "idle", 3, 2, Default::default());
    let vs = acc.prepare(vs).unwrap();
    let x = Tensor::full([4, 3], (r + 1) as f64, (Kind::Float, Device::Cpu));
    let error = acc
        .backward(&used.forward(&x).sum(Kind::Float))
        .err()
        .map(|e| e.to_string());
    let vars = vs.variables();
    let used_grad = vars["used.weight"].grad();
    write_result(
        r,
        &serde_json::json!({
            "error": error,
            "idle_grad": vars["idle.weight"].grad().defined(),
            "used_grad": used_grad.defined().then(|| Vec::<Vec<f32>>::try_from(&used_grad).unwrap()),
        }),
    );
}

/// DDP's `find_unused_parameters` and `static_graph` against PyTorch's DDP
/// on 2 gloo processes run live (`tests/oracles/ddp_unused_parameters.py`):
/// off, a parameter the loss does not use is refused on every rank, naming
/// it and the flag (PyTorch refuses at the next forward pass, naming the
/// flag and the parameters' indices); with either flag on, the idle layer
/// keeps no gradient and the used one gets PyTorch's mean.
#[test]
fn an_unused_parameter_is_refused_unless_find_unused_parameters_or_static_graph_is_on() {
    let oracle: serde_json::Value =
        serde_json::from_str(common::oracle("ddp_unused_parameters.py", &[]).trim()).unwrap();
    assert!(oracle["off"]["error"]
        .as_str()
        .unwrap()
        .contains("find_unused_parameters=True"));
    for mode in ["off", "find", "static"] {
        let dir = scratch(&format!("unused-{mode}"));
        mpirun_ok(
            2,
            &hearth_testkit::child!("child_unused_parameters"),
            &format!("unused:{mode}"),
            &dir,
        );
        for rank in results(&dir, 2) {
            assert_eq!(rank["idle_grad"], oracle[mode]["idle_grad"], "{mode}");
            match mode {
                "off" => {
                    let error = rank["error"].as_str().expect("refused");
                    for needle in ["`idle.bias`", "`idle.weight`", "find_unused_parameters"] {
                        assert!(error.contains(needle), "{needle} in {error}");
                    }
                }
                _ => {
                    assert_eq!(rank["error"], serde_json::Value::Null, "{mode}");
                    assert_eq!(rank["used_grad"], oracle[mode]["used_grad"], "{mode}");
                }
            }
        }
    }
}

/// The parameters of the PowerSGD oracle's MLP, in PyTorch's order.
const MLP: [(&str, &[i64]); 8] = [
    ("l1.weight", &[32, 12]),
    ("l1.bias", &[32]),
    ("l2.weight", &[32, 32]),
    ("l2.bias", &[32]),
    ("l3.weight", &[32, 32]),
    ("l3.bias", &[32]),
    ("head.weight", &[6, 32]),
    ("head.bias", &[6]),
];

/// The DDP options of each mode of `tests/oracles/ddp_power_sgd.py`.
fn power_sgd_mode(mode: &str) -> DdpOptions {
    let state = match mode {
        "rank1" => PowerSgdOptions {
            matrix_approximation_rank: 1,
            start_power_sgd_iter: 2,
            ..Default::default()
        },
        "rank3_batched" => PowerSgdOptions {
            matrix_approximation_rank: 3,
            start_power_sgd_iter: 3,
            batch_tensors_with_same_shape: true,
            ..Default::default()
        },
        "fp16_cold" => PowerSgdOptions {
            matrix_approximation_rank: 2,
            start_power_sgd_iter: 1,
            warm_start: false,
            use_error_feedback: false,
            ..Default::default()
        },
        other => panic!("no PowerSGD mode {other}"),
    };
    DdpOptions {
        comm_hook: CommHook::PowerSgd,
        comm_wrapper: if mode == "fp16_cold" {
            CommWrapper::Fp16
        } else {
            CommWrapper::No
        },
        comm_state_option: state,
        ..Default::default()
    }
}

/// The oracle's MLP (weights from its formula) trained 6 steps of plain SGD
/// on this rank's inputs under PowerSGD: every step's gradients after the
/// backward pass, by name.
#[test]
fn child_power_sgd() {
    let Some(mode) = std::env::var(CHILD)
        .ok()
        .and_then(|m| m.strip_prefix("power_sgd:").map(str::to_string))
    else {
        return; // only under mpirun
    };
    // One thread, as the oracle's processes: MKL's sums may round otherwise
    // with another thread count (they did on an AMD EPYC host).
    tch::set_num_threads(1);
    use tch::nn::{self, Module};
    let mut acc = common::child_builder()
        .ddp(power_sgd_mode(&mode))
        .build()
        .unwrap();
    let r = acc.process_index() as f64;
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let layers: Vec<nn::Linear> = [
        ("l1", 12, 32),
        ("l2", 32, 32),
        ("l3", 32, 32),
        ("head", 32, 6),
    ]
    .iter()
    .map(|&(name, i, o)| nn::linear(&root / name, i, o, Default::default()))
    .collect();
    let vars = vs.variables();
    tch::no_grad(|| {
        for (k, (name, shape)) in MLP.iter().enumerate() {
            let n: i64 = shape.iter().product();
            let init = ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.7 + k as f64).sin()
                * 0.2)
                .view(*shape);
            vars[*name].shallow_clone().copy_(&init);
        }
    });
    let vs = acc.prepare(vs).unwrap();
    let vars = vs.variables();
    let mut steps = Vec::new();
    for step in 0..6 {
        let step = step as f64;
        let x = ((Tensor::arange(96, (Kind::Float, Device::Cpu)).view([8, 12]) * 0.37)
            + (step * 1.3 + r * 2.1))
            .sin();
        let y = ((Tensor::arange(48, (Kind::Float, Device::Cpu)).view([8, 6]) * 0.11)
            + (step * 0.7 + r * 0.3))
            .cos();
        for v in vars.values() {
            hearth::ops::clear_grads(&[v.shallow_clone()]).unwrap();
        }
        let mut h = x;
        for layer in &layers[..3] {
            h = layer.forward(&h).tanh();
        }
        let loss = (layers[3].forward(&h) - y).pow_tensor_scalar(2).mean(None);
        acc.backward(&loss).unwrap();
        let grads: serde_json::Map<String, serde_json::Value> = MLP
            .iter()
            .map(|(name, _)| {
                let g = vars[*name].grad().view([-1]);
                (name.to_string(), Vec::<f32>::try_from(&g).unwrap().into())
            })
            .collect();
        steps.push(serde_json::Value::Object(grads));
        tch::no_grad(|| {
            for v in vars.values() {
                let _ = v.shallow_clone().g_sub_(&(v.grad() * 0.1));
            }
        });
    }
    write_result(acc.process_index(), &serde_json::Value::Array(steps));
}

/// PowerSGD (`comm_hook = power_sgd` with `comm_state_option`, and the
/// fp16 `comm_wrapper`) against PyTorch's `powerSGD_hook` as Accelerate
/// registers it, on 2 gloo processes run live
/// (`tests/oracles/ddp_power_sgd.py`): the same MLP, weights and inputs,
/// 6 steps of SGD, and every step's gradients on each rank compared —
/// the plain means before `start_powerSGD_iter`, then the low-rank
/// approximations with rank 1 (Gram–Schmidt) and rank 3 (QR, matrices of
/// one shape batched), warm start and error feedback on, and in half
/// precision with both off. A different seed, order or rounding step
/// would give other approximations (checked: the modes differ).
#[test]
fn power_sgd_gives_pytorchs_gradients_step_by_step() {
    let oracle: serde_json::Value =
        serde_json::from_str(common::oracle("ddp_power_sgd.py", &[]).trim()).unwrap();
    let modes = ["rank1", "rank3_batched", "fp16_cold"];
    for mode in modes {
        let dir = scratch(&format!("power-sgd-{mode}"));
        mpirun_ok(
            2,
            &hearth_testkit::child!("child_power_sgd"),
            &format!("power_sgd:{mode}"),
            &dir,
        );
        for (rank, got) in results(&dir, 2).iter().enumerate() {
            let want = &oracle[mode][rank];
            for step in 0..6 {
                for (name, _) in MLP {
                    let (g, w) = (&got[step][name], &want[step][name]);
                    let worst = (g.as_array().unwrap().iter())
                        .zip(w.as_array().unwrap())
                        .map(|(g, w)| {
                            let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
                            (g - w).abs() / (1e-6 + w.abs())
                        })
                        .fold(0.0, f64::max);
                    assert!(
                        worst < 1e-6,
                        "{mode}, rank {rank}, step {step}, {name}: relative difference {worst}"
                    );
                }
            }
        }
    }
    // (On this machine they agree bit for bit.) The modes give different
    // gradients from the step PowerSGD starts:
    // the comparison above tells them apart.
    let l2 = |mode: &str| oracle[mode][0][4]["l2.weight"].clone();
    assert_ne!(l2("rank1"), l2("rank3_batched"));
    assert_ne!(l2("rank1"), l2("fp16_cold"));
}

/// A frozen layer and a trained one, each rank from its own random
/// weights: after `prepare` both hold rank 0's; two synchronising steps
/// send only the trained layer's gradients (and one flag each); then the
/// frozen layer is unfrozen, and the next backward pass is refused naming it.
#[test]
fn child_frozen() {
    if std::env::var(CHILD).as_deref() != Ok("frozen") {
        return; // only under mpirun
    }
    use tch::nn::{self, Module};
    let mut acc = common::child_builder().build().unwrap();
    let r = acc.process_index();
    tch::manual_seed(10 + r as i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let backbone = nn::linear(vs.root() / "backbone", 4, 8, Default::default());
    let head = nn::linear(vs.root() / "head", 8, 2, Default::default());
    for (name, t) in vs.variables() {
        if name.starts_with("backbone") {
            let _ = t.shallow_clone().set_requires_grad(false);
        }
    }
    let vs = acc.prepare(vs).unwrap();
    let vars = vs.variables();
    let weights = |name: &str| Vec::<f32>::try_from(&vars[name].reshape([-1])).unwrap();
    let prepared = (weights("backbone.weight"), weights("head.weight"));
    let x = Tensor::ones([3, 4], (Kind::Float, Device::Cpu)) * (r as f64 + 1.0);
    let loss = || head.forward(&backbone.forward(&x).tanh()).sum(Kind::Float);
    for _ in 0..2 {
        acc.backward(&loss()).unwrap();
    }
    let bytes = acc.gradient_sync_stats().bytes;
    let _ = vars["backbone.weight"]
        .shallow_clone()
        .set_requires_grad(true);
    let error = acc.backward(&loss()).unwrap_err();
    let mut chain = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(e) = source {
        chain += &format!(": {e}");
        source = e.source();
    }
    write_result(
        r,
        &serde_json::json!({
            "backbone": prepared.0, "head": prepared.1, "bytes": bytes,
            "error": chain,
            "backbone_grad": vars["backbone.bias"].grad().defined(),
        }),
    );
}

/// Parameters that require no gradient when the model is prepared are
/// broadcast from rank 0 and left out of the buckets, as PyTorch's DDP
/// leaves them out: a frozen backbone costs nothing per step.
#[test]
fn frozen_parameters_are_broadcast_once_and_never_averaged() {
    let dir = scratch("frozen");
    mpirun_ok(2, &hearth_testkit::child!("child_frozen"), "frozen", &dir);
    let ranks = results(&dir, 2);
    for rank in &ranks {
        assert_eq!(rank["backbone"], ranks[0]["backbone"]);
        assert_eq!(rank["head"], ranks[0]["head"]);
        // 2 syncs of the head's 8·2 + 2 values and 2 flags, in f32.
        assert_eq!(rank["bytes"], 2 * (16 + 2 + 2) * 4, "{rank}");
        assert_eq!(rank["backbone_grad"], false);
        let error = rank["error"].as_str().unwrap();
        for needle in ["`backbone.weight`", "prepare the model after unfreezing"] {
            assert!(error.contains(needle), "{needle} in {error}");
        }
    }
}
