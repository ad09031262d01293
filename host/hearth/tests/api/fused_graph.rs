//! A user's TorchScript model fused (`TorchScriptModel::load`, host/ops
//! `jit_fuse.cpp`) against PyTorch: the oracle
//! (`tests/oracles/gpt2_fused_graph.py`) exports a transformers GPT-2 with
//! `torch.jit.trace` and computes its logits and gradients on one batch in
//! float64 (eager) and in float32 (the traced graph, op by op). hearth's
//! fused graph must be within 4 times float32 libtorch's distance from
//! float64, plus 64 units of float32 rounding of the largest value — the
//! bound of `pytorch_parity`, derived in the oracle's docstring — on
//! whatever CPU level libtorch runs (tests/isa/levels.sh runs it at each).
//! The Llama-family rewrites are held to the same bound on traced Llama,
//! Qwen2 and Mistral (`tests/oracles/llama_fused_graph.py`), and with the
//! pattern kernels' deliberate error (`kPatternOff`) they must miss it.

use hearth::models::{Model, TorchScriptModel};
use hearth::ops::masked_attention_calls;
use hearth::train::lm_loss;
use hearth_testkit as common;
use std::collections::HashMap;
use tch::{Device, Kind, Tensor};

fn read(path: &std::path::Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .into_iter()
        .collect()
}

/// The oracle's folder (the traced module; removed when dropped), its
/// batch and its values.
type Oracle = (
    common::Scratch,
    HashMap<String, Tensor>,
    HashMap<String, Tensor>,
);

/// The GPT-2 oracle run for one of its export forms: `cache`, `no-cache`
/// or `padded` (see its docstring).
fn run_oracle(name: &str, form: &str) -> Oracle {
    run_oracle_of(name, "gpt2_fused_graph.py", &[form])
}

/// An oracle `script` run with a scratch folder and `args`.
fn run_oracle_of(name: &str, script: &str, args: &[&str]) -> Oracle {
    let dir = common::scratch(name);
    let mut all = vec![dir.to_str().unwrap()];
    all.extend_from_slice(args);
    common::oracle(script, &all);
    let batch = read(&dir.join("batch.safetensors"));
    let theirs = read(&dir.join("pytorch.safetensors"));
    (dir, batch, theirs)
}

/// The largest absolute difference between `a` and `b`, in float64.
fn distance(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// `got`'s distance from float64 `exact` in units of its bound, 4 ×
/// float32 libtorch's distance plus 64 float32 units of the largest exact
/// value: above 1 misses.
fn against_bound(got: &Tensor, f32_libtorch: &Tensor, exact: &Tensor) -> f64 {
    let largest = exact.abs().max().double_value(&[]);
    let bound = 4.0 * distance(f32_libtorch, exact) + 64.0 * f64::from(f32::EPSILON) * largest;
    distance(got, exact) / bound
}

/// `got` against float64 `exact` within the bound of [`against_bound`].
fn check(what: &str, got: &Tensor, f32_libtorch: &Tensor, exact: &Tensor) {
    let ratio = against_bound(got, f32_libtorch, exact);
    assert!(
        ratio <= 1.0,
        "{what}: fused is {:e} from float64, {ratio:.2} of the bound \
         (float32 libtorch is {:e} away)",
        distance(got, exact),
        distance(f32_libtorch, exact)
    );
}

/// One training step of `model` on the oracle's batch: the worst of its
/// logits and gradients against PyTorch's, in units of the bound, and
/// which value that was.
fn step_against_pytorch(
    model: &TorchScriptModel,
    batch: &HashMap<String, Tensor>,
    theirs: &HashMap<String, Tensor>,
) -> (f64, String) {
    let logits = model.forward_t(&batch["ids"], true);
    lm_loss(&logits, &batch["targets"]).backward();
    let mut worst = (
        against_bound(&logits, &theirs["f32.logits"], &theirs["f64.logits"]),
        "logits".to_string(),
    );
    let params = model.named_parameters();
    assert!(!params.is_empty());
    for (name, p) in params {
        let key = |kind: &str| format!("{kind}.grad.{name}");
        let ratio = against_bound(&p.grad(), &theirs[&key("f32")], &theirs[&key("f64")]);
        if ratio > worst.0 {
            worst = (ratio, format!("{name}'s gradient"));
        }
    }
    worst
}

/// Whether hearth's attention kernels run in this process.
fn kernels_on() -> bool {
    hearth::ops::cpu_kernels().is_ok_and(|k| k.runs_hearths_kernels())
}

/// Loads the oracle's `form` fused, checks what was rewritten against
/// `(tanh_gelu, empty_concatenations, attentions)` (attentions only where
/// hearth's kernels run; all of them under a mask unless `form` is
/// `cache`), trains one step and holds logits and every gradient to
/// PyTorch's within the bound. Where the kernels run, the masked
/// attentions of that step must have found `(causal, full, other)` masks.
fn fused_step_matches_pytorch(
    form: &str,
    rewrites: (usize, usize, usize),
    dispatched: (u64, u64, u64),
) {
    let (dir, batch, theirs) = run_oracle(&format!("fused-graph-{form}"), form);
    let model = TorchScriptModel::load(&dir.join("gpt2.pt"), Device::Cpu).unwrap();
    let fused = model.fused();
    let attentions = if kernels_on() { rewrites.2 } else { 0 };
    let masked = if form == "cache" { 0 } else { attentions };
    assert_eq!(
        (
            fused.tanh_gelu,
            fused.empty_concatenations,
            fused.attention,
            fused.masked_attention
        ),
        (rewrites.0, rewrites.1, attentions, masked),
        "{form}: {fused}"
    );
    let before = masked_attention_calls();
    let logits = model.forward_t(&batch["ids"], true);
    lm_loss(&logits, &batch["targets"]).backward();
    let after = masked_attention_calls();
    check(
        &format!("{form}: logits"),
        &logits,
        &theirs["f32.logits"],
        &theirs["f64.logits"],
    );
    let params = model.named_parameters();
    assert!(!params.is_empty());
    for (name, p) in params {
        let key = |kind: &str| format!("{kind}.grad.{name}");
        let (f32_grad, exact) = (&theirs[&key("f32")], &theirs[&key("f64")]);
        check(
            &format!("{form}: {name}'s gradient"),
            &p.grad(),
            f32_grad,
            exact,
        );
    }
    let calls = (
        after.causal - before.causal,
        after.full - before.full,
        after.other - before.other,
    );
    if kernels_on() {
        assert_eq!(calls, dispatched, "{form}: (causal, full, other) masks");
    }
}

#[test]
fn a_traced_gpt2s_fused_graph_gives_pytorchs_logits_and_gradients() {
    let _serial = super::serial();
    // Both of GPT-2's tanh-GELUs, each block's key and value caches, and
    // its two attentions.
    fused_step_matches_pytorch("cache", (2, 4, 2), (0, 0, 0));
    if kernels_on() {
        // hearth's own kernels take GPT-2's projection (width 32, 4 heads
        // of 8, 64 positions), not libtorch's attention behind them.
        let qkv = Tensor::zeros([4, 64, 3 * 32], (Kind::Float, Device::Cpu));
        assert!(hearth::ops::self_attention_is_fused(&qkv, 4));
    }
}

/// Traced with `use_cache=False`, transformers computes a causal mask in
/// the graph; each call finds it causal and runs hearth's kernels.
#[test]
fn without_a_cache_the_computed_causal_mask_runs_hearths_attention() {
    let _serial = super::serial();
    fused_step_matches_pytorch("no-cache", (2, 0, 2), (2, 0, 0));
}

/// A padding mask is not causal: each call finds so and runs libtorch's
/// masked attention, as the exported graph did.
#[test]
fn a_padding_mask_runs_libtorchs_masked_attention() {
    let _serial = super::serial();
    fused_step_matches_pytorch("padded", (2, 0, 2), (0, 0, 2));
}

/// `[model] fuse-graph = false`'s path: the graph runs as exported, and
/// then it is float32 libtorch's own, value for value.
#[test]
fn unfused_the_traced_graph_is_libtorchs_own() {
    let _serial = super::serial();
    let (dir, batch, theirs) = run_oracle("unfused-graph", "cache");
    let model = TorchScriptModel::load_with(&dir.join("gpt2.pt"), Device::Cpu, false).unwrap();
    assert!(!model.fused().any());
    let logits = model.forward_t(&batch["ids"], true);
    assert_eq!(distance(&logits, &theirs["f32.logits"]), 0.0);
}

/// The rewrites loading a traced Llama-family model of the oracle's sizes
/// (2 decoder layers) must make: an RMSNorm before each attention and MLP
/// and one at the end, a SiLU-gated MLP per layer, rotary embeddings of q
/// and k per layer, an attention per layer under the computed mask.
fn llama_rewrites_and_step(family: &str, form: &str, masks: (u64, u64, u64)) {
    let (dir, batch, theirs) = run_oracle_of(
        &format!("fused-{family}-{form}"),
        "llama_fused_graph.py",
        &[family, form],
    );
    let path = dir.join("model.pt");
    let model = TorchScriptModel::load(&path, Device::Cpu).unwrap();
    let fused = model.fused();
    assert_eq!(
        (
            fused.rms_norm,
            fused.swiglu,
            fused.rotary,
            fused.separate_attention,
            fused.masked_separate_attention,
        ),
        (5, 2, 4, 2, 2),
        "{family} ({form}): {fused}"
    );
    // Nothing of these families' blocks was left unfused.
    assert_eq!(fused.unfused, Vec::<String>::new(), "{family} ({form})");
    let before = masked_attention_calls();
    let (worst, what) = step_against_pytorch(&model, &batch, &theirs);
    let after = masked_attention_calls();
    assert!(
        worst <= 1.0,
        "{family} ({form}): fused {what} is {worst:.2} of the bound from float64"
    );
    let calls = (
        after.causal - before.causal,
        after.full - before.full,
        after.other - before.other,
    );
    assert_eq!(
        calls, masks,
        "{family} ({form}): (causal, full, other) masks"
    );
    // The pattern kernels 2^-14 off must show, where they run.
    if kernels_on() {
        let mutated = TorchScriptModel::load_with_mutated_kernels(&path, Device::Cpu).unwrap();
        let (worst, what) = step_against_pytorch(&mutated, &batch, &theirs);
        assert!(
            worst > 1.0,
            "{family} ({form}): kernels 2^-14 off pass ({what} {worst:.2} of the bound)"
        );
    }
}

#[test]
fn a_traced_llamas_fused_graph_gives_pytorchs_logits_and_gradients() {
    let _serial = super::serial();
    llama_rewrites_and_step("llama", "plain", (2, 0, 0));
}

/// Qwen2's projections have biases; the chains are the same.
#[test]
fn a_traced_qwen2s_fused_graph_gives_pytorchs_logits_and_gradients() {
    let _serial = super::serial();
    llama_rewrites_and_step("qwen2", "plain", (2, 0, 0));
}

/// Mistral's mask has a sliding window, wider than the sequence: causal.
#[test]
fn a_traced_mistrals_fused_graph_gives_pytorchs_logits_and_gradients() {
    let _serial = super::serial();
    llama_rewrites_and_step("mistral", "plain", (2, 0, 0));
}

/// A padding mask is not causal: each call runs the masked attention over
/// the repeated key/value heads, as the exported graph did.
#[test]
fn a_padded_llama_runs_the_masked_attention_over_repeated_heads() {
    let _serial = super::serial();
    llama_rewrites_and_step("llama", "padded", (0, 0, 2));
}
