//! A traced transformers Llama loaded without its weights
//! (`TorchScriptModel::load_lazily`): it takes no memory until its tensors
//! are read, reading one unit takes that unit's memory only, and once read
//! every tensor and the logits are those of the file loaded whole by
//! libtorch (`torch.jit.load`'s values, bit for bit).

use hearth::models::{Model, TorchScriptModel, Weights};
use hearth_testkit as common;
use serde_json::json;
use tch::{Device, Kind, Tensor};

const LAYERS: usize = 4;

/// This process's resident memory in bytes (/proc/self/statm).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// Run alone (its own process, one test thread), so that no other test's
/// memory moves its measure; writes what it saw.
#[test]
fn child_lazy_load() {
    if std::env::var(common::CHILD).is_err() {
        return; // only under its parent test
    }
    let dir = std::path::PathBuf::from(std::env::var(common::OUT).unwrap());
    let path = dir.join("llama").join("model.pt");
    // libtorch's TorchScript machinery takes its own memory on first use.
    drop(TorchScriptModel::load_lazily(&path, true, Weights::Initialised).unwrap());
    let before = resident_bytes();
    let lazy = TorchScriptModel::load_lazily(&path, true, Weights::Initialised).unwrap();
    let grown_loading = resident_bytes().saturating_sub(before);
    let params = lazy.named_parameters();
    let weight_bytes: u64 = params.iter().map(|(_, p)| bytes(p)).sum();
    let layer: Vec<String> = params
        .iter()
        .map(|(n, _)| n.clone())
        .filter(|n| n.starts_with("m.model.layers.0."))
        .collect();
    let layer_bytes: u64 = params
        .iter()
        .filter(|(n, _)| layer.contains(n))
        .map(|(_, p)| bytes(p))
        .sum();
    lazy.materialize(Some(&layer)).unwrap();
    let grown_one_layer = resident_bytes().saturating_sub(before);
    lazy.materialize(None).unwrap();
    let grown_all = resident_bytes().saturating_sub(before);
    let whole = TorchScriptModel::load(&path, Device::Cpu).unwrap();
    let same_tensors = whole
        .named_state()
        .iter()
        .zip(lazy.named_state())
        .all(|((a, x), (b, y))| *a == b && x.equal(&y));
    let units: Vec<String> = (0..LAYERS).map(|i| format!("m.model.layers.{i}")).collect();
    lazy.cut_at(&units).unwrap();
    let tokens = Tensor::randint(256, [2, 16], (Kind::Int64, Device::Cpu));
    let (a, b) = tch::no_grad(|| {
        (
            whole.forward_t(&tokens, false),
            lazy.forward_t(&tokens, false),
        )
    });
    common::write_result(
        0,
        &json!({
            "weight_bytes": weight_bytes, "layer_bytes": layer_bytes,
            "grown_loading": grown_loading, "grown_one_layer": grown_one_layer, "grown_all": grown_all,
            "same_tensors": same_tensors, "same_logits": a.equal(&b), "pieces": lazy.piece_count(),
        }),
    );
}

#[test]
fn a_traced_llama_loaded_lazily_takes_memory_only_as_its_tensors_are_read() {
    let dir = common::scratch("lazy-load");
    let sizes = json!({"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": LAYERS,
                       "num_attention_heads": 8, "num_key_value_heads": 8});
    let spec = json!({"family": "llama", "out": dir.join("out").join("llama"), "sizes": sizes});
    // The child's folder is emptied by mpirun_command: make the model in it after.
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    common::oracle("traced_causal_lm.py", &[&spec.to_string()]);
    let run = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &common::child!("child_lazy_load"),
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(common::CHILD, "lazy")
        .env(common::OUT, &out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let got = &common::results(&out, 1)[0];
    let at = |k: &str| got[k].as_u64().unwrap();
    let (weights, layer) = (at("weight_bytes"), at("layer_bytes"));
    assert!(weights > 40 << 20, "a model of some size: {got}");
    // Loading read the graph and the buffers, not the weights.
    assert!(at("grown_loading") < weights / 8, "{got}");
    // One decoder layer read: about its own bytes more.
    assert!(
        at("grown_one_layer") < at("grown_loading") + layer + weights / 8,
        "{got}"
    );
    assert!(
        at("grown_one_layer") + weights / 2 < at("grown_all") + layer,
        "{got}"
    );
    assert!(
        at("grown_all") > weights * 3 / 4,
        "all read: the weights are in memory: {got}"
    );
    assert_eq!(got["same_tensors"], true, "the file's values: {got}");
    assert_eq!(got["same_logits"], true, "{got}");
    assert_eq!(
        got["pieces"],
        LAYERS + 2,
        "before the layers, each layer, after them"
    );
}
