//! `Accelerator::join_uneven_inputs` against PyTorch's `Join` with a DDP
//! model (what Accelerate enters on GPUs) on 2 gloo processes, run live
//! (`tests/oracles/ddp_join.py`).

use hearth::data::DataLoader;
use hearth_testkit::{self as common, mpirun_ok, results, scratch, write_result, CHILD};
use tch::{Device, Kind, Tensor};

/// The oracle's parameters, in PyTorch's order.
const NET: [(&str, &[i64]); 4] = [
    ("l1.weight", &[4, 5]),
    ("l1.bias", &[4]),
    ("head.weight", &[2, 4]),
    ("head.bias", &[2]),
];

/// Batches each rank trains on: uneven.
const BATCHES: [usize; 2] = [3, 5];

fn f32s(t: &Tensor) -> serde_json::Value {
    Vec::<f32>::try_from(&t.reshape([-1])).unwrap().into()
}

/// The oracle's model and inputs: rank 0 trains on 3 batches and rank 1 on
/// 5 inside `join_uneven_inputs(Some(false), ..)`; each rank writes its
/// gradients after every backward pass, its weights after the join, and
/// the batches a prepared loader of 7 examples gives it before, inside and
/// after the join.
#[test]
fn child_join() {
    if std::env::var(CHILD).as_deref() != Ok("join") {
        return; // only under mpirun
    }
    use tch::nn::{self, Module};
    let mut acc = common::child_builder().build().unwrap();
    let rank = acc.process_index();
    let vs = nn::VarStore::new(Device::Cpu);
    let l1 = nn::linear(vs.root() / "l1", 5, 4, Default::default());
    let head = nn::linear(vs.root() / "head", 4, 2, Default::default());
    let vars = vs.variables();
    tch::no_grad(|| {
        for (k, (name, shape)) in NET.iter().enumerate() {
            let n: i64 = shape.iter().product();
            let init = (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.9 + k as f64).sin() * 0.3;
            vars[*name].shallow_clone().copy_(&init.view(*shape));
        }
    });
    let examples: Vec<Tensor> = (0..7i64).map(|i| Tensor::from_slice(&[i])).collect();
    let (vs, loader) = acc.prepare((vs, DataLoader::new(examples, 1))).unwrap();
    let vars = vs.variables();
    let seen = |loader: &hearth::accelerator::PreparedDataLoader<_>| -> Vec<Vec<i64>> {
        loader
            .iter()
            .map(|b: Tensor| Vec::<i64>::try_from(&b.reshape([-1])).unwrap())
            .collect()
    };
    let before = seen(&loader);
    let (inside, grads) = acc
        .join_uneven_inputs(Some(false), || {
            let inside = seen(&loader);
            let mut grads = Vec::new();
            for step in 0..BATCHES[rank] {
                let (s, r) = (step as f64, rank as f64);
                let x = ((Tensor::arange(15, (Kind::Float, Device::Cpu)).view([3, 5]) * 0.41)
                    + (s * 0.9 + r * 1.7))
                    .sin();
                let y = ((Tensor::arange(6, (Kind::Float, Device::Cpu)).view([3, 2]) * 0.23)
                    + (s * 0.5 + r * 0.2))
                    .cos();
                for v in vars.values() {
                    hearth::ops::clear_grads(&[v.shallow_clone()]).unwrap();
                }
                let out = head.forward(&l1.forward(&x).tanh());
                acc.backward(&(out - y).pow_tensor_scalar(2).mean(None))
                    .unwrap();
                let step: serde_json::Map<String, serde_json::Value> = NET
                    .iter()
                    .map(|(name, _)| (name.to_string(), f32s(&vars[*name].grad())))
                    .collect();
                grads.push(step);
                tch::no_grad(|| {
                    for v in vars.values() {
                        let _ = v.shallow_clone().g_sub_(&(v.grad() * 0.1));
                    }
                });
            }
            (inside, grads)
        })
        .unwrap();
    let after = seen(&loader);
    let weights: serde_json::Map<String, serde_json::Value> = NET
        .iter()
        .map(|(name, _)| (name.to_string(), f32s(&vars[*name])))
        .collect();
    write_result(
        rank,
        &serde_json::json!({
            "grads": grads, "weights": weights,
            "batches": {"before": before, "inside": inside, "after": after},
        }),
    );
}

/// `join_uneven_inputs` with 2 ranks of 3 and 5 batches against PyTorch's
/// `Join` with DDP, run live: rank 0's 3 steps average both ranks'
/// gradients; rank 1's last 2 are its own divided by 2 (the joined rank
/// sends zeros, PyTorch's `divide_by_initial_world_size`); afterwards both
/// hold rank 1's weights, PyTorch's too. Inside, a prepared loader of 7
/// examples gives the batches Accelerate's `prepare_data_loader` gives with
/// `even_batches=False` (4 and 3), outside those with `even_batches=True`.
#[test]
fn join_uneven_inputs_trains_what_pytorchs_join_trains() {
    let oracle: serde_json::Value =
        serde_json::from_str(common::oracle("ddp_join.py", &[]).trim()).unwrap();
    let dir = scratch("join");
    mpirun_ok(2, &hearth_testkit::child!("child_join"), "join", &dir);
    let flat = |batches: &serde_json::Value| -> Vec<Vec<i64>> {
        (batches.as_array().unwrap().iter())
            .map(|b| {
                let b = b.to_string().replace(['[', ']'], "");
                b.split(',').map(|v| v.trim().parse().unwrap()).collect()
            })
            .collect()
    };
    for (rank, got) in results(&dir, 2).iter().enumerate() {
        let want = &oracle[rank];
        let grads = got["grads"].as_array().unwrap();
        assert_eq!(grads.len(), BATCHES[rank], "rank {rank}");
        let close = |a: &serde_json::Value, b: &serde_json::Value, what: &str| {
            let (a, b) = (a.as_array().unwrap(), b.as_array().unwrap());
            assert_eq!(a.len(), b.len(), "{what}");
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                assert!(
                    (x - y).abs() <= 1e-6 * (1.0 + y.abs()),
                    "{what}: {x} vs PyTorch's {y}"
                );
            }
        };
        for (step, grads) in grads.iter().enumerate() {
            for (name, _) in NET {
                let what = format!("rank {rank}, step {step}, gradient of {name}");
                close(&grads[name], &want["grads"][step][name], &what);
            }
        }
        for (name, _) in NET {
            let what = format!("rank {rank}, {name} after the join");
            close(&got["weights"][name], &want["weights"][name], &what);
        }
        let batches = &got["batches"];
        assert_eq!(
            flat(&batches["before"]),
            flat(&want["batches"]["even"]),
            "rank {rank}"
        );
        assert_eq!(
            flat(&batches["inside"]),
            flat(&want["batches"]["uneven"]),
            "rank {rank}"
        );
        assert_eq!(
            flat(&batches["after"]),
            flat(&want["batches"]["even"]),
            "rank {rank}"
        );
    }
    // Uneven inside: rank 0 has one batch more than rank 1.
    assert_eq!(flat(&oracle[0]["batches"]["uneven"]).len(), 4);
    assert_eq!(flat(&oracle[1]["batches"]["uneven"]).len(), 3);
}

/// A sharded model under `join_uneven_inputs` with uneven batches: refused
/// on every rank before `body` runs, saying why and what to do.
#[test]
fn child_join_sharded() {
    if std::env::var(CHILD).as_deref() != Ok("join:sharded") {
        return; // only under mpirun
    }
    use hearth::models::VarStoreModel;
    use hearth::parallel::{FsdpPlugin, ShardingStrategy};
    use tch::nn;
    let mut acc = common::child_builder()
        .fsdp(FsdpPlugin {
            sharding_strategy: Some("SHARD_GRAD_OP".parse::<ShardingStrategy>().unwrap()),
            auto_wrap_policy: Some("transformer-based".into()),
            transformer_cls_names_to_wrap: Some(vec!["Layer".into()]),
            ..Default::default()
        })
        .build()
        .unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let _layer = nn::linear(vs.root() / "layers" / 0, 4, 4, Default::default());
    let model = VarStoreModel::new(vs)
        .class("", "Net")
        .class("layers", "ModuleList")
        .class("layers.0", "Layer");
    let _model = acc.prepare(model).unwrap();
    let mut ran = false;
    let error = acc
        .join_uneven_inputs(Some(false), || ran = true)
        .unwrap_err()
        .to_string();
    write_result(
        acc.process_index(),
        &serde_json::json!({"error": error, "ran": ran}),
    );
}

#[test]
fn join_uneven_inputs_refuses_sharded_models() {
    let dir = scratch("join-sharded");
    mpirun_ok(
        2,
        &hearth_testkit::child!("child_join_sharded"),
        "join:sharded",
        &dir,
    );
    for rank in results(&dir, 2) {
        assert_eq!(rank["ran"], false);
        let error = rank["error"].as_str().unwrap();
        for needle in ["sharded (FSDP)", "not joinable", "even_batches = true"] {
            assert!(error.contains(needle), "{needle} in {error}");
        }
    }
}
