//! Accelerate's process helpers on real ranks against Accelerate itself
//! under torchrun, `reduce` with scatter, and `print` on one rank.

use common::{mpirun, mpirun_ok, results, scratch, write_result, Limited, CHILD, OUT};
use hearth_testkit as common;

use super::{values, Count};

use hearth::comm::ReduceOp;
use std::process::Command;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// One rank of the Accelerate-helpers comparison: the same inputs as
/// `tests/oracles/accelerate_collectives.py`, the same keys in its JSON.
#[test]
fn child_process_helpers() {
    if std::env::var(CHILD).as_deref() != Ok("helpers") {
        return; // only under mpirun
    }
    let mut acc = common::child_builder()
        .dataloader_config(hearth::accelerator::DataLoaderConfiguration {
            dispatch_batches: true,
            ..Default::default()
        })
        .build()
        .unwrap();
    assert_eq!(
        acc.distributed_type(),
        hearth::comm::DistributedType::MultiCpu
    );
    let (r, n) = (acc.process_index(), acc.num_processes());
    let rows =
        |t: &Tensor| -> Vec<Vec<f64>> { (0..t.size()[0]).map(|i| values(&t.get(i))).collect() };
    let (mut split, mut split_tensor, mut pad) = (
        serde_json::Map::new(),
        serde_json::Map::new(),
        serde_json::Map::new(),
    );
    for length in 0..8usize {
        for padding in [false, true] {
            if length == 0 && padding {
                continue;
            }
            let key = format!("{length}:{}", u8::from(padding));
            let items: Vec<usize> = (0..length).collect();
            split.insert(
                key.clone(),
                acc.split_between_processes(&items, padding).into(),
            );
            let table = Tensor::arange(length as i64 * 2, (Kind::Float, Device::Cpu)).view([-1, 2]);
            let mine = acc.split_tensor_between_processes(&table, padding);
            split_tensor.insert(key, rows(&mine).into());
        }
    }
    let x = Tensor::arange(((r + 1) * (r + 2)) as i64, (Kind::Float, Device::Cpu))
        .view([r as i64 + 1, r as i64 + 2])
        + 1.0;
    for (dim, value, first) in [
        (0i64, 0.0, false),
        (1, -1.0, true),
        (-1, 7.0, false),
        (-2, 0.0, true),
        (2, 5.0, false),
    ] {
        let padded = acc.pad_across_processes(&x, dim, value, first).unwrap();
        pad.insert(
            format!("{dim}:{value}:{}", u8::from(first)),
            rows(&padded).into(),
        );
    }
    if r == n - 1 {
        acc.set_trigger();
    }
    let triggers = [acc.check_trigger().unwrap(), acc.check_trigger().unwrap()];
    tch::manual_seed(100 + r as i64);
    let own_draw = values(&Tensor::rand([3], (Kind::Float, Device::Cpu)));
    acc.synchronize_rng_state().unwrap();
    let synced_draw = values(&Tensor::rand([3], (Kind::Float, Device::Cpu)));
    // Not in Accelerate: the reduce-scatter of [1+2r, 2+2r].
    let x = Tensor::from_slice(&[1.0f32 + 2.0 * r as f32, 2.0 + 2.0 * r as f32]);
    let scattered = if 2 % n == 0 {
        values(&acc.reduce_scatter(&x, ReduceOp::Sum).unwrap())
    } else {
        vec![]
    };
    // Which processes run a function, and who goes first: rank 0 writes a
    // file after a pause; every process then looks for it.
    let runs = serde_json::json!({
        "main": acc.on_main_process(|| r),
        "local_main": acc.on_local_main_process(|| r),
        "last": acc.on_last_process(|| r),
        "process_1": acc.on_process(1, || r),
        "local_process_1": acc.on_local_process(1, || r),
    });
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    let mut first = serde_json::Map::new();
    for kind in ["main", "local_main"] {
        let marker = out.join(format!("first-{kind}"));
        let look = || {
            if r == 0 {
                std::thread::sleep(Duration::from_millis(300));
                std::fs::write(&marker, "rank 0").unwrap();
            }
            marker.exists()
        };
        let seen = match kind {
            "main" => acc.main_process_first(look),
            _ => acc.local_main_process_first(look),
        };
        first.insert(format!("seen_first:{kind}"), seen.unwrap().into());
    }
    // no_sync keeps each process's own gradient (rank r's is r + 1);
    // trigger_sync_in_backward inside it averages this backward pass's.
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let no_bias = tch::nn::LinearConfig {
        bias: false,
        ws_init: tch::nn::Init::Const(0.0),
        ..Default::default()
    };
    let layer = tch::nn::linear(vs.root() / "layer", 2, 1, no_bias);
    let _vs = acc.prepare(vs).unwrap();
    let gradient = || {
        use tch::nn::Module;
        let loss = layer.forward(&Tensor::ones([1, 2], (Kind::Float, Device::Cpu)));
        acc.backward(&(loss.sum(Kind::Float) * (r as f64 + 1.0)))
            .unwrap();
        let grad = values(&layer.ws.grad());
        let _ = layer.ws.grad().zero_();
        grad
    };
    acc.print(format!("printed by rank {r}"));
    let no_sync = acc.no_sync(gradient);
    let forced = acc.no_sync(|| acc.trigger_sync_in_backward(gradient));
    let synced = gradient();
    // dispatch_batches: rank 0 reads 11 examples in batches of 2.
    let mut dispatched = serde_json::Map::new();
    for drop_last in [false, true] {
        let loader = hearth::data::DataLoader::iterable(Count(11), 2).drop_last(drop_last);
        let loader = acc.prepare(loader).unwrap();
        assert!(loader.dispatches());
        let ints = |t: &Tensor| Vec::<i64>::try_from(t).unwrap();
        let (mut batches, mut metrics, mut objects) = (vec![], vec![], vec![]);
        for batch in loader.iter() {
            batches.push(ints(&batch));
            metrics.push(ints(&acc.gather_for_metrics(&batch).unwrap()));
            let names: Vec<String> = ints(&batch).iter().map(|v| format!("ex{v}")).collect();
            objects.push(acc.gather_objects_for_metrics(names).unwrap());
        }
        dispatched.insert(
            format!("dispatch:{}", u8::from(drop_last)),
            serde_json::json!({"batches": batches, "metrics": metrics, "objects": objects}),
        );
    }
    let mut result = serde_json::json!({
        "rank": r, "world": n, "split": split, "split_tensor": split_tensor, "pad": pad,
        "triggers": triggers, "own_draw": own_draw, "synced_draw": synced_draw,
        "reduce_scatter": scattered, "runs": runs, "no_sync": no_sync,
        "trigger_sync_in_backward": forced, "synced": synced,
    });
    result.as_object_mut().unwrap().extend(dispatched);
    result.as_object_mut().unwrap().extend(first);
    write_result(r, &result);
}

/// Accelerate's helpers run under torchrun (gloo, CPU) on the same inputs.
fn accelerate_oracle(n: usize, out: &std::path::Path) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let run = Command::new(common::python())
        .args([
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            &n.to_string(),
        ])
        .args(["--master_port", &port.to_string()])
        .arg(common::repo_root().join("tests/oracles/accelerate_collectives.py"))
        .arg(out)
        .env("OMP_NUM_THREADS", "1")
        // torchrun's agent leaves its log folder in TMPDIR: keep it in ours.
        .env("TMPDIR", out)
        .run()
        .expect("the project's Python (.venv) runs; run `make setup`");
    assert!(
        run.status.success(),
        "the Accelerate oracle failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

#[test]
fn process_helpers_on_three_ranks_match_accelerate() {
    let theirs_dir = scratch("helpers-accelerate");
    accelerate_oracle(3, &theirs_dir);
    let ours_dir = scratch("helpers");
    mpirun_ok(
        3,
        &hearth_testkit::child!("child_process_helpers"),
        "helpers",
        &ours_dir,
    );
    let (theirs, ours) = (results(&theirs_dir, 3), results(&ours_dir, 3));
    for r in 0..3 {
        for key in [
            "split",
            "split_tensor",
            "pad",
            "triggers",
            "dispatch:0",
            "dispatch:1",
            "runs",
            "seen_first:main",
            "seen_first:local_main",
            "no_sync",
            "trigger_sync_in_backward",
            "synced",
        ] {
            assert_eq!(ours[r][key], theirs[r][key], "rank {r}: {key}");
        }
        // The same generator (libtorch's mt19937) gives the same floats.
        for key in ["own_draw", "synced_draw"] {
            let (a, b): (Vec<f64>, Vec<f64>) = (
                serde_json::from_value(ours[r][key].clone()).unwrap(),
                serde_json::from_value(theirs[r][key].clone()).unwrap(),
            );
            assert_eq!(a.len(), 3);
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-7, "rank {r}: {key} {a:?} vs {b:?}");
            }
        }
        assert_eq!(ours[r]["synced_draw"], ours[0]["synced_draw"]);
        assert_ne!(ours[r]["own_draw"], ours[(r + 1) % 3]["own_draw"]);
        // Not both wrong the same way: the values worked out by hand.
        assert_eq!(ours[r]["seen_first:local_main"], true);
        assert_eq!(
            ours[r]["no_sync"],
            serde_json::json!(vec![r as f64 + 1.0; 2])
        );
        assert_eq!(
            ours[r]["trigger_sync_in_backward"],
            serde_json::json!([2.0, 2.0])
        );
        assert_eq!(
            ours[r]["runs"]["last"],
            if r == 2 {
                2.into()
            } else {
                serde_json::Value::Null
            }
        );
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_share_of_the_sum_and_print_prints_once() {
    let dir = scratch("scatter");
    let run = mpirun(
        2,
        &hearth_testkit::child!("child_process_helpers"),
        "helpers",
        &dir,
    );
    assert!(run.status.success(), "{}", common::tails(&run));
    let ranks = results(&dir, 2);
    // [1, 2] + [3, 4] = [4, 6]: rank 0 gets [4], rank 1 [6].
    assert_eq!(ranks[0]["reduce_scatter"], serde_json::json!([4.0]));
    assert_eq!(ranks[1]["reduce_scatter"], serde_json::json!([6.0]));
    // `Accelerator::print` prints on the machine's first process only.
    let stdout = String::from_utf8_lossy(&run.stdout);
    let printed: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("printed by rank"))
        .collect();
    assert_eq!(printed.len(), 1, "{stdout}");
    assert!(printed[0].ends_with("printed by rank 0"), "{stdout}");
}
