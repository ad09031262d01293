//! FSDP's `mixed-precision-policy` against PyTorch FSDP2's
//! `MixedPrecisionPolicy`: hearth trains a small GPT under FULL_SHARD with
//! parameters gathered in bfloat16 and gradients reduced in float32, and
//! again without a policy; the oracle (`tests/oracles/fsdp2_mixed_precision.py`)
//! shards the peer benchmark's GPT class with `fully_shard` and that
//! policy (a world of one, gloo), loads hearth's initial weights and
//! replays the same AdamW steps. hearth's policy run must agree with
//! PyTorch's far better than its float32 run does.

use hearth::accelerator::Accelerator;
use hearth::checkpoint::save_safetensors;
use hearth::models::{Gpt, GptConfig, Model};
use hearth::ops::AdamHyper;
use hearth::optim::Adam;
use hearth::parallel::{FsdpPlugin, ShardingStrategy, SyncStats};
use tch::{Device, Kind, Tensor};

use hearth_testkit as common;

const STEPS: usize = 8;
const CONFIG: GptConfig = GptConfig {
    vocab_size: 64,
    block_size: 16,
    d_model: 32,
    layers: 2,
    heads: 4,
};

/// The model's weights before training, the inputs and the targets.
fn start() -> (Vec<(String, Tensor)>, Tensor, Tensor) {
    tch::manual_seed(11);
    let model = Gpt::new(CONFIG, Device::Cpu);
    let init = model
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.detach().copy()))
        .collect();
    let tokens = Tensor::randint(64, [4, 17], (Kind::Int64, Device::Cpu));
    (init, tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16))
}

/// Trains from `init` under FULL_SHARD with `policy` (any policy shards a
/// world of one, as FSDP does; `fp32` casts nothing); returns the losses,
/// the final weights (float32, gathered) and the collectives' statistics.
fn train(
    init: &[(String, Tensor)],
    x: &Tensor,
    y: &Tensor,
    policy: &str,
) -> (Vec<f64>, Vec<(String, Tensor)>, SyncStats) {
    let model = Gpt::new(CONFIG, Device::Cpu);
    tch::no_grad(|| {
        for ((_, p), (_, v)) in model.named_parameters().iter().zip(init) {
            p.detach().copy_(v);
        }
    });
    let mut acc = Accelerator::builder()
        .cpu(true)
        .fsdp(FsdpPlugin {
            sharding_strategy: Some(ShardingStrategy::FullShard),
            auto_wrap_policy: Some("transformer-based".into()),
            transformer_cls_names_to_wrap: Some(vec!["Block".into()]),
            mixed_precision_policy: Some(policy.into()),
            ..Default::default()
        })
        .plugin_path(hearth::plugins::SearchPath::only([(
            hearth::plugins::PluginSource::BuiltIn,
            common::repo_root().join("target/plugins"),
        )]))
        .build()
        .unwrap();
    let params = model
        .named_parameters()
        .into_iter()
        .map(|(_, p)| p)
        .collect::<Vec<_>>();
    let hyper = AdamHyper {
        weight_decay: 0.01,
        ..AdamHyper::adamw(3e-3)
    };
    let (model, mut opt) = acc.prepare((model, Adam::new(params, hyper))).unwrap();
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let logits = model.forward_t(x, true);
        let loss = logits
            .to_kind(Kind::Float)
            .view([-1, 64])
            .cross_entropy_for_logits(&y.reshape([-1]));
        acc.backward(&loss).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        losses.push(f64::try_from(&loss).unwrap());
    }
    // The optimizer steps float32 shards, with float32 state.
    assert!(opt.parameters().iter().all(|p| p.kind() == Kind::Float));
    let state = opt.with_inner(|o| o.state_dict()).tensors;
    assert!(state.iter().all(|(_, t)| t.kind() == Kind::Float));
    let stats = acc.gradient_sync_stats();
    (losses, acc.get_state_dict(&model), stats)
}

#[test]
fn a_bf16_param_fp32_reduce_policy_trains_what_pytorch_fsdp2_does() {
    let dir = common::scratch("fsdp-mixed-precision");
    let (init, x, y) = start();
    let (mp_losses, mp, mp_stats) = train(&init, &x, &y, "param_dtype=bf16,reduce_dtype=fp32");
    let (fp32_losses, fp32, fp32_stats) = train(&init, &x, &y, "fp32");
    // Gathered for use in bfloat16: half the bytes of float32 gathers
    // (`prepare`'s one gather of everything, for the optimizer, is exact:
    // float32 in both); reduced in float32: the same bytes.
    assert_eq!(mp_stats.gathers, fp32_stats.gathers);
    let at_prepare: u64 = init.iter().map(|(_, t)| 4 * t.numel() as u64).sum();
    assert_eq!(
        2 * (mp_stats.gather_bytes - at_prepare),
        fp32_stats.gather_bytes - at_prepare
    );
    assert_eq!(mp_stats.bytes, fp32_stats.bytes);
    assert!(mp_losses != fp32_losses, "the policy changed nothing");
    // Reduced in bfloat16 too: half the bytes.
    let (_, _, bf16_stats) = train(&init, &x, &y, "bf16");
    assert_eq!(2 * bf16_stats.bytes, fp32_stats.bytes);

    save_safetensors(&dir.join("init.safetensors"), &init).unwrap();
    save_safetensors(&dir.join("after_mp.safetensors"), &mp).unwrap();
    save_safetensors(&dir.join("after_fp32.safetensors"), &fp32).unwrap();
    save_safetensors(
        &dir.join("io.safetensors"),
        &[
            ("inputs".into(), x),
            ("targets".into(), y),
            ("losses_mp".into(), Tensor::from_slice(&mp_losses)),
            ("losses_fp32".into(), Tensor::from_slice(&fp32_losses)),
        ],
    )
    .unwrap();
    std::fs::write(
        dir.join("spec.json"),
        format!(
            r#"{{"vocab_size": 64, "block_size": 16, "d_model": 32, "layers": 2, "heads": 4, "steps": {STEPS}, "lr": 0.003, "weight_decay": 0.01}}"#
        ),
    )
    .unwrap();
    let report = common::oracle("fsdp2_mixed_precision.py", &[dir.to_str().unwrap()]);
    eprintln!("{report}");
    assert!(report.contains("agree"), "{report}");
}
