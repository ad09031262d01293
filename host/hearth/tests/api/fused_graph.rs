//! A user's TorchScript model fused (`TorchScriptModel::load`, host/ops
//! `jit_fuse.cpp`) against PyTorch: the oracle
//! (`tests/oracles/gpt2_fused_graph.py`) exports a transformers GPT-2 with
//! `torch.jit.trace` and computes its logits and gradients on one batch in
//! float64 (eager) and in float32 (the traced graph, op by op). hearth's
//! fused graph must be within 4 times float32 libtorch's distance from
//! float64, plus 64 units of float32 rounding of the largest value — the
//! bound of `pytorch_parity`, derived in the oracle's docstring — on
//! whatever CPU level libtorch runs (tests/isa/levels.sh runs it at each).

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

/// The oracle run for one of its export forms: `cache`, `no-cache` or
/// `padded` (see its docstring).
fn run_oracle(name: &str, form: &str) -> Oracle {
    let dir = common::scratch(name);
    common::oracle("gpt2_fused_graph.py", &[dir.to_str().unwrap(), form]);
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

/// `got` against float64 `exact`, allowed 4 × float32 libtorch's distance
/// plus 64 float32 units of the largest exact value.
fn check(what: &str, got: &Tensor, f32_libtorch: &Tensor, exact: &Tensor) {
    let largest = exact.abs().max().double_value(&[]);
    let bound = 4.0 * distance(f32_libtorch, exact) + 64.0 * f64::from(f32::EPSILON) * largest;
    let off = distance(got, exact);
    assert!(
        off <= bound,
        "{what}: fused is {off:e} from float64, over the bound {bound:e} \
         (float32 libtorch is {:e} away)",
        distance(f32_libtorch, exact)
    );
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
