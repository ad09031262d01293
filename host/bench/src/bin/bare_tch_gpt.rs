//! The whole-process row of `make bench` done with tch alone, as a floor for
//! hearth's figures: the bench GPT (hearth's `Gpt`: the peer's ops, but for
//! hearth's fused GELU and attention on a CPU with AVX2), one AdamW step on one batch of 16 × 128 random tokens
//! (libtorch's `_fused_adamw_`, as hearth and `AdamW(fused=True)` run it),
//! `model.safetensors` written with tch, and `_exit` (as `hearth` ends).
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

    // One step of libtorch's `_fused_adamw_` (`AdamW(fused=True)`, what
    // hearth and the peer both run); its state lives on, as an optimizer's would.
    let params: Vec<Tensor> = model
        .named_parameters()
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
    let zeros = || -> Vec<Tensor> { params.iter().map(Tensor::zeros_like).collect() };
    let (exp_avgs, exp_avg_sqs) = (zeros(), zeros());
    let steps: Vec<Tensor> = params.iter().map(|_| Tensor::from(0f32)).collect();
    hearth_ops::fused_adam(
        &params,
        &grads,
        &exp_avgs,
        &exp_avg_sqs,
        &steps,
        hearth_ops::AdamHyper::adamw(3e-4),
        None,
    )
    .expect("one fused AdamW step");
    Tensor::write_safetensors(&model.named_parameters(), out.join("model.safetensors"))
        .expect("writing model.safetensors");
    // As hearth ends: without libtorch's static destructors.
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: everything written is flushed; `_exit` skips the C++ static
    // destructors (libtorch deregistering its operators), which is the point.
    unsafe { libc::_exit(0) }
}
