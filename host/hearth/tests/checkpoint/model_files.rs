//! Sharded model weights against Hugging Face: the split plan, index and
//! files that huggingface_hub makes for the same model, loads of its files
//! into hearth and of hearth's into PyTorch, and clear errors for broken
//! checkpoints that leave the model untouched.

use common::scratch;
use hearth_testkit as common;

use common::{oracle, python, repo_root, Limited};
use hearth::checkpoint::{
    load_checkpoint_in_model, load_safetensors, parse_size, save_model, save_safetensors,
    CheckpointError,
};
use serde_json::Value;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// Zeros shaped like `reference`, in `order`: the model to load into.
fn empty_like(reference: &[(String, Tensor)], order: &[String]) -> Vec<(String, Tensor)> {
    order
        .iter()
        .map(|n| {
            let t = &reference.iter().find(|(m, _)| m == n).unwrap().1;
            (n.clone(), t.zeros_like())
        })
        .collect()
}

fn same(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> bool {
    a.len() == b.len()
        && a.iter().all(|(n, t)| {
            b.iter()
                .find(|(m, _)| m == n)
                .is_some_and(|(_, u)| t.equal(u))
        })
}

#[test]
fn shards_like_huggingface_and_both_sides_load_each_other() {
    let dir = scratch("hf");
    let plan: Value =
        serde_json::from_str(&oracle("model_files.py", &["make", dir.to_str().unwrap()])).unwrap();
    let order: Vec<String> = serde_json::from_value(plan["order"].clone()).unwrap();
    let reference = load_safetensors(&dir.join("reference.safetensors"), Device::Cpu).unwrap();

    // huggingface_hub's shards (through their index) load into hearth.
    let model = empty_like(&reference, &order);
    let report = load_checkpoint_in_model(&model, &dir.join("python_sharded"), true).unwrap();
    assert!(report.missing.is_empty() && report.unexpected.is_empty());
    assert!(
        same(&model, &reference),
        "hearth loaded Python's shards wrongly"
    );

    // hearth's shards: the same plan, and PyTorch loads them.
    let saved = save_model(&dir.join("hearth_sharded"), &model, 100).unwrap();
    assert_eq!(saved.total_size, 236);
    assert_eq!(saved.files.len(), 3);
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(saved.index.as_ref().unwrap()).unwrap())
            .unwrap();
    assert_eq!(index["metadata"]["total_size"], 236);
    for (file, names) in plan["filename_to_tensors"].as_object().unwrap() {
        assert!(dir.join("hearth_sharded").join(file).is_file(), "{file}");
        for name in names.as_array().unwrap() {
            assert_eq!(
                index["weight_map"][name.as_str().unwrap()],
                file.as_str(),
                "{name}"
            );
        }
    }
    let check = std::process::Command::new(python())
        .arg(repo_root().join("tests/oracles/model_files.py"))
        .args(["check", dir.to_str().unwrap()])
        .run()
        .unwrap();
    assert!(
        check.status.success() && String::from_utf8_lossy(&check.stdout).contains("agree"),
        "PyTorch could not load hearth's shards: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    // A single-file save into the same folder removes the shards and index;
    // a loader given the folder then finds model.safetensors.
    save_model(&dir.join("hearth_sharded"), &model, 10_000).unwrap();
    let left: Vec<String> = std::fs::read_dir(dir.join("hearth_sharded"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["model.safetensors".to_string()]);
    let again = empty_like(&reference, &order);
    load_checkpoint_in_model(&again, &dir.join("hearth_sharded"), true).unwrap();
    assert!(same(&again, &reference));
}

#[test]
fn a_tensor_larger_than_the_limit_gets_a_shard_of_its_own() {
    let dir = scratch("big");
    let t = |n: i64| Tensor::ones([n], (Kind::Float, Device::Cpu));
    let model = vec![
        ("a".to_string(), t(4)),
        ("big".to_string(), t(100)),
        ("c".to_string(), t(4)),
    ];
    let saved = save_model(&dir, &model, 64).unwrap();
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(saved.index.unwrap()).unwrap()).unwrap();
    let map = &index["weight_map"];
    // huggingface_hub's rule: the big one is appended as soon as it is met;
    // the shard being filled continues after it.
    assert_eq!(map["big"], "model-00001-of-00002.safetensors");
    assert_eq!(map["a"], map["c"]);
}

fn sample_model() -> Vec<(String, Tensor)> {
    vec![
        (
            "w".to_string(),
            Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]),
        ),
        ("b".to_string(), Tensor::from_slice(&[0.5f32, -0.5])),
    ]
}

fn untouched(model: &[(String, Tensor)]) -> bool {
    same(model, &sample_model())
}

fn expect_err(model: &[(String, Tensor)], path: &Path, strict: bool) -> String {
    let err = load_checkpoint_in_model(model, path, strict).unwrap_err();
    assert!(untouched(model), "a failed load must not change the model");
    err.to_string()
}

#[test]
fn broken_checkpoints_are_clear_errors_and_change_nothing() {
    let dir = scratch("errors");
    let model = sample_model();
    let good = dir.join("good.safetensors");
    let other = vec![
        (
            "w".to_string(),
            Tensor::zeros([2, 2], (Kind::Float, Device::Cpu)),
        ),
        (
            "b".to_string(),
            Tensor::zeros([2], (Kind::Float, Device::Cpu)),
        ),
    ];
    save_safetensors(&good, &other).unwrap();
    let bytes = std::fs::read(&good).unwrap();

    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 5]).unwrap();
    let err = expect_err(&model, &truncated, true);
    assert!(err.contains("truncated.safetensors"), "{err}");

    let garbled = dir.join("garbled.safetensors");
    let mut g = bytes.clone();
    g[8..20].copy_from_slice(b"}}}}garbage!");
    std::fs::write(&garbled, &g).unwrap();
    let err = expect_err(&model, &garbled, true);
    assert!(
        err.contains("garbled.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );

    let wrong_dtype = dir.join("dtype.safetensors");
    save_safetensors(
        &wrong_dtype,
        &[
            (
                "w".into(),
                Tensor::zeros([2, 2], (Kind::Double, Device::Cpu)),
            ),
            ("b".into(), Tensor::zeros([2], (Kind::Float, Device::Cpu))),
        ],
    )
    .unwrap();
    let err = expect_err(&model, &wrong_dtype, true);
    assert!(
        err.contains("`w`") && err.contains("F64") && err.contains("Float"),
        "{err}"
    );

    let wrong_shape = dir.join("shape.safetensors");
    save_safetensors(
        &wrong_shape,
        &[
            ("w".into(), Tensor::zeros([4], (Kind::Float, Device::Cpu))),
            ("b".into(), Tensor::zeros([2], (Kind::Float, Device::Cpu))),
        ],
    )
    .unwrap();
    let err = expect_err(&model, &wrong_shape, true);
    assert!(
        err.contains("`w`") && err.contains("[4]") && err.contains("[2, 2]"),
        "{err}"
    );

    let missing = dir.join("missing.safetensors");
    save_safetensors(
        &missing,
        &[
            (
                "w".into(),
                Tensor::zeros([2, 2], (Kind::Float, Device::Cpu)),
            ),
            (
                "extra".into(),
                Tensor::zeros([1], (Kind::Float, Device::Cpu)),
            ),
        ],
    )
    .unwrap();
    let err = expect_err(&model, &missing, true);
    assert!(
        err.contains("missing [\"b\"]") && err.contains("unexpected [\"extra\"]"),
        "{err}"
    );
    // Not strict: loads what fits and reports the rest.
    let loose = sample_model();
    let report = load_checkpoint_in_model(&loose, &missing, false).unwrap();
    assert_eq!(
        (report.missing, report.unexpected),
        (vec!["b".to_string()], vec!["extra".to_string()])
    );
    assert_eq!(f64::try_from(loose[0].1.sum(Kind::Float)).unwrap(), 0.0);

    // An index that names a shard which is not there.
    let sharded = dir.join("sharded");
    save_model(&sharded, &other, 8).unwrap();
    std::fs::remove_file(sharded.join("model-00002-of-00002.safetensors")).unwrap();
    let err = expect_err(&model, &sharded, true);
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
    std::fs::write(sharded.join("model.safetensors.index.json"), "{not json").unwrap();
    let err = expect_err(&model, &sharded, true);
    assert!(err.contains("model.safetensors.index.json"), "{err}");

    let empty = dir.join("empty-folder");
    std::fs::create_dir_all(&empty).unwrap();
    assert!(matches!(
        load_checkpoint_in_model(&model, &empty, true),
        Err(CheckpointError::Format { .. })
    ));

    // And the good file loads.
    load_checkpoint_in_model(&model, &good, true).unwrap();
    assert!(same(&model, &other));
}

#[test]
fn shard_sizes_parse_like_accelerate() {
    assert_eq!(parse_size("10GB"), Ok(10_000_000_000));
    assert_eq!(parse_size("5MiB"), Ok(5 << 20));
    assert_eq!(parse_size("100"), Ok(100));
    assert!(
        parse_size("ten GB").is_err() && parse_size("5TB").is_err() && parse_size("0").is_err()
    );
}

/// `save_model` takes a plain tch `VarStore` (a model of tch layers with no
/// `Model` impl): PyTorch loads the file strictly into the module of the
/// same layers and computes what tch computed.
#[test]
fn save_model_takes_a_varstore_and_pytorch_loads_what_it_writes() {
    let dir = scratch("varstore");
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = tch::nn::seq()
        .add(tch::nn::linear(&root / "0", 3, 4, Default::default()))
        .add_fn(|x| x.tanh())
        .add(tch::nn::linear(&root / "2", 4, 2, Default::default()));
    let x = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
    let ours = tch::nn::Module::forward(&net, &x);
    let acc = hearth::accelerator::Accelerator::builder()
        .cpu(true)
        .build()
        .unwrap();
    let saved = acc.save_model(&vs, &dir, u64::MAX).unwrap().unwrap();
    let file = &saved.files[0];
    let theirs: Value =
        serde_json::from_str(&oracle("varstore_into_torch.py", &[file.to_str().unwrap()])).unwrap();
    assert_eq!(theirs["metadata"]["format"], "pt");
    let output: Vec<f64> = serde_json::from_value(theirs["output"].clone()).unwrap();
    let ours: Vec<f64> = Vec::<f64>::try_from(ours.flatten(0, -1).to_kind(Kind::Double)).unwrap();
    assert_eq!(ours.len(), output.len());
    for (a, b) in ours.iter().zip(&output) {
        assert!((a - b).abs() < 1e-6, "{ours:?} vs {output:?}");
    }
}
