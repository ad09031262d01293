// The op chains the graph pass (jit_fuse.cpp) replaces by one operator,
// written as data: each chain as torch.jit.trace records it (TorchScript IR
// whose inputs are named), the constants some of its inputs must hold, the
// operator it becomes and what that operator is given, and the op of the
// chain that, left in a graph after the pass, was seen but not fused. The
// matcher is libtorch's (torch::jit::findPatternMatches): the same ops
// wired the same way, and no value inside the chain used outside it. The
// `torch.export` importer and later passes read the same table.
//
//  - tanh-GELU (GPT-2, GPT-Neo, ...): 0.5 * x * (1 + tanh(sqrt(2/pi) *
//    (x + 0.044715 * x^3))) → aten::gelu(x, approximate="tanh");
//  - RMSNorm (Llama, Qwen2, Mistral): weight * (x * rsqrt(mean(x^2, -1,
//    keepdim) + eps)), the casts to float32 around it → hearth::rms_norm;
//    a second form returns x cast to float32 as well: where x already is
//    float32 the cast is x itself, and the tracer, seeing the residual
//    tensor come out of the norm's module, makes the module return it;
//  - the SiLU-gated MLP: silu(gate(x)) * up(x), either order → hearth::swiglu;
//  - rotary embeddings: q * cos + rotate_half(q) * sin → hearth::rotary.
// llama_blocks.cpp holds the hearth:: operators; attention, whose match is
// a walk over views rather than a chain, is jit_fuse.cpp's.

#include "jit_values.h"

#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/ir/subgraph_matcher.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>

#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace hearth_patterns {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

// Where each pattern's rewrites are counted (hearth_jit_fuse's counts).
enum Slot : int {
  kTanhGelu = 0,
  kRmsNorm = 4,
  kSwiGlu = 5,
  kRotary = 6,
};

// A chain input that must be a constant: a given number (ints, bools and
// one-element tensors count as numbers), any positive number, or None.
struct Expect {
  enum Kind { kNumber, kPositive, kNone };
  const char *input;
  Kind kind;
  double value;
};

Expect number(const char *input, double value) { return {input, Expect::kNumber, value}; }
Expect positive(const char *input) { return {input, Expect::kPositive, 0.0}; }
Expect none(const char *input) { return {input, Expect::kNone, 0.0}; }

// An argument of the operator a chain becomes: a value of the chain by its
// name, the number one of its constants holds (as a float), a string, or
// the kernel code the pass runs with (kernel_paths.h: each module's
// operators keep the path, and in tests the mutation, they were fused with).
struct Arg {
  enum Kind { kValue, kNumberOf, kString, kKernels };
  Kind kind;
  const char *text;
  const char *keyword = nullptr;  // passed by this name (keyword-only)
};

Arg value(const char *name) { return {Arg::kValue, name}; }
Arg number_of(const char *name) { return {Arg::kNumberOf, name}; }
Arg string(const char *text) { return {Arg::kString, text}; }
Arg kernels() { return {Arg::kKernels, ""}; }
Arg keyword(const char *name, Arg arg) {
  arg.keyword = name;
  return arg;
}

// A chain, what it must hold and what it becomes. Its first output is the
// one replaced; any others are values of the chain used after it, which
// stay as they were computed.
struct Pattern {
  const char *name;
  std::string chain;
  std::vector<Expect> expect;
  const char *op;
  std::vector<Arg> args;
  const char *anchor;
  Slot slot;
};

// sqrt(2 / pi), the tanh approximation's scale.
constexpr double SQRT_2_OVER_PI = 0.7978845608028654;
// libtorch's ScalarType number for float32, as a traced `.to(torch.float32)`
// holds it.
constexpr double FLOAT32 = 6;
// INT64_MAX, a traced slice's open end (`x[..., h:]`).
constexpr double OPEN_END = 9223372036854775807.0;

// RMSNorm returning `outputs`: the normed value alone, or with the input
// cast to float32 (see the file's head).
Pattern rms_norm(const char *outputs) {
  return {"RMSNorm",
          std::string(R"IR(
graph(%x, %f32, %nb, %cp, %mf, %two, %last, %keep, %mdt, %eps, %alpha, %f32b, %nb2, %cp2, %mf2, %weight):
  %h = aten::to(%x, %f32, %nb, %cp, %mf)
  %p = aten::pow(%h, %two)
  %dims : int[] = prim::ListConstruct(%last)
  %v = aten::mean(%p, %dims, %keep, %mdt)
  %ve = aten::add(%v, %eps, %alpha)
  %r = aten::rsqrt(%ve)
  %n = aten::mul(%h, %r)
  %n2 = aten::to(%n, %f32b, %nb2, %cp2, %mf2)
  %y = aten::mul(%weight, %n2)
  return ()IR") + outputs + ")",
          {number("f32", FLOAT32), number("nb", 0), number("cp", 0), none("mf"), number("two", 2),
           number("last", -1), number("keep", 1), none("mdt"), positive("eps"), number("alpha", 1),
           number("f32b", FLOAT32), number("nb2", 0), number("cp2", 0), none("mf2")},
          "hearth::rms_norm",
          {value("x"), value("weight"), number_of("eps"), kernels()},
          "aten::rsqrt",
          kRmsNorm};
}

const std::vector<Pattern> &patterns() {
  static const std::vector<Pattern> table = {
      {"tanh-GELU",
       R"IR(
graph(%x, %half, %three, %kappa, %alpha, %beta, %one, %alpha2):
  %a = aten::mul(%x, %half)
  %p = aten::pow(%x, %three)
  %b = aten::mul(%p, %kappa)
  %c = aten::add(%x, %b, %alpha)
  %d = aten::mul(%c, %beta)
  %t = aten::tanh(%d)
  %e = aten::add(%t, %one, %alpha2)
  %r = aten::mul(%a, %e)
  return (%r))IR",
       {number("half", 0.5), number("three", 3), number("kappa", 0.044715), number("alpha", 1),
        number("beta", SQRT_2_OVER_PI), number("one", 1), number("alpha2", 1)},
       "aten::gelu",
       {value("x"), keyword("approximate", string("tanh"))},
       "aten::tanh",
       kTanhGelu},
      rms_norm("%y"),
      rms_norm("%y, %h"),
      {"SwiGLU",
       R"IR(
graph(%gate, %up):
  %s = aten::silu(%gate)
  %y = aten::mul(%s, %up)
  return (%y))IR",
       {},
       "hearth::swiglu",
       {value("gate"), value("up"), kernels()},
       "aten::silu",
       kSwiGlu},
      {"SwiGLU",
       R"IR(
graph(%gate, %up):
  %s = aten::silu(%gate)
  %y = aten::mul(%up, %s)
  return (%y))IR",
       {},
       "hearth::swiglu",
       {value("gate"), value("up"), kernels()},
       "aten::silu",
       kSwiGlu},
      {"rotary embedding",
       R"IR(
graph(%x, %cos, %sin, %d1, %two1, %d2, %zero, %one1, %d3, %two2, %d4, %end, %one2, %catdim, %alpha):
  %c = aten::mul(%x, %cos)
  %s1 = aten::size(%x, %d1)
  %t1 = prim::NumToTensor(%s1)
  %h1 = aten::floor_divide(%t1, %two1)
  %i1 = aten::Int(%h1)
  %x1 = aten::slice(%x, %d2, %zero, %i1, %one1)
  %s2 = aten::size(%x, %d3)
  %t2 = prim::NumToTensor(%s2)
  %h2 = aten::floor_divide(%t2, %two2)
  %i2 = aten::Int(%h2)
  %x2 = aten::slice(%x, %d4, %i2, %end, %one2)
  %n = aten::neg(%x2)
  %l : Tensor[] = prim::ListConstruct(%n, %x1)
  %rot = aten::cat(%l, %catdim)
  %s = aten::mul(%rot, %sin)
  %y = aten::add(%c, %s, %alpha)
  return (%y))IR",
       {number("d1", 3), number("two1", 2), number("d2", 3), number("zero", 0), number("one1", 1),
        number("d3", 3), number("two2", 2), number("d4", 3), number("end", OPEN_END),
        number("one2", 1), number("catdim", -1), number("alpha", 1)},
       "hearth::rotary",
       {value("x"), value("cos"), value("sin"), kernels()},
       "aten::neg",
       kRotary},
  };
  return table;
}

// A pattern parsed once: its graph and its values by name.
struct Parsed {
  std::shared_ptr<Graph> graph;
  std::unordered_map<std::string, Value *> names;
};

const Parsed &parsed(const Pattern &pattern) {
  static std::unordered_map<const Pattern *, Parsed> cache;
  auto found = cache.find(&pattern);
  if (found != cache.end()) return found->second;
  Parsed p{std::make_shared<Graph>(), {}};
  torch::jit::parseIR(pattern.chain, p.graph.get(), p.names);
  return cache.emplace(&pattern, std::move(p)).first->second;
}

// Why `v` does not hold what `e` asks for; empty when it does.
std::string mismatch(const Expect &e, Value *v) {
  using namespace hearth_jit_values;
  const auto got = constant_number(v);
  std::ostringstream why;
  switch (e.kind) {
    case Expect::kNone:
      if (is_none(v)) return "";
      why << "%" << e.input << " is not None";
      return why.str();
    case Expect::kPositive:
      if (got && *got > 0) return "";
      why << "%" << e.input << " is not a positive constant";
      return why.str();
    case Expect::kNumber:
      if (got && (*got == e.value || std::fabs(*got - e.value) <= 1e-6 * std::fabs(e.value)))
        return "";
      why << "%" << e.input << " is ";
      if (got) why << *got; else why << "not a constant";
      why << " where the pattern needs " << e.value;
      return why.str();
  }
  return "";
}

// The operator `pattern` becomes, for `match`, inserted before the chain's
// last node; returns its output.
Value *insert_replacement(Graph &graph, const Pattern &pattern, const Parsed &p,
                          const torch::jit::Match &match, Node *last, int32_t code) {
  torch::jit::WithInsertPoint here(last);
  std::vector<torch::jit::NamedValue> args, kwargs;
  for (const Arg &arg : pattern.args) {
    Value *v = nullptr;
    switch (arg.kind) {
      case Arg::kValue: v = match.values_map.at(p.names.at(arg.text)); break;
      case Arg::kNumberOf:
        v = graph.insertConstant(
            *hearth_jit_values::constant_number(match.values_map.at(p.names.at(arg.text))));
        break;
      case Arg::kString: v = graph.insertConstant(std::string(arg.text)); break;
      case Arg::kKernels: v = graph.insertConstant(int64_t(code)); break;
    }
    if (arg.keyword) kwargs.emplace_back(arg.keyword, v);
    else args.emplace_back(v);
  }
  return graph.insert(c10::Symbol::fromQualString(pattern.op), args, kwargs);
}

// Rewrites `pattern`'s chains in `graph` (named `where` in the report);
// returns how many, and adds a line to `unfused` for each anchor op left
// that a chain of it could have held, with the reason.
int64_t apply(const Pattern &pattern, std::shared_ptr<Graph> &graph, const std::string &where,
              int32_t code, std::vector<std::string> &unfused) {
  const Parsed &p = parsed(pattern);
  const c10::Symbol anchor = c10::Symbol::fromQualString(pattern.anchor);
  Node *pattern_anchor = nullptr;
  for (Node *n : p.graph->nodes())
    if (n->kind() == anchor) pattern_anchor = n;
  std::unordered_set<Node *> consumed;
  std::unordered_map<Node *, std::string> refused;  // graph anchor → why
  int64_t fused = 0;
  for (const auto &match : torch::jit::findPatternMatches(*p.graph, *graph)) {
    bool overlaps = false;
    for (const auto &[_, node] : match.nodes_map) overlaps |= consumed.count(node) > 0;
    if (overlaps) continue;
    std::string why;
    for (const Expect &e : pattern.expect) {
      why = mismatch(e, match.values_map.at(p.names.at(e.input)));
      if (!why.empty()) break;
    }
    Node *graph_anchor = pattern_anchor ? match.nodes_map.at(pattern_anchor) : nullptr;
    if (!why.empty()) {
      if (graph_anchor) refused[graph_anchor] = "its constants differ: " + why;
      continue;
    }
    Value *out = p.graph->outputs()[0];
    Value *matched_out = match.values_map.at(out);
    Value *replacement = insert_replacement(*graph, pattern, p, match, matched_out->node(), code);
    replacement->setType(matched_out->type());
    matched_out->replaceAllUsesWith(replacement);
    for (const auto &[_, node] : match.nodes_map) consumed.insert(node);
    ++fused;
  }
  // Every anchor op in the graph a chain did not take: a rewrite of this
  // graph by another pattern of the same name may still take it, so the
  // caller reports only those no pattern took (see `unfused_anchors`).
  for (Node *node : graph->nodes()) {
    if (node->kind() != anchor || consumed.count(node)) continue;
    auto why = refused.find(node);
    unfused.push_back(std::string(pattern.name) + " in " + where + ": " + pattern.anchor +
                      " seen, not fused: " +
                      (why != refused.end() ? why->second
                                            : "the ops around it are not the chain (other ops, "
                                              "or a value inside it used elsewhere)"));
  }
  if (fused) torch::jit::EliminateDeadCode(graph);
  return fused;
}

// Runs every pattern over `graph`, adding to counts[slot]; the anchors no
// pattern of their name took are added to `unfused`, once each.
void apply_all(std::shared_ptr<Graph> &graph, const std::string &where, int32_t code,
               int64_t *counts, std::vector<std::string> &unfused) {
  const auto &table = patterns();
  for (size_t i = 0; i < table.size(); ++i) {
    std::vector<std::string> left;
    counts[table[i].slot] += apply(table[i], graph, where, code, left);
    // A name's last pattern reports what all of its patterns left.
    const bool last_of_name = i + 1 == table.size() || std::string(table[i + 1].name) != table[i].name;
    if (last_of_name) unfused.insert(unfused.end(), left.begin(), left.end());
  }
}

}  // namespace hearth_patterns
