//! Loading a checkpoint onto a device map with some modules on the disk,
//! and running the dispatched model: its logits equal the plain model's,
//! Accelerate's own dispatched model's, and those of a PyTorch model whose
//! offloaded weights Accelerate's `load_offloaded_weights` read from
//! hearth's offload folder (`tests/oracles/accelerate_dispatch.py`). And
//! the bad inputs, each refused before anything is written.

use hearth_testkit as common;

mod lazy;
mod tied_weights;

use common::scratch;
use hearth::big_model::{
    dispatch_model, load_checkpoint_in_model, BigModelError, DeviceMap, DispatchOptions,
    LoadOptions, MapDevice, OFFLOAD_INDEX_NAME,
};
use hearth::checkpoint::{load_safetensors, save_model};
use hearth::models::{Gpt, GptConfig, Model};
use serde_json::{json, Value};
use std::path::Path;
use tch::{Device, Kind, Tensor};

const CONFIG: GptConfig = GptConfig {
    vocab_size: 41,
    block_size: 16,
    d_model: 32,
    layers: 3,
    heads: 4,
};

fn sizes() -> Value {
    json!({"vocab_size": 41, "block_size": 16, "d_model": 32, "layers": 3, "heads": 4})
}

/// A trained-looking GPT saved as a sharded checkpoint (several files and
/// an index), and the model it came from.
fn checkpoint(dir: &Path) -> Gpt {
    tch::manual_seed(7);
    let model = Gpt::new(CONFIG, Device::Cpu);
    let saved = save_model(dir, &model.named_parameters(), 20_000).unwrap();
    assert!(saved.files.len() > 2, "a sharded checkpoint");
    model
}

/// Whole modules, a block split across the CPU and the disk, and the
/// head on the disk.
fn device_map() -> DeviceMap {
    let cpu = MapDevice::Cpu;
    let disk = MapDevice::Disk;
    [
        ("tok", cpu),
        ("pos", disk),
        ("blocks.0", cpu),
        ("blocks.1.ln1", disk),
        ("blocks.1.qkv", cpu),
        ("blocks.1.proj", disk),
        ("blocks.1.ln2", cpu),
        ("blocks.1.fc", disk),
        ("blocks.1.out", cpu),
        ("blocks.2", disk),
        ("ln", cpu),
        ("head", disk),
    ]
    .into_iter()
    .map(|(k, d)| (k.to_string(), d))
    .collect()
}

fn tokens() -> Tensor {
    tch::manual_seed(3);
    Tensor::randint(CONFIG.vocab_size, [2, 16], (Kind::Int64, Device::Cpu))
}

fn on_disk(map: &DeviceMap, name: &str) -> bool {
    hearth::big_model::device_of(map, name) == Some(MapDevice::Disk)
}

/// Every file under `dir`, relative, sorted.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p.clone());
            }
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
        }
    }
    out.sort();
    out
}

#[test]
fn a_gpt_with_modules_on_the_disk_gives_the_plain_models_and_accelerates_logits() {
    let dir = scratch("dispatch");
    let ckpt = dir.join("ckpt");
    let original = checkpoint(&ckpt);
    let x = tokens();
    let plain = tch::no_grad(|| original.forward_t(&x, false));

    let map = device_map();
    let offload = dir.join("offload");
    let model = Gpt::unmaterialised(CONFIG, Device::Cpu);
    let options = LoadOptions {
        device_map: Some(map.clone()),
        offload_folder: Some(offload.clone()),
        ..Default::default()
    };
    let loaded = load_checkpoint_in_model(&model, &ckpt, &options).unwrap();
    assert!(loaded.unexpected.is_empty());
    // The disk's tensors are in the folder, and hold nothing in the model.
    for (name, t) in model.named_parameters() {
        assert_eq!(
            on_disk(&map, &name),
            loaded.offload_index.contains_key(&name),
            "{name}"
        );
        assert_eq!(on_disk(&map, &name), t.numel() == 0, "{name}");
    }
    assert!(offload.join(OFFLOAD_INDEX_NAME).is_file());
    assert!(offload.join("blocks.2.fc.weight.dat").is_file());

    let dispatched = dispatch_model(
        Box::new(model),
        &map,
        &DispatchOptions {
            offload_dir: Some(offload.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let logits = dispatched.forward(&x).unwrap();
    assert!(
        logits.equal(&plain),
        "the dispatched model computes what the plain one does"
    );
    // The offloaded weights were dropped again after their unit ran.
    for (name, t) in dispatched.model().named_parameters() {
        assert_eq!(on_disk(&map, &name), t.numel() == 0, "{name} after forward");
    }
    assert_eq!(dispatched.offloaded().len(), loaded.offload_index.len());
    // A second run reads them again.
    assert!(dispatched.forward(&x).unwrap().equal(&plain));

    // Accelerate, on the same checkpoint and map, and reading our folder.
    let out = dir.join("oracle.safetensors");
    let map_json: serde_json::Map<String, Value> =
        map.iter().map(|(k, d)| (k.clone(), json!(d))).collect();
    let tokens: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(&x).unwrap();
    let report: Value = serde_json::from_str(&common::oracle(
        "accelerate_dispatch.py",
        &[&json!({
            "sizes": sizes(),
            "checkpoint": ckpt,
            "device_map": map_json,
            "hearth_offload": offload,
            "accelerate_offload": dir.join("accelerate-offload"),
            "tokens": tokens,
            "out": out,
        })
        .to_string()],
    ))
    .unwrap();
    assert_eq!(
        report["hearth_index"], report["accelerate_index"],
        "offload indexes"
    );
    assert_eq!(report["dat_differ"], json!([]), "offloaded bytes");
    for (name, theirs) in load_safetensors(&out, Device::Cpu).unwrap() {
        assert!(
            logits.allclose(&theirs, 1e-5, 1e-5, false),
            "{name}: max difference {}",
            (&logits - &theirs).abs().max()
        );
    }

    // Accelerate's verify_device_map: true for this map, false for a
    // model dispatched whole onto the CPU.
    let acc = hearth::accelerator::Accelerator::builder()
        .cpu(true)
        .build()
        .unwrap();
    let whole: DeviceMap = [(String::new(), MapDevice::Cpu)].into_iter().collect();
    let whole = dispatch_model(
        Box::new(Gpt::new(CONFIG, Device::Cpu)),
        &whole,
        &DispatchOptions::default(),
    )
    .unwrap();
    assert_eq!(
        json!({"mapped": acc.verify_device_map(&dispatched), "whole": acc.verify_device_map(&whole)}),
        report["verify_device_map"]
    );
    assert_eq!(
        report["verify_device_map"],
        json!({"mapped": true, "whole": false})
    );
}

#[test]
fn a_dtype_loads_floats_in_it_and_keeps_fp32_modules_whole() {
    let dir = scratch("dispatch-dtype");
    let ckpt = dir.join("ckpt");
    checkpoint(&ckpt);
    let model = Gpt::unmaterialised(CONFIG, Device::Cpu);
    let options = LoadOptions {
        device_map: Some(device_map()),
        offload_folder: Some(dir.join("offload")),
        dtype: Some(Kind::Half),
        keep_in_fp32_modules: vec!["ln".into()],
        ..Default::default()
    };
    let loaded = load_checkpoint_in_model(&model, &ckpt, &options).unwrap();
    for (name, t) in model.named_parameters() {
        // Accelerate's rule keeps a name in float32 when it holds `ln` and
        // `ln.`: the final LayerNorm, not the blocks' `ln1` and `ln2`
        // (offloaded tensors hold no data, in the dtype they will load in).
        let fp32 = name.starts_with("ln.");
        let want = if fp32 { Kind::Float } else { Kind::Half };
        assert_eq!(t.kind(), want, "{name}");
    }
    // The disk holds the checkpoint's dtype, as Accelerate's does.
    assert_eq!(loaded.offload_index["head.weight"].dtype, "float32");
}

#[test]
fn bad_inputs_are_refused_before_anything_is_written() {
    let dir = scratch("dispatch-bad");
    let ckpt = dir.join("ckpt");
    checkpoint(&ckpt);
    let before = files_under(&dir);
    let offload = dir.join("offload");
    let load = |map: DeviceMap, folder: Option<&Path>, path: &Path| {
        let model = Gpt::unmaterialised(CONFIG, Device::Cpu);
        let options = LoadOptions {
            device_map: Some(map),
            offload_folder: folder.map(Path::to_path_buf),
            ..Default::default()
        };
        load_checkpoint_in_model(&model, path, &options).map(|_| ())
    };

    // A checkpoint without a tensor the map sends to the disk.
    let partial = dir.join("partial");
    let mut all = Vec::new();
    for f in std::fs::read_dir(&ckpt).unwrap().flatten() {
        if f.path().extension().is_some_and(|e| e == "safetensors") {
            all.extend(load_safetensors(&f.path(), Device::Cpu).unwrap());
        }
    }
    all.retain(|(n, _)| n != "blocks.2.qkv.weight");
    save_model(&partial, &all, 1 << 30).unwrap();
    let before_partial = files_under(&dir);
    let err = load(device_map(), Some(&offload), &partial).unwrap_err();
    assert!(
        matches!(&err, BigModelError::MissingMapped { name, device: MapDevice::Disk, .. } if name == "blocks.2.qkv.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("blocks.2.qkv.weight"), "{err}");

    // The disk without an offload folder.
    let err = load(device_map(), None, &ckpt).unwrap_err().to_string();
    assert!(
        err.contains("offload folder") && err.contains("pos"),
        "{err}"
    );

    // A checkpoint of another model (wider): the shape is named.
    let wide = dir.join("wide");
    let other = Gpt::new(
        GptConfig {
            d_model: 16,
            heads: 2,
            ..CONFIG
        },
        Device::Cpu,
    );
    save_model(&wide, &other.named_parameters(), 1 << 30).unwrap();
    let before_wide = files_under(&dir);
    let err = load(device_map(), Some(&offload), &wide)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("does not fit the model") && err.contains("shape"),
        "{err}"
    );

    // A map that leaves tensors without a device.
    let mut short = device_map();
    short.shift_remove("head");
    let err = load(short, Some(&offload), &ckpt).unwrap_err().to_string();
    assert!(err.contains("head.weight, head.bias"), "{err}");

    assert!(!offload.exists(), "a refused load wrote its offload folder");
    assert_eq!(files_under(&dir), before_wide);
    assert!(before_partial.len() > before.len() && before_wide.len() > before_partial.len());
}

/// The TorchScript TiedNet (a root parameter, tied embedding and head,
/// BatchNorm buffers) loaded from another model's checkpoint with blocks
/// on the disk: the logits of the checkpoint's own model and of
/// Accelerate's dispatched one, with and without offloaded buffers.
#[test]
fn a_torchscript_model_with_ties_and_buffers_on_the_disk_gives_the_checkpoints_logits() {
    use hearth::models::TorchScriptModel;
    for offload_buffers in [false, true] {
        let dir = scratch("dispatch-ts");
        let (ckpt, script, offload) = (dir.join("ckpt"), dir.join("tied.pt"), dir.join("offload"));
        let out = dir.join("oracle.safetensors");
        let map: DeviceMap = [
            ("scale", MapDevice::Cpu),
            ("tok", MapDevice::Cpu),
            ("blocks.0", MapDevice::Disk),
            ("blocks.1", MapDevice::Cpu),
            ("blocks.2", MapDevice::Disk),
            ("norm", MapDevice::Disk),
            ("head", MapDevice::Cpu),
        ]
        .into_iter()
        .map(|(k, d)| (k.to_string(), d))
        .collect();
        let map_json: serde_json::Map<String, Value> =
            map.iter().map(|(k, d)| (k.clone(), json!(d))).collect();
        let x = Tensor::randint(23, [2, 12], (Kind::Int64, Device::Cpu));
        let tokens: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(&x).unwrap();
        let report = common::oracle(
            "accelerate_dispatch.py",
            &[&json!({
                "sizes": {"vocab_size": 23, "d_model": 16, "layers": 3},
                "checkpoint": ckpt,
                "save": script,
                "device_map": map_json,
                "accelerate_offload": dir.join("accelerate-offload"),
                "offload_buffers": offload_buffers,
                "tokens": tokens,
                "out": out,
            })
            .to_string()],
        );
        let report: Value = serde_json::from_str(&report).unwrap();
        let model = TorchScriptModel::load(&script, Device::Cpu).unwrap();
        assert_eq!(
            model.named_buffers().len(),
            9,
            "three BatchNorms' statistics"
        );
        let options = LoadOptions {
            device_map: Some(map.clone()),
            offload_folder: Some(offload.clone()),
            offload_buffers,
            ..Default::default()
        };
        let loaded = load_checkpoint_in_model(&model, &ckpt, &options).unwrap();
        let buffer_offloaded = loaded
            .offload_index
            .contains_key("blocks.0.bn.running_mean");
        assert_eq!(buffer_offloaded, offload_buffers);
        let dispatched = dispatch_model(
            Box::new(model),
            &map,
            &DispatchOptions {
                offload_dir: Some(offload),
                offload_buffers,
                ..Default::default()
            },
        )
        .unwrap();
        // Cut at the map's modules: each runs with only its tensors brought
        // in (the scripted forward's calls of tok, the blocks, norm, head).
        assert!(
            dispatched.model().units().len() >= 6,
            "cut at the map's modules"
        );
        assert!(
            dispatched
                .notes()
                .warnings
                .iter()
                .all(|w| !w.contains("runs whole")),
            "{:?}",
            dispatched.notes()
        );
        let logits = dispatched.forward(&x).unwrap();
        let theirs: std::collections::HashMap<String, Tensor> = load_safetensors(&out, Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
        let close = |name: &str| {
            let diff = f64::try_from((&logits - &theirs[name]).abs().max()).unwrap();
            assert!(
                diff < 1e-5,
                "{name} (offload_buffers {offload_buffers}): max difference {diff}"
            );
        };
        close("checkpoint_model");
        if offload_buffers {
            close("accelerate");
        } else {
            // Accelerate leaves the buffers of a module on the disk as the
            // fresh model had them (it loads neither them nor offloads
            // them); hearth loads them, so only hearth gives the
            // checkpoint's logits here.
            assert_eq!(report["accelerate_loaded_disk_buffers"], false);
            assert!(!logits.allclose(&theirs["accelerate"], 1e-3, 1e-3, false));
        }
    }
}

/// Offload folders are Accelerate's both ways, in every dtype both sides
/// store (bfloat16 as the int16 Accelerate writes, scalars as one element).
#[test]
fn offload_folders_are_read_by_accelerate_and_accelerates_by_hearth() {
    use hearth::big_model::{offload_state_dict, OffloadedWeightsLoader};
    use hearth::checkpoint::save_safetensors;
    let dir = scratch("offload-both-ways");
    tch::manual_seed(11);
    let base = Tensor::randn([3, 5], (Kind::Float, Device::Cpu));
    let tensors: Vec<(String, Tensor)> = vec![
        ("a.float32".into(), base.shallow_clone()),
        ("a.float16".into(), base.to_kind(Kind::Half)),
        ("a.bfloat16".into(), base.to_kind(Kind::BFloat16)),
        ("b.float64".into(), base.to_kind(Kind::Double)),
        ("b.int64".into(), (&base * 100).to_kind(Kind::Int64)),
        ("c.uint8".into(), (base.abs() * 30).to_kind(Kind::Uint8)),
        ("c.bool".into(), base.gt(0.0)),
        ("scalar".into(), Tensor::from(2.5f32)),
    ];
    let file = dir.join("tensors.safetensors");
    save_safetensors(&file, &tensors).unwrap();
    let (ours, theirs) = (dir.join("hearth"), dir.join("accelerate"));
    offload_state_dict(&ours, &tensors).unwrap();
    let report: Value = serde_json::from_str(&common::oracle(
        "accelerate_offload.py",
        &[&json!({"tensors": file, "write": theirs, "read": ours}).to_string()],
    ))
    .unwrap();
    for (name, _) in &tensors {
        assert_eq!(
            report["read_equal"][name], true,
            "Accelerate read {name} from hearth's folder"
        );
    }
    let loader = OffloadedWeightsLoader::new(Default::default(), Some(theirs), None).unwrap();
    let mut names = loader.keys();
    names.sort();
    let mut want: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
    want.sort();
    assert_eq!(names, want);
    for (name, t) in &tensors {
        let got = loader.get(name).unwrap();
        assert_eq!((got.kind(), got.size()), (t.kind(), t.size()), "{name}");
        assert!(got.equal(t), "hearth read {name} from Accelerate's folder");
    }
}

/// An offload index as transformers writes it: entries naming a
/// safetensors file by its path, with no shape (and here no dtype).
#[test]
fn an_index_of_safetensors_entries_is_read_from_the_files_it_names() {
    use hearth::big_model::OffloadedWeightsLoader;
    let dir = scratch("offload-safetensors");
    let file = dir.join("weights.safetensors");
    let w = Tensor::from_slice(&[1.5f32, 2.5, -1.0]);
    hearth::checkpoint::save_safetensors(&file, &[("inner.w".into(), w.shallow_clone())]).unwrap();
    std::fs::write(
        dir.join("index.json"),
        json!({"w": {"safetensors_file": file, "weight_name": "inner.w"}, "h": {"safetensors_file": file, "weight_name": "inner.w", "dtype": "float16"}}).to_string(),
    )
    .unwrap();
    let loader =
        OffloadedWeightsLoader::new(Default::default(), Some(dir.to_path_buf()), None).unwrap();
    assert!(loader.get("w").unwrap().equal(&w));
    assert_eq!(loader.get("h").unwrap().kind(), Kind::Half);
}
