// Rewrites of a loaded TorchScript module's graphs that run the same
// arithmetic in fewer operators (issue 44: a user's model gets hearth's
// speed too). The TorchScript interpreter runs a traced module op by op,
// and autograd records every op: a chain of eight elementwise ops reads and
// writes the activation eight times forward and again backward.
//
//  - tanh-GELU: transformers' NewGELUActivation (GPT-2, GPT-Neo, ...),
//      0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
//    traced as mul, pow, mul, add, mul, tanh, add, mul, becomes libtorch's
//    aten::gelu(x, approximate="tanh"), which evaluates that formula in one
//    vectorised pass and its derivative in one more.
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
//
// Each rewrite is matched exactly (the ops, their constants, and no other
// use of an intermediate value) and anything else is left as it was.

#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/ir/subgraph_matcher.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/subgraph_rewrite.h>
#include <torch/library.h>

#include "guarded.h"
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

// What a prim::Constant holds; none for any other value.
std::optional<c10::IValue> constant(Value *v) {
  if (v->node()->kind() != c10::prim::Constant) return std::nullopt;
  return torch::jit::toIValue(v);
}

// The number a constant holds: a Python float or int, or a one-element
// tensor (a traced Python scalar); none for anything else.
std::optional<double> constant_number(Value *v) {
  auto iv = constant(v);
  if (!iv) return std::nullopt;
  if (iv->isDouble()) return iv->toDouble();
  if (iv->isInt()) return static_cast<double>(iv->toInt());
  if (iv->isTensor()) {
    const auto &t = iv->toTensor();
    if (t.defined() && t.numel() == 1 && t.is_floating_point()) return t.item<double>();
  }
  return std::nullopt;
}

bool is_number(Value *v, double want) {
  auto got = constant_number(v);
  return got && std::fabs(*got - want) <= 1e-6 * std::fabs(want);
}

// transformers' NewGELUActivation as torch.jit.trace records it; the
// constants are inputs of the pattern, checked by `gelu_constants`.
const char *TANH_GELU = R"IR(
graph(%x, %half, %three, %kappa, %alpha, %beta, %one, %alpha2):
  %a = aten::mul(%x, %half)
  %p = aten::pow(%x, %three)
  %b = aten::mul(%p, %kappa)
  %c = aten::add(%x, %b, %alpha)
  %d = aten::mul(%c, %beta)
  %t = aten::tanh(%d)
  %e = aten::add(%t, %one, %alpha2)
  %r = aten::mul(%a, %e)
  return (%r))IR";

const char *FUSED_GELU = R"IR(
graph(%x, %half, %three, %kappa, %alpha, %beta, %one, %alpha2):
  %approximate : str = prim::Constant[value="tanh"]()
  %r = aten::gelu(%x, %approximate)
  return (%r))IR";

// sqrt(2 / pi), the tanh approximation's scale.
constexpr double SQRT_2_OVER_PI = 0.7978845608028654;

bool gelu_constants(const torch::jit::Match &match,
                    const std::unordered_map<std::string, Value *> &names) {
  auto bound = [&](const char *name) { return match.values_map.at(names.at(name)); };
  return is_number(bound("half"), 0.5) && is_number(bound("three"), 3.0) &&
         is_number(bound("kappa"), 0.044715) && is_number(bound("alpha"), 1.0) &&
         is_number(bound("beta"), SQRT_2_OVER_PI) && is_number(bound("one"), 1.0) &&
         is_number(bound("alpha2"), 1.0);
}

// Nodes of kind `kind` in the graph's top-level block and their count.
int64_t count(Graph &graph, c10::Symbol kind) {
  int64_t n = 0;
  for (Node *node : graph.nodes()) n += node->kind() == kind;
  return n;
}

int64_t fuse_tanh_gelu(std::shared_ptr<Graph> &graph) {
  const auto before = count(*graph, c10::aten::gelu);
  torch::jit::SubgraphRewriter rewriter;
  rewriter.RegisterRewritePattern(TANH_GELU, FUSED_GELU);
  rewriter.runOnGraph(graph, gelu_constants);
  return count(*graph, c10::aten::gelu) - before;
}

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

std::optional<int64_t> constant_int(Value *v) {
  auto iv = constant(v);
  return iv && iv->isInt() ? std::optional<int64_t>(iv->toInt()) : std::nullopt;
}

std::optional<bool> constant_bool(Value *v) {
  auto iv = constant(v);
  return iv && iv->isBool() ? std::optional<bool>(iv->toBool()) : std::nullopt;
}

bool is_none(Value *v) {
  auto iv = constant(v);
  return iv && iv->isNone();
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

}  // namespace
}  // namespace hearth_fuse

TORCH_LIBRARY(hearth, m) {
  m.def("self_attention(Tensor qkv, int heads, bool causal) -> Tensor");
  m.def("masked_self_attention(Tensor qkv, int heads, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(hearth, CompositeImplicitAutograd, m) {
  m.impl("self_attention", hearth_fuse::self_attention_op);
  m.impl("masked_self_attention", hearth_fuse::masked_self_attention_op);
}

// Rewrites every method of every module in `handle` (a torch::jit::Module)
// with hearth's kernel path `kernels`; counts[0] gets the tanh-GELU chains
// fused, counts[1] the empty concatenations dropped, counts[2] the
// attentions now hearth's, counts[3] those of them under a mask. Graphs shared between modules of one class are
// rewritten once.
extern "C" char *hearth_jit_fuse(void *handle, int32_t kernels, bool on_cpu, int64_t *counts) {
  return hearth_abi::guarded([&] {
    auto &module = *static_cast<torch::jit::Module *>(handle);
    std::unordered_set<torch::jit::Graph *> seen;
    counts[0] = counts[1] = counts[2] = counts[3] = 0;
    // hearth's attention kernels are CPU kernels: a CUDA module keeps sdpa.
    const bool attention = on_cpu && hearth_kernels::path_of(kernels) != hearth_kernels::kLibtorch;
    if (attention) hearth_fuse::attention_kernels.store(kernels);
    for (const auto &sub : module.modules()) {
      for (const auto &method : sub.get_methods()) {
        auto graph = method.graph();
        if (!seen.insert(graph.get()).second) continue;
        counts[0] += hearth_fuse::fuse_tanh_gelu(graph);
        counts[1] += hearth_fuse::drop_empty_concatenations(graph);
        if (attention) counts[2] += hearth_fuse::fuse_attention(graph, counts[3]);
      }
    }
  });
}

// How many calls of hearth::masked_self_attention in this process found
// the causal mask (out[0]), an all-true one (out[1]) or another (out[2]).
extern "C" void hearth_masked_attention_calls(int64_t *out) {
  for (int i = 0; i < 3; ++i) out[i] = hearth_fuse::mask_calls[i].load();
}
