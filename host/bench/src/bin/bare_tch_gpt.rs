//! The whole-process row of `make bench` done with tch alone, as a floor for
//! hearth's figures: the bench GPT (hearth's `Gpt`: the peer's ops, but for
//! hearth's fused GELU and attention on a CPU with AVX2), one AdamW step on one batch of 16 × 128 random tokens
//! (written out with tch ops, as PyTorch's non-fused AdamW does it),
//! `model.safetensors` written with tch, and a plain return from `main`.
//! No accelerator, config, plugins or trackers.
//!
//! Usage: `bare_tch_gpt OUT_DIR` (examples/bench/startup_vs_accelerate.py).

use hearth::models::{Gpt, GptConfig, Model};
use tch::{Device, Kind, Tensor};

fn main() {
    let out = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .expect("usage: bare_tch_gpt OUT_DIR"),
    );
    std::fs::create_dir_all(&out).expect("creating OUT_DIR");
    tch::manual_seed(0);
    let (vocab, block, batch) = (256, 128, 16);
    let model = Gpt::new(
        GptConfig {
            vocab_size: vocab,
            block_size: block,
            d_model: 128,
            layers: 4,
            heads: 4,
        },
        Device::Cpu,
    );
    let x = Tensor::randint(vocab, [batch, block + 1], (Kind::Int64, Device::Cpu));
    let logits = model.forward_t(&x.narrow(1, 0, block), true);
    let loss = logits
        .reshape([-1, vocab])
        .cross_entropy_for_logits(&x.narrow(1, 1, block).reshape([-1]));
    loss.backward();

    let (lr, beta1, beta2, eps, weight_decay) = (3e-4, 0.9, 0.999, 1e-8, 0.01);
    // The optimizer's state lives on, as an optimizer's would.
    let _state: Vec<(Tensor, Tensor)> = tch::no_grad(|| {
        model
            .named_parameters()
            .into_iter()
            .map(|(_, mut p)| {
                let g = p.grad();
                let m = &g * (1.0 - beta1);
                let v = &g * &g * (1.0 - beta2);
                let denom = (&v / (1.0 - beta2)).sqrt() + eps;
                let _ = p.g_mul_scalar_(1.0 - lr * weight_decay);
                let _ = p.g_sub_(&(&m / denom * (lr / (1.0 - beta1))));
                p.zero_grad();
                (m, v)
            })
            .collect()
    });
    Tensor::write_safetensors(&model.named_parameters(), out.join("model.safetensors"))
        .expect("writing model.safetensors");
}
