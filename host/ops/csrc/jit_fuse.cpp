// Rewrites of a loaded TorchScript module's graphs that run the same
// arithmetic in fewer operators (issue 44: a user's model gets hearth's
// speed too; issue 61: today's model families too). The TorchScript
// interpreter runs a traced module op by op, and autograd records every op:
// a chain of eight elementwise ops reads and writes the activation eight
// times forward and again backward.
//
// The chains that are a fixed sequence of ops — tanh-GELU, and Llama,
// Qwen2 and Mistral's RMSNorm, SiLU-gated MLP and rotary embedding — are
// data in jit_patterns.cpp, read by one matcher. Here, the rewrites whose
// match is a walk rather than a chain:
//  - an empty cache: a traced transformers model that ran with
//    use_cache=True concatenates an empty constant (the cache it started
//    with) in front of every key and value; cat([empty, x]) is x.
//  - self-attention from a packed projection: q, k and v split out of one
//    [B, T, 3d] tensor, viewed as heads and transposed, into
//    scaled_dot_product_attention (no dropout, the default scale)
//    becomes hearth::self_attention(qkv, heads, causal) — hearth's own
//    kernels where they run (attention.cpp), libtorch's attention on the
//    same views elsewhere — viewed back as [B, H, T, d/H], so the
//    transposes and copies after it become views. Under a boolean mask
//    the graph computes (transformers builds a causal one even where no
//    padding was given) it becomes hearth::masked_self_attention, which
//    looks at the mask on each call: the causal pattern or all-true runs
//    as above, anything else runs libtorch's masked attention as before.
//    Only when hearth's kernels are on (HEARTH_CPU_KERNELS, `hearth env`).
//  - attention from separate q, k and v projections (Llama, Qwen2,
//    Mistral), under a computed mask or over key/value heads repeated by
//    transformers' repeat_kv: hearth::attention of the heads before the
//    repeat, the mask checked on each call the same way (CPU modules).
//  - transformers' SiLUActivation module calls, inlined as aten::silu so
//    that the SiLU-gated MLP's chain lies whole in one graph.
//
// Each rewrite is matched exactly (the ops, their constants, and no other
// use of an intermediate value) and anything else is left as it was; what
// was seen and left is reported with the reason.

#include <ATen/autocast_mode.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/ir/subgraph_matcher.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/subgraph_rewrite.h>
#include <torch/library.h>

#include "avx2_kernels.h"
#include "guarded.h"
#include "jit_values.h"
#include "kernel_paths.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>
#include <limits>
#include <torch/csrc/jit/api/function_impl.h>

// hearth's attention (attention.cpp), as its C ABI gives it.
extern "C" char *hearth_self_attention(at::Tensor *qkv, int64_t heads, bool causal,
                                       int32_t kernels, at::Tensor **out);

// A named namespace: the unity build (build.rs) puts the other sources
// after this one, and these names are for this file alone.
namespace hearth_fuse {
namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

using namespace hearth_jit_values;

// An empty one-dimensional tensor constant, perhaps moved (aten::to) and
// detached on its way: what a traced empty cache is.
bool is_empty_constant(Value *v) {
  while (v->node()->kind() == c10::aten::detach || v->node()->kind() == c10::aten::to) {
    v = v->node()->input(0);
  }
  auto iv = constant(v);
  return iv && iv->isTensor() && iv->toTensor().defined() && iv->toTensor().dim() == 1 &&
         iv->toTensor().numel() == 0;
}

// Whether an op writes to `v` in place (its schema's `_` ops: add_, ...).
bool written_in_place(Value *v) {
  for (const auto &use : v->uses()) {
    const std::string name = use.user->kind().toUnqualString();
    if (!name.empty() && name.back() == '_') return true;
  }
  return false;
}

int64_t drop_empty_concatenations(std::shared_ptr<Graph> &graph) {
  int64_t dropped = 0;
  for (auto it = graph->nodes().begin(); it != graph->nodes().end();) {
    Node *cat = *it++;
    if (cat->kind() != c10::aten::cat) continue;
    Node *list = cat->input(0)->node();
    if (list->kind() != c10::prim::ListConstruct || list->inputs().size() != 2 ||
        cat->input(0)->uses().size() != 1 || !is_empty_constant(list->input(0))) {
      continue;
    }
    // cat of an empty 1-d tensor and x is x (torch.cat skips such
    // tensors) in the dtype both promote to, and autograd passes x's
    // gradient straight through. The result is x itself where the dtype
    // already agrees, so nothing may write to either in place.
    Value *x = list->input(1);
    if (written_in_place(cat->output()) || written_in_place(x)) continue;
    torch::jit::WithInsertPoint here(cat);
    Value *dtype = graph->insert(c10::aten::result_type, {list->input(0), x});
    Value *same = graph->insert(c10::aten::to, {x, dtype, false, false});
    cat->output()->replaceAllUsesWith(same);
    cat->destroy();
    ++dropped;
  }
  if (dropped) torch::jit::EliminateDeadCode(graph);
  return dropped;
}

// The kernel path the rewritten graphs' hearth::self_attention runs
// (kernel_paths.h), set by hearth_jit_fuse: one per process (hearth
// chooses it once, ops::cpu_kernels), so every module agrees.
std::atomic<int32_t> attention_kernels{hearth_kernels::kLibtorch};

at::Tensor self_attention_op(const at::Tensor &qkv, int64_t heads, bool causal) {
  at::Tensor *out = nullptr;
  char *error = hearth_self_attention(const_cast<at::Tensor *>(&qkv), heads, causal,
                                      attention_kernels.load(), &out);
  if (error) {
    std::string message(error);
    free(error);
    throw std::runtime_error(message);
  }
  at::Tensor result = std::move(*out);
  delete out;
  return result;
}

// How a boolean attention mask (true: attend) over T positions looks for
// every batch element and head it broadcasts to: the causal pattern (each
// position sees itself and those before it), all true, or anything else.
enum MaskKind { kCausalMask = 0, kFullMask = 1, kOtherMask = 2 };

MaskKind classify_mask(const at::Tensor &mask, int64_t batch, int64_t heads, int64_t time) {
  if (!mask.defined() || mask.scalar_type() != at::kBool || !mask.device().is_cpu() ||
      mask.dim() < 2 || mask.dim() > 4 || mask.size(-1) != time || mask.size(-2) != time) {
    return kOtherMask;
  }
  at::Tensor m = mask;
  while (m.dim() < 4) m = m.unsqueeze(0);
  if ((m.size(0) != 1 && m.size(0) != batch) || (m.size(1) != 1 && m.size(1) != heads)) {
    return kOtherMask;
  }
  const bool *p = m.const_data_ptr<bool>();
  const auto s = m.strides();
  bool causal = true, full = true;
  for (int64_t b = 0; b < m.size(0) && (causal || full); ++b) {
    for (int64_t h = 0; h < m.size(1) && (causal || full); ++h) {
      for (int64_t q = 0; q < time && (causal || full); ++q) {
        const bool *row = p + b * s[0] + h * s[1] + q * s[2];
        for (int64_t k = 0; k < time; ++k) {
          const bool attend = row[k * s[3]];
          causal &= attend == (k <= q);
          full &= attend;
        }
      }
    }
  }
  return causal ? kCausalMask : full ? kFullMask : kOtherMask;
}

// How often hearth::masked_self_attention saw each MaskKind in this
// process (hearth_masked_attention_calls).
std::atomic<int64_t> mask_calls[3];

// sdpa of q, k and v viewed out of qkv [B, T, 3 * H * D] with `mask`, as
// the graph ran it before the rewrite, its output back to [B, T, H * D].
at::Tensor masked_libtorch_attention(const at::Tensor &qkv, int64_t heads, const at::Tensor &mask) {
  if (qkv.dim() != 3 || heads <= 0 || qkv.size(2) % (3 * heads) != 0) {
    throw std::invalid_argument("masked_self_attention takes qkv of shape [batch, time, 3 * d_model] "
                                "with d_model a multiple of the heads");
  }
  const int64_t batch = qkv.size(0), time = qkv.size(1), width = qkv.size(2) / 3;
  const auto parts = qkv.split(width, -1);
  auto split_heads = [&](const at::Tensor &x) {
    return x.reshape({batch, time, heads, width / heads}).transpose(1, 2);
  };
  return at::scaled_dot_product_attention(split_heads(parts[0]), split_heads(parts[1]),
                                          split_heads(parts[2]), mask, 0.0, false)
      .transpose(1, 2)
      .reshape({batch, time, width});
}

// Attention under a mask the graph computes (transformers builds one even
// where it is plain causal): hearth's causal or full attention where the
// mask is exactly that, checked on every call, and libtorch's masked sdpa
// otherwise.
at::Tensor masked_self_attention_op(const at::Tensor &qkv, int64_t heads, const at::Tensor &mask) {
  const MaskKind kind = qkv.dim() == 3 ? classify_mask(mask, qkv.size(0), heads, qkv.size(1))
                                       : kOtherMask;
  mask_calls[kind].fetch_add(1, std::memory_order_relaxed);
  switch (kind) {
    case kCausalMask: return self_attention_op(qkv, heads, true);
    case kFullMask: return self_attention_op(qkv, heads, false);
    default: return masked_libtorch_attention(qkv, heads, mask);
  }
}

// One of q, k, v: part `index` of split(packed, width, -1), viewed as
// [B, T, heads or -1, head_dim] and transposed to [B, heads, T, head_dim].
struct Head {
  Value *packed;
  size_t index;
  int64_t width, heads, head_dim;
  Value *batch, *time;  // the view's first two sizes
};

std::optional<Head> head_of(Value *x) {
  // Through the dtype promotion drop_empty_concatenations leaves where a
  // cache was: a no-op for the float32 tensors hearth's kernels take, and
  // one autocast would undo before sdpa for the others.
  if (x->node()->kind() == c10::aten::to && x->node()->inputs().size() >= 2 &&
      x->node()->input(1)->node()->kind() == c10::aten::result_type) {
    x = x->node()->input(0);
  }
  Node *transpose = x->node();
  if (transpose->kind() != c10::aten::transpose || transpose->inputs().size() != 3) return std::nullopt;
  auto a = constant_int(transpose->input(1)), b = constant_int(transpose->input(2));
  if (!a || !b || std::min(*a, *b) != 1 || std::max(*a, *b) != 2) return std::nullopt;
  Node *view = transpose->input(0)->node();
  if (view->kind() != c10::aten::view && view->kind() != c10::aten::reshape) return std::nullopt;
  Node *shape = view->input(1)->node();
  if (shape->kind() != c10::prim::ListConstruct || shape->inputs().size() != 4) return std::nullopt;
  auto heads = constant_int(shape->input(2)), head_dim = constant_int(shape->input(3));
  if (!heads || !head_dim || *head_dim <= 0) return std::nullopt;
  Value *part = view->input(0);
  Node *unpack = part->node();
  if (unpack->kind() != c10::prim::ListUnpack || unpack->outputs().size() != 3) return std::nullopt;
  Node *split = unpack->input(0)->node();
  if (split->kind() != c10::aten::split || split->inputs().size() != 3) return std::nullopt;
  auto width = constant_int(split->input(1)), dim = constant_int(split->input(2));
  if (!width || !dim || (*dim != 2 && *dim != -1)) return std::nullopt;
  return Head{split->input(0), part->offset(), *width, *heads, *head_dim, shape->input(0),
              shape->input(1)};
}

// Rewrites the graph's attentions; returns how many, and adds to
// `masked_count` those that take a mask.
int64_t fuse_attention(std::shared_ptr<Graph> &graph, int64_t &masked_count) {
  int64_t fused = 0;
  for (auto it = graph->nodes().begin(); it != graph->nodes().end();) {
    Node *sdpa = *it++;
    if (sdpa->kind() != c10::aten::scaled_dot_product_attention || sdpa->inputs().size() < 7) continue;
    auto q = head_of(sdpa->input(0)), k = head_of(sdpa->input(1)), v = head_of(sdpa->input(2));
    if (!q || !k || !v || q->packed != k->packed || k->packed != v->packed || q->index != 0 ||
        k->index != 1 || v->index != 2 || q->head_dim != k->head_dim || k->head_dim != v->head_dim ||
        q->width != k->width || k->width != v->width || q->width % q->head_dim != 0) {
      continue;
    }
    const int64_t head_dim = q->head_dim, heads = q->width / head_dim;
    bool heads_agree = true;
    for (const auto &h : {*q, *k, *v}) heads_agree &= h.heads == -1 || h.heads == heads;
    auto dropout = constant_number(sdpa->input(4));
    auto causal = constant_bool(sdpa->input(5));
    const bool default_scale = is_none(sdpa->input(6)) ||
                               is_number(sdpa->input(6), 1.0 / std::sqrt(double(head_dim)));
    const bool no_gqa = sdpa->inputs().size() < 8 || constant_bool(sdpa->input(7)) == false;
    // A computed mask is checked on each call (masked_self_attention_op);
    // sdpa refuses a mask together with is_causal.
    const bool masked = !is_none(sdpa->input(3));
    if (!heads_agree || !dropout || *dropout != 0.0 || !causal || (masked && *causal) ||
        !default_scale || !no_gqa) {
      continue;
    }
    torch::jit::WithInsertPoint here(sdpa);
    // The projection as the views saw it, [B, T, 3 * H * D] with q's B and
    // T (a reshape: a view where the layout allows, as the views were).
    auto ints = [&](std::initializer_list<Value *> values) {
      return graph->insertNode(graph->createList(c10::IntType::get(), values))->output();
    };
    Value *minus_one = graph->insertConstant(int64_t(-1));
    Value *packed = graph->insert(c10::aten::reshape, {q->packed, ints({q->batch, q->time, minus_one})});
    Value *out = masked ? graph->insert(c10::Symbol::fromQualString("hearth::masked_self_attention"),
                                        {packed, heads, sdpa->input(3)})
                        : graph->insert(c10::Symbol::fromQualString("hearth::self_attention"),
                                        {packed, heads, *causal});
    // [B, T, H * D] seen as [B, H, T, D], what the attention gave.
    Value *shape = ints({q->batch, q->time, graph->insertConstant(heads), graph->insertConstant(head_dim)});
    Value *viewed = graph->insert(c10::aten::view, {out, shape});
    Value *heads_first = graph->insert(c10::aten::transpose, {viewed, 1, 2});
    sdpa->output()->replaceAllUsesWith(heads_first);
    sdpa->destroy();
    ++fused;
    masked_count += masked;
  }
  if (fused) torch::jit::EliminateDeadCode(graph);
  return fused;
}

// ---- attention from separate q, k and v projections (Llama, Qwen2, Mistral)

// Attention of q [B, H, T, D] over k and v [B, KV, T, D] (H a multiple of
// KV: grouped-query heads, each key/value head serving H / KV query heads,
// what transformers' repeat_kv spells out as copies) under a mask the graph
// computes, checked on each call: the causal pattern or all true runs
// libtorch's attention without a mask (its flash kernel skips the masked
// blocks), anything else the masked attention the graph ran, over the
// repeated heads.
at::Tensor attention_op(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                        const std::optional<at::Tensor> &mask, std::optional<double> scale,
                        bool causal, int64_t kernels) {
  const bool grouped = q.dim() == 4 && k.dim() == 4 && k.size(1) != q.size(1);
  MaskKind kind = kFullMask;
  if (mask && mask->defined()) {
    kind = q.dim() == 4 && k.dim() == 4 && k.size(2) == q.size(2)
               ? classify_mask(*mask, q.size(0), q.size(1), q.size(2))
               : kOtherMask;
    mask_calls[kind].fetch_add(1, std::memory_order_relaxed);
  } else if (causal) {
    kind = kCausalMask;
  }
  if (kind != kOtherMask) {
    // Under CPU autocast q, k and v (bf16 or float16 there) run libtorch's
    // float32 attention where hearth's kernels are on: its reduced-precision
    // backward on a CPU is several times slower (the same choice as
    // hearth::self_attention's, attention.cpp). The output goes back in
    // the precision autocast gave.
    const auto low = at::autocast::get_autocast_dtype(at::kCPU);
    if (q.device().is_cpu() && at::autocast::is_autocast_enabled(at::kCPU) &&
        hearth_avx2::kernels_asked(int32_t(kernels))) {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
      return at::scaled_dot_product_attention(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat),
                                              std::nullopt, 0.0, kind == kCausalMask, scale, grouped)
          .to(low);
    }
    return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, kind == kCausalMask, scale,
                                            grouped);
  }
  auto repeated = [&](const at::Tensor &x) {
    if (!grouped) return x;
    const int64_t b = x.size(0), kv = x.size(1), t = x.size(2), d = x.size(3), rep = q.size(1) / kv;
    return x.unsqueeze(2).expand({b, kv, rep, t, d}).reshape({b, kv * rep, t, d});
  };
  return at::scaled_dot_product_attention(q, repeated(k), repeated(v), *mask, 0.0, false, scale);
}

// Whether `node` is aten::slice(x, dim, 0, INT64_MAX, 1): all of dim `dim`.
bool whole_slice(Node *node) {
  return node->kind() == c10::aten::slice && node->inputs().size() == 5 &&
         constant_int(node->input(2)) == 0 &&
         constant_int(node->input(3)) == std::numeric_limits<int64_t>::max() &&
         constant_int(node->input(4)) == 1;
}

// The key or value heads before transformers' repeat_kv, which writes
// x[:, :, None, :, :].expand(B, KV, rep, T, D).reshape(B, KV * rep, T, D):
// whole slices around one unsqueeze at dimension 2, an expand and a
// reshape. `x` itself where it is not that (no repeat: as many key/value
// heads as query heads).
Value *unrepeated(Value *x) {
  Node *reshape = x->node();
  if (reshape->kind() != c10::aten::reshape) return x;
  Node *expand = reshape->input(0)->node();
  if (expand->kind() != c10::aten::expand) return x;
  Value *base = expand->input(0);
  bool unsqueezed = false;
  while (true) {
    Node *n = base->node();
    if (whole_slice(n)) {
      base = n->input(0);
    } else if (n->kind() == c10::aten::unsqueeze && !unsqueezed && constant_int(n->input(1)) == 2) {
      unsqueezed = true;
      base = n->input(0);
    } else {
      break;
    }
  }
  return unsqueezed ? base : x;
}

// Rewrites scaled_dot_product_attention of separate q, k and v (what the
// packed rewrite above left) where it has a computed mask or repeated
// key/value heads: hearth::attention of the heads before repeat_kv.
// Returns how many; `masked` gets those under a mask, `unfused` a line for
// each attention seen and left, with the reason.
int64_t fuse_separate_attention(std::shared_ptr<Graph> &graph, const std::string &where,
                                int32_t code, int64_t &masked, std::vector<std::string> &unfused) {
  int64_t fused = 0;
  for (auto it = graph->nodes().begin(); it != graph->nodes().end();) {
    Node *sdpa = *it++;
    if (sdpa->kind() != c10::aten::scaled_dot_product_attention) continue;
    auto refuse = [&](const std::string &why) {
      unfused.push_back("attention in " + where + ": aten::scaled_dot_product_attention seen, not fused: " + why);
    };
    if (sdpa->inputs().size() != 8) {
      refuse("a signature of " + std::to_string(sdpa->inputs().size()) + " arguments, not 8");
      continue;
    }
    Value *k = unrepeated(sdpa->input(1)), *v = unrepeated(sdpa->input(2));
    const bool has_mask = !is_none(sdpa->input(3));
    const bool repeats = k != sdpa->input(1) || v != sdpa->input(2);
    auto dropout = constant_number(sdpa->input(4));
    auto causal = constant_bool(sdpa->input(5));
    auto gqa = constant_bool(sdpa->input(7));
    const bool scale_known = is_none(sdpa->input(6)) || constant_number(sdpa->input(6)).has_value();
    if (!dropout || *dropout != 0.0) { refuse("dropout is not a constant 0"); continue; }
    if (!causal) { refuse("is_causal is not a constant"); continue; }
    if (!gqa || (*gqa && repeats)) { refuse("enable_gqa is not a constant false"); continue; }
    if (!scale_known) { refuse("the scale is not a constant"); continue; }
    if ((k != sdpa->input(1)) != (v != sdpa->input(2))) {
      refuse("only one of key and value goes through repeat_kv");
      continue;
    }
    if (!has_mask && !repeats) continue;  // already libtorch's plainest call
    torch::jit::WithInsertPoint here(sdpa);
    Value *out = graph->insert(c10::Symbol::fromQualString("hearth::attention"),
                               {sdpa->input(0), k, v, sdpa->input(3), sdpa->input(6), *causal,
                                int64_t(code)});
    out->setType(sdpa->output()->type());
    sdpa->output()->replaceAllUsesWith(out);
    sdpa->destroy();
    ++fused;
    masked += has_mask;
  }
  if (fused) torch::jit::EliminateDeadCode(graph);
  return fused;
}

// ---- activation modules

// Calls of a module whose forward is one aten::silu of its input
// (transformers' SiLUActivation) become that op, so that the SiLU-gated
// MLP's chain lies whole in its caller's graph. The module stays, uncalled.
// Whether `graph` is a forward of one aten::silu of its (self, x) input.
bool is_silu_forward(const Graph &graph) {
  auto nodes = graph.nodes();
  if (graph.inputs().size() != 2 || graph.outputs().size() != 1 ||
      std::distance(nodes.begin(), nodes.end()) != 1) {
    return false;
  }
  const Node *only = *nodes.begin();
  return only->kind() == c10::aten::silu && only->inputs().size() == 1 &&
         only->input(0) == graph.inputs()[1] && only->output() == graph.outputs()[0];
}

int64_t inline_silu_modules(std::shared_ptr<Graph> &graph) {
  int64_t inlined = 0;
  for (auto it = graph->nodes().begin(); it != graph->nodes().end();) {
    Node *call = *it++;
    if (call->kind() != c10::prim::CallMethod || call->s(c10::attr::name) != "forward" ||
        call->inputs().size() != 2) {
      continue;
    }
    auto cls = call->input(0)->type()->cast<c10::ClassType>();
    torch::jit::Function *forward = cls ? cls->findMethod("forward") : nullptr;
    if (!forward) continue;
    if (!is_silu_forward(*torch::jit::toGraphFunction(*forward).graph())) continue;
    torch::jit::WithInsertPoint here(call);
    Value *silu = graph->insert(c10::aten::silu, {call->input(1)});
    silu->setType(call->output()->type());
    call->output()->replaceAllUsesWith(silu);
    call->destroy();
    ++inlined;
  }
  return inlined;
}

}  // namespace
}  // namespace hearth_fuse

TORCH_LIBRARY(hearth, m) {
  m.def("self_attention(Tensor qkv, int heads, bool causal) -> Tensor");
  m.def("masked_self_attention(Tensor qkv, int heads, Tensor mask) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale, bool causal, "
        "int kernels) -> Tensor");
}

TORCH_LIBRARY_IMPL(hearth, CompositeImplicitAutograd, m) {
  m.impl("self_attention", hearth_fuse::self_attention_op);
  m.impl("masked_self_attention", hearth_fuse::masked_self_attention_op);
  m.impl("attention", hearth_fuse::attention_op);
}

// Rewrites every method of every module in `handle` (a torch::jit::Module)
// with hearth's kernel path `kernels`, into counts[HEARTH_FUSE_COUNTS]:
//   0 tanh-GELU chains fused        1 empty concatenations dropped
//   2 packed attentions now hearth's 3 those of them under a mask
//   4 RMSNorms                      5 SiLU-gated MLPs
//   6 rotary embeddings             7 attentions of separate q, k, v
//   8 those of them under a mask
// and into *report (malloc'd, or null when empty) one line for each chain
// seen and not fused, with the reason. Graphs shared between modules of one
// class are rewritten once. The Llama-family rewrites are for CPU modules
// (their operators run libtorch's chains elsewhere, so nothing is gained).
extern "C" char *hearth_jit_fuse(void *handle, int32_t kernels, bool on_cpu, int64_t *counts,
                                 char **report) {
  return hearth_abi::guarded([&] {
    auto &module = *static_cast<torch::jit::Module *>(handle);
    std::unordered_set<torch::jit::Graph *> seen;
    std::fill(counts, counts + 9, 0);
    *report = nullptr;
    std::vector<std::string> unfused;
    // hearth's attention kernels are CPU kernels: a CUDA module keeps sdpa.
    const bool attention = on_cpu && hearth_kernels::path_of(kernels) != hearth_kernels::kLibtorch;
    if (attention) hearth_fuse::attention_kernels.store(kernels);
    for (const auto &sub : module.modules()) {
      for (const auto &method : sub.get_methods()) {
        auto graph = method.graph();
        if (!seen.insert(graph.get()).second) continue;
        const std::string where = sub.type()->name()->name() + "." + method.name();
        counts[1] += hearth_fuse::drop_empty_concatenations(graph);
        if (attention) counts[2] += hearth_fuse::fuse_attention(graph, counts[3]);
        if (!on_cpu) {
          std::vector<std::string> ignored;
          // tanh-GELU is libtorch's own operator on every device.
          counts[0] +=
              hearth_patterns::apply(hearth_patterns::patterns()[0], graph, where, kernels, ignored);
          continue;
        }
        // An activation module's own graph: its callers take its op.
        if (hearth_fuse::is_silu_forward(*graph)) continue;
        hearth_fuse::inline_silu_modules(graph);
        hearth_patterns::apply_all(graph, where, kernels, counts, unfused);
        counts[7] += hearth_fuse::fuse_separate_attention(graph, where, kernels, counts[8], unfused);
      }
    }
    if (!unfused.empty()) {
      std::string text;
      for (const auto &line : unfused) text += line + "\n";
      *report = strdup(text.c_str());
    }
  });
}

// How many calls of hearth::masked_self_attention in this process found
// the causal mask (out[0]), an all-true one (out[1]) or another (out[2]).
extern "C" void hearth_masked_attention_calls(int64_t *out) {
  for (int i = 0; i < 3; ++i) out[i] = hearth_fuse::mask_calls[i].load();
}
