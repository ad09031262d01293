//! hearth's GPT, loss, gradient clipping and optimizers against PyTorch: the
//! oracle (`tests/oracles/gpt_train_steps.py`) builds the peer benchmark's
//! own GPT class and checks each of hearth's training steps at hearth's own
//! weights: logits, loss, gradients and clip norm against float64 PyTorch
//! (hearth within 4 times float32 PyTorch's distance, plus 64 units of
//! float32 rounding of the largest value), and each optimizer step against
//! `torch.optim` from the same weights and gradients (within both sides'
//! rounding bounds). The oracle's docstring derives both tolerances; they
//! hold whatever instructions libtorch picks for the CPU, where comparing
//! two whole float32 runs cannot (Adam turns a last-place difference in a
//! near-zero gradient into a different step). The `_on_cuda` tests do the
//! same on a GPU (both sides in fp32 with TF32 off, libtorch's and
//! PyTorch's default); they are ignored without one.

use hearth::checkpoint::save_safetensors;
use hearth::data::{SortDigits, TokenDataset};
use hearth::models::{Gpt, GptConfig, Model};
use hearth::ops::{AdamHyper, SgdHyper};
use hearth::optim::{no_decay_groups, Adam, Optimizer, Sgd};
use hearth::train::lm_loss;
use rand::SeedableRng;
use std::process::Command;

use common::{python, repo_root, Limited};
use hearth_testkit as common;
use tch::{Device, Kind, Tensor};

const STEPS: usize = 20;

/// Trains a tiny GPT on the CPU for a few steps with `make_opt`, writes
/// everything the oracle needs to `dir`, and runs the oracle with
/// `optimizer_json`.
fn check_against_pytorch(
    name: &str,
    optimizer_json: &str,
    max_grad_norm: Option<(f64, f64)>,
    make_opt: impl Fn(Vec<(String, Tensor)>) -> Box<dyn Optimizer>,
) {
    check_on(Device::Cpu, name, optimizer_json, max_grad_norm, make_opt)
}

/// [`check_against_pytorch`] with hearth and the oracle both on `device`.
fn check_on(
    device: Device,
    name: &str,
    optimizer_json: &str,
    max_grad_norm: Option<(f64, f64)>,
    make_opt: impl Fn(Vec<(String, Tensor)>) -> Box<dyn Optimizer>,
) {
    let dir = common::scratch(&format!("parity-{name}"));
    let config = GptConfig {
        vocab_size: 11,
        block_size: 16,
        d_model: 32,
        layers: 2,
        heads: 4,
    };
    let model = {
        // The tests of this binary run side by side and libtorch's generator
        // is the process's: seeding and drawing under one lock gives every
        // test the same initial weights whatever runs beside it.
        static SEEDED_INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one_at_a_time = SEEDED_INIT.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(7);
        Gpt::new(config, device)
    };
    save_safetensors(&dir.join("init.safetensors"), &model.named_parameters()).unwrap();

    let batch = SortDigits::new(8).sample_batch(6, &mut rand_chacha::ChaCha8Rng::seed_from_u64(3));
    let (inputs, targets) = (
        batch.inputs.to_device(device),
        batch.targets.to_device(device),
    );
    let logits = tch::no_grad(|| model.forward_t(&inputs, false));

    let mut opt = make_opt(model.named_parameters());
    let mut losses = Vec::new();
    let mut norms = Vec::new();
    // Each step's weights before it and the gradients it stepped with.
    let mut steps: Vec<(String, Tensor)> = Vec::new();
    let copy_of = |t: &Tensor| t.detach().to_device(Device::Cpu).copy();
    for k in 0..STEPS {
        for (name, w) in model.named_parameters() {
            steps.push((format!("{k}/w/{name}"), copy_of(&w)));
        }
        let loss = lm_loss(&model.forward_t(&inputs, true), &targets);
        loss.backward();
        if let Some((max, norm_type)) = max_grad_norm {
            norms.push(
                f64::try_from(
                    hearth::accelerator::clip_grad_norm_(&opt.parameters(), max, norm_type)
                        .unwrap(),
                )
                .unwrap(),
            );
        }
        for (name, w) in model.named_parameters() {
            steps.push((format!("{k}/g/{name}"), copy_of(&w.grad())));
        }
        opt.step().unwrap();
        opt.zero_grad();
        losses.push(f64::try_from(&loss).unwrap());
    }
    save_safetensors(&dir.join("after.safetensors"), &model.named_parameters()).unwrap();
    save_safetensors(&dir.join("steps.safetensors"), &steps).unwrap();
    save_safetensors(
        &dir.join("io.safetensors"),
        &[
            ("inputs".into(), inputs),
            ("targets".into(), targets),
            ("logits".into(), logits),
            ("losses".into(), Tensor::from_slice(&losses)),
            (
                "norms".into(),
                Tensor::from_slice(&norms).to_kind(Kind::Double),
            ),
        ],
    )
    .unwrap();
    let spec = format!(
        r#"{{"vocab_size": 11, "block_size": 16, "d_model": 32, "layers": 2, "heads": 4, "steps": {STEPS}, "max_grad_norm": {}, "norm_type": {}, "optimizer": {optimizer_json}, "device": "{}"}}"#,
        max_grad_norm.map_or("null".to_string(), |(m, _)| m.to_string()),
        // Python's json reads Infinity.
        max_grad_norm.map_or("2.0".to_string(), |(_, p)| if p.is_infinite() {
            "Infinity".to_string()
        } else {
            p.to_string()
        }),
        if device.is_cuda() { "cuda" } else { "cpu" }
    );
    std::fs::write(dir.join("spec.json"), spec).unwrap();

    let out = Command::new(python())
        .arg(repo_root().join("tests/oracles/gpt_train_steps.py"))
        .arg(&dir)
        .run()
        .expect("the project's Python (.venv) runs; run `make setup`");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "PyTorch disagrees with hearth ({name}):\n{report}"
    );
    assert!(
        report.contains("agree"),
        "the oracle did not report agreement:\n{report}"
    );
}

fn tensors(named: Vec<(String, Tensor)>) -> Vec<Tensor> {
    named.into_iter().map(|(_, t)| t).collect()
}

#[test]
fn gpt_with_adamw_and_clipping_matches_pytorch() {
    adamw_and_clipping(Device::Cpu, "adamw", 0.5, 2.0);
}

/// Clipping by the L1 norm and by the largest gradient
/// (`clip_grad_norm_(.., norm_type)`), both clipping at every step, under
/// plain SGD: AdamW divides the clipping back out, and with gradients
/// clipped to a few percent its eps turns float32 rounding into steps
/// that part the two runs by ~1e-4.
#[test]
fn clipping_by_l1_and_infinity_norms_matches_pytorch() {
    plain_sgd_clipped("sgd-l1", 0.5, 1.0);
    plain_sgd_clipped("sgd-inf", 0.01, f64::INFINITY);
}

/// SGD at lr 0.05 without momentum or decay, clipping at `max_norm` by the
/// `norm_type` norm.
fn plain_sgd_clipped(name: &str, max_norm: f64, norm_type: f64) {
    let hyper = SgdHyper {
        lr: 0.05,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    check_against_pytorch(
        name,
        r#"{"kind": "sgd", "lr": 0.05, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": false}"#,
        Some((max_norm, norm_type)),
        |p| Box::new(Sgd::new(tensors(p), hyper)),
    );
}

/// AdamW with weight decay and gradient clipping at `max_norm` by the
/// `norm_type` norm, on `device`.
fn adamw_and_clipping(device: Device, name: &str, max_norm: f64, norm_type: f64) {
    let hyper = AdamHyper {
        lr: 1e-2,
        betas: (0.9, 0.95),
        weight_decay: 0.1,
        eps: 1e-8,
        decoupled: true,
    };
    check_on(
        device,
        name,
        r#"{"kind": "adamw", "lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1e-8}"#,
        Some((max_norm, norm_type)),
        |p| Box::new(Adam::new(tensors(p), hyper)),
    );
}

#[test]
fn gpt_with_adam_and_l2_decay_matches_pytorch() {
    let hyper = AdamHyper {
        lr: 5e-3,
        betas: (0.9, 0.999),
        weight_decay: 0.01,
        eps: 1e-8,
        decoupled: false,
    };
    check_against_pytorch(
        "adam",
        r#"{"kind": "adam", "lr": 0.005, "betas": [0.9, 0.999], "weight_decay": 0.01, "eps": 1e-8}"#,
        None,
        |p| Box::new(Adam::new(tensors(p), hyper)),
    );
}

/// Biases and layer norms in a second group with their own rate and no
/// weight decay, as in PyTorch's `param_groups`.
#[test]
fn adamw_param_groups_match_pytorch() {
    let hyper = AdamHyper {
        lr: 1e-2,
        betas: (0.9, 0.999),
        weight_decay: 0.1,
        eps: 1e-8,
        decoupled: true,
    };
    check_against_pytorch(
        "adamw-groups",
        r#"{"kind": "adamw", "lr": 0.01, "betas": [0.9, 0.999], "weight_decay": 0.1, "eps": 1e-8,
            "groups": [{"match": "", "exclude": ["bias", "ln"]}, {"match": ["bias", "ln"], "lr": 0.003, "weight_decay": 0.0}]}"#,
        None,
        |p| {
            let mut groups = no_decay_groups(p, &["bias", "ln"]);
            groups[1].lr = Some(3e-3);
            Box::new(Adam::new(groups, hyper))
        },
    );
}

/// `[optimizer] no-decay = ["bias", "ln"]` as `hearth run` reads it: the
/// biases and the LayerNorm weights go in a group without weight decay,
/// the rest decay — the groups PyTorch gets by name give the same steps.
#[test]
fn the_configs_no_decay_groups_match_pytorch() {
    let section: hearth::train::config::OptimizerSection = toml::from_str(
        "kind = \"adamw\"\nlr = 0.01\nweight-decay = 0.1\nno-decay = [\"bias\", \"ln\"]",
    )
    .unwrap();
    let hyper = AdamHyper {
        lr: section.lr(),
        betas: section.betas(),
        weight_decay: section.weight_decay(),
        eps: section.eps(),
        decoupled: true,
    };
    check_against_pytorch(
        "no-decay",
        r#"{"kind": "adamw", "lr": 0.01, "betas": [0.9, 0.999], "weight_decay": 0.1, "eps": 1e-8,
            "groups": [{"match": "", "exclude": ["bias", "ln"]}, {"match": ["bias", "ln"], "weight_decay": 0.0}]}"#,
        None,
        move |p| {
            let groups = section.param_groups(p);
            assert_eq!(groups.len(), 2, "a decayed group and an exempt one");
            Box::new(Adam::new(groups, hyper))
        },
    );
}

/// SGD with momentum and two parameter groups (biases at their own rate
/// and without weight decay), as PyTorch's `param_groups`.
#[test]
fn sgd_param_groups_match_pytorch() {
    let hyper = SgdHyper {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 1e-3,
        nesterov: false,
    };
    check_against_pytorch(
        "sgd-groups",
        r#"{"kind": "sgd", "lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.001, "nesterov": false,
            "groups": [{"match": "", "exclude": ["bias"]}, {"match": ["bias"], "lr": 0.05, "weight_decay": 0.0}]}"#,
        None,
        |p| {
            let mut groups = no_decay_groups(p, &["bias"]);
            groups[1].lr = Some(0.05);
            Box::new(Sgd::new(groups, hyper))
        },
    );
}

#[test]
fn gpt_with_nesterov_sgd_matches_pytorch() {
    nesterov_sgd(Device::Cpu, "sgd-nesterov");
}

/// SGD with Nesterov momentum and weight decay, on `device`.
fn nesterov_sgd(device: Device, name: &str) {
    let hyper = SgdHyper {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 1e-3,
        nesterov: true,
    };
    check_on(
        device,
        name,
        r#"{"kind": "sgd", "lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.001, "nesterov": true}"#,
        None,
        |p| Box::new(Sgd::new(tensors(p), hyper)),
    );
}

#[test]
fn gpt_with_plain_sgd_matches_pytorch() {
    plain_sgd_clipped("sgd", 1.0, 2.0);
}

/// The AdamW case on a GPU: hearth's CUDA kernels (its fused AdamW,
/// clipping, SDPA) against PyTorch's on the same GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpt_with_adamw_and_clipping_matches_pytorch_on_cuda() {
    assert!(
        hearth::ops::cuda::is_available(),
        "this test needs a CUDA GPU"
    );
    adamw_and_clipping(Device::Cuda(0), "adamw-cuda", 0.5, 2.0);
}

/// Nesterov SGD on a GPU, against PyTorch's on the same GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpt_with_nesterov_sgd_matches_pytorch_on_cuda() {
    assert!(
        hearth::ops::cuda::is_available(),
        "this test needs a CUDA GPU"
    );
    nesterov_sgd(Device::Cuda(0), "sgd-nesterov-cuda");
}
