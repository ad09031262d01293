//! Tied weights on a device map: both names filled from one checkpoint
//! tensor wherever it lies, staging through the disk, and the refusals
//! (a tie split over two devices, a GPU the machine lacks, a folder
//! without the weights, tokens the model cannot embed).

use super::common;
use common::scratch;
use hearth::big_model::{
    dispatch_model, load_checkpoint_in_model, DeviceMap, DispatchOptions, LoadOptions, MapDevice,
};
use hearth::checkpoint::load_safetensors;
use hearth::models::Model;
use serde_json::{json, Value};
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// The TiedNet's checkpoint and scripted copy, and the checkpoint model's
/// logits on `x`, from the oracle.
fn tiednet(dir: &Path, x: &Tensor) -> (std::path::PathBuf, std::path::PathBuf, Tensor) {
    let (ckpt, script, out) = (
        dir.join("ckpt"),
        dir.join("tied.pt"),
        dir.join("oracle.safetensors"),
    );
    let tokens: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(x).unwrap();
    common::oracle(
        "accelerate_dispatch.py",
        &[&json!({
            "sizes": {"vocab_size": 23, "d_model": 16, "layers": 3},
            "checkpoint": ckpt, "save": script, "device_map": {"": "cpu"},
            "accelerate_offload": dir.join("accelerate-offload"), "tokens": tokens, "out": out,
        })
        .to_string()],
    );
    let want = load_safetensors(&out, Device::Cpu)
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == "checkpoint_model")
        .unwrap()
        .1;
    (ckpt, script, want)
}

fn tied_map(entries: &[(&str, MapDevice)]) -> DeviceMap {
    entries.iter().map(|(k, d)| (k.to_string(), *d)).collect()
}

/// Tied weights on the disk (the checkpoint names them `head.weight`, the
/// model `tok.weight`), the CPU's tensors staged through the disk
/// (`offload_state_dict`), integer buffers kept integer under a dtype, a
/// load without a map filling both tied names, and the refusals: a tie
/// split over two devices, a GPU the machine lacks, a dispatch from a
/// folder without the weights, and tokens the model cannot embed.
#[test]
fn tied_weights_staging_and_refusals_keep_the_model_whole() {
    use hearth::models::TorchScriptModel;
    let dir = scratch("dispatch-tied");
    let x = Tensor::randint(23, [2, 12], (Kind::Int64, Device::Cpu));
    let (ckpt, script, want) = tiednet(&dir, &x);
    let (cpu, disk) = (MapDevice::Cpu, MapDevice::Disk);
    let load = |map: &DeviceMap, folder: &Path, stage: bool, dtype: Option<Kind>| {
        let model = TorchScriptModel::load(&script, Device::Cpu).unwrap();
        let options = LoadOptions {
            device_map: Some(map.clone()),
            offload_folder: Some(folder.to_path_buf()),
            offload_state_dict: stage,
            dtype,
            ..Default::default()
        };
        let loaded = load_checkpoint_in_model(&model, &ckpt, &options);
        (model, loaded)
    };
    let run = |model: TorchScriptModel, map: &DeviceMap, folder: &Path| {
        let options = DispatchOptions {
            offload_dir: Some(folder.to_path_buf()),
            ..Default::default()
        };
        dispatch_model(Box::new(model), map, &options).and_then(|d| d.forward(&x))
    };

    // The tied embedding and head on the disk, the rest staged via the disk.
    let map = tied_map(&[
        ("scale", cpu),
        ("tok", disk),
        ("blocks", cpu),
        ("norm", cpu),
        ("head", disk),
    ]);
    let folder = dir.join("tied-offload");
    let (model, loaded) = load(&map, &folder, true, None);
    let loaded = loaded.unwrap();
    assert!(
        loaded.offload_index.contains_key("head.weight"),
        "stored under the checkpoint's name"
    );
    assert!(
        !folder
            .read_dir()
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(".state-dict")),
        "the staging folder is gone"
    );
    let logits = run(model, &map, &folder).unwrap();
    assert!(
        logits.allclose(&want, 1e-5, 1e-5, false),
        "max difference {}",
        (&logits - &want).abs().max()
    );

    // A dtype leaves integer buffers integer.
    let (model, loaded) = load(&map, &dir.join("half"), false, Some(Kind::Half));
    loaded.unwrap();
    let buffers: std::collections::HashMap<String, Tensor> =
        model.named_buffers().into_iter().collect();
    assert_eq!(
        buffers["blocks.0.bn.num_batches_tracked"].kind(),
        Kind::Int64
    );
    assert_eq!(buffers["blocks.0.bn.running_mean"].kind(), Kind::Half);

    // Without a map: the checkpoint's `head.weight` fills `tok.weight` too.
    let model = TorchScriptModel::load(&script, Device::Cpu).unwrap();
    let plain = load_checkpoint_in_model(
        &model,
        &ckpt,
        &LoadOptions {
            strict: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(
        plain.missing.is_empty() && plain.unexpected.is_empty(),
        "{:?} {:?}",
        plain.missing,
        plain.unexpected
    );
    assert!(model
        .try_forward(&x, false)
        .unwrap()
        .allclose(&want, 1e-5, 1e-5, false));

    // Refused, the model untouched and nothing written: a split tie, a GPU
    // this machine lacks.
    let gpus = hearth::ops::cuda::device_count();
    for (map, words) in [
        (
            tied_map(&[("", cpu), ("head", disk)]),
            vec!["head.weight on disk", "tok.weight on cpu"],
        ),
        (
            tied_map(&[("", disk), ("norm", MapDevice::Gpu(gpus + 3))]),
            vec!["`norm`", "GPU"],
        ),
    ] {
        let folder = dir.join("refused");
        let (model, loaded) = load(&map, &folder, false, None);
        let err = loaded.unwrap_err().to_string();
        assert!(words.iter().all(|w| err.contains(w)), "{err}");
        assert!(!folder.exists(), "{err}: the folder was written");
        assert!(
            model.named_parameters().iter().all(|(_, t)| t.numel() > 0),
            "{err}: the model changed"
        );
    }

    // Dispatching a model whose disk tensors went to another folder.
    let map = tied_map(&[("", cpu), ("blocks.1", disk)]);
    let (model, loaded) = load(&map, &dir.join("first"), false, None);
    loaded.unwrap();
    let err = run(model, &map, &dir.join("elsewhere"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("blocks.1.") && err.contains("no index.json"),
        "{err}"
    );
    assert!(!dir.join("elsewhere").join("index.json").exists());

    // A stale index whose tensor has another shape.
    let (model, loaded) = load(&map, &dir.join("stale"), false, None);
    loaded.unwrap();
    let index_path = dir.join("stale").join("index.json");
    let mut index: Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["blocks.1.fc.weight"]["shape"] = json!([3, 3]);
    std::fs::write(&index_path, index.to_string()).unwrap();
    let err = run(model, &map, &dir.join("stale"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("blocks.1.fc.weight") && err.contains("[3, 3]"),
        "{err}"
    );

    // Tokens outside the vocabulary: an error, and the disk's tensors are
    // dropped again.
    let (model, loaded) = load(&map, &dir.join("bad-tokens"), false, None);
    loaded.unwrap();
    let dispatched = dispatch_model(
        Box::new(model),
        &map,
        &DispatchOptions {
            offload_dir: Some(dir.join("bad-tokens")),
            ..Default::default()
        },
    )
    .unwrap();
    let bad = Tensor::full([1, 4], 99i64, (Kind::Int64, Device::Cpu));
    let err = dispatched.forward(&bad).unwrap_err().to_string();
    assert!(err.contains("unit 0"), "{err}");
    for (name, t) in dispatched.model().named_parameters() {
        assert_eq!(name.starts_with("blocks.1."), t.numel() == 0, "{name}");
    }
    assert!(dispatched
        .forward(&x)
        .unwrap()
        .allclose(&want, 1e-5, 1e-5, false));
}
