// Unit boundaries inside a loaded TorchScript module (issue 59): the
// module's `forward` is cut into pieces at the calls of the units a wrap
// policy picked (`m.model.layers.0`, ...), so that hearth can run a traced
// transformers model one unit at a time and hold only that unit's
// parameters whole (FULL_SHARD), or recompute it alone (activation
// checkpointing).
//
// How: a copy of forward's graph gets the calls of every module that holds
// a unit inlined (the wrapper, `m`, `m.model`), until the units' own calls
// are nodes of the top-level graph. That graph is then cut before and after
// each unit call. Every piece becomes a graph of its own, taking the root
// module and the tensors live at its start, returning those live at its
// end: what it computed and what it passes on untouched. So pieces run one
// after another, each on the previous one's outputs, as hearth's own
// models' units do (parallel/unitwise.rs).
//
// What crosses a cut must be a tensor, or a tuple of tensors (passed as
// its elements and rebuilt). Constants, module attributes and values that
// are not tensors (sizes, shape lists, tuples) are computed again in each
// piece that uses them, from what it has. Anything else (a list or a
// number a unit call returns, a unit called inside control flow) makes the
// cut fail with a message naming the unit: no silent fallback.

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>

#include "guarded.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace hearth_units {
namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

// One piece of the cut forward pass.
struct Piece {
  std::unique_ptr<torch::jit::GraphFunction> function;
  // The unit this piece calls; empty for the code between unit calls.
  std::string unit;
  // The module paths it calls and the tensors it reads by name: whose
  // parameters must be whole while it runs.
  std::vector<std::string> uses;
  size_t inputs = 0;
  size_t outputs = 0;
};

// The whole cut: the pieces in forward order, run on the module's object.
struct Program {
  c10::IValue self;
  std::vector<Piece> pieces;
};

std::string join(const std::string &parent, const std::string &name) {
  return parent.empty() ? name : parent + "." + name;
}

// The attribute path from the graph's `self` that `v` is (a submodule, a
// parameter), if it is one.
std::optional<std::string> path_of(Value *v, Value *self) {
  if (v == self) return std::string();
  Node *n = v->node();
  if (n->kind() != c10::prim::GetAttr) return std::nullopt;
  auto parent = path_of(n->input(0), self);
  if (!parent) return std::nullopt;
  return join(*parent, n->s(c10::attr::name));
}

bool inside(const std::string &path, const std::string &module) {
  return module.empty() || path == module ||
         (path.size() > module.size() && path.compare(0, module.size(), module) == 0 &&
          path[module.size()] == '.');
}

// Whether the module at `path` holds one of `units` below it (not being one).
bool holds_a_unit(const std::string &path, const std::set<std::string> &units) {
  for (const auto &u : units) {
    if (u != path && inside(u, path)) return true;
  }
  return false;
}

std::string value_name(Value *v) {
  return "%" + v->debugName();
}

// Inlines, in the top-level block, the calls of modules that hold a unit,
// until none is left.
void inline_unit_holders(Graph &graph, const std::set<std::string> &units) {
  Value *self = graph.inputs()[0];
  for (bool changed = true; changed;) {
    changed = false;
    for (Node *n : graph.nodes()) {
      if (n->kind() != c10::prim::CallMethod) continue;
      auto path = path_of(n->input(0), self);
      if (!path || !holds_a_unit(*path, units)) continue;
      auto cls = n->input(0)->type()->cast<c10::ClassType>();
      if (!cls) continue;
      auto &callee = torch::jit::toGraphFunction(cls->getMethod(n->s(c10::attr::name)));
      // The callee's own graph: its optimized graph has every call inlined.
      torch::jit::inlineCallTo(n, &callee, callee.graph().get());
      changed = true;
      break;
    }
  }
}

// Throws when a unit is called inside a block of `n` (a branch or a loop).
void refuse_calls_inside(Node *n, Value *self, const std::set<std::string> &units) {
  for (auto *block : n->blocks()) {
    for (Node *inner : block->nodes()) {
      if (inner->kind() == c10::prim::CallMethod) {
        auto p = path_of(inner->input(0), self);
        if (p && units.count(*p)) {
          throw std::runtime_error("unit `" + *p +
                                   "` is called inside control flow (a branch or a loop of the "
                                   "graph), so hearth cannot run it on its own; wrap a module "
                                   "that is called once per forward pass");
        }
      }
      refuse_calls_inside(inner, self, units);
    }
  }
}

// The unit calls of the top-level block; a unit called elsewhere (inside a
// branch or a loop), or never, is an error.
std::vector<Node *> unit_calls(Graph &graph, const std::set<std::string> &units) {
  Value *self = graph.inputs()[0];
  std::vector<Node *> calls;
  std::set<std::string> called;
  for (Node *n : graph.nodes()) {
    refuse_calls_inside(n, self, units);
    if (n->kind() != c10::prim::CallMethod) continue;
    auto path = path_of(n->input(0), self);
    if (path && units.count(*path)) {
      calls.push_back(n);
      called.insert(*path);
    }
  }
  for (const auto &u : units) {
    if (!called.count(u)) {
      throw std::runtime_error(
          "unit `" + u +
          "` is never called as a module by the traced forward pass (its tensors are read directly, "
          "or it is called through a module hearth cannot name), so hearth cannot run it on its own; "
          "pick units the forward pass calls, as `hearth model plan` lists the modules");
    }
  }
  return calls;
}

// The graph returns one value: a tensor, or a tuple whose first element
// hearth takes (transformers' outputs with torchscript=True).
void return_first_element(Graph &graph) {
  Value *out = graph.outputs()[0];
  auto tuple = out->type()->cast<c10::TupleType>();
  if (!tuple) return;
  if (tuple->elements().empty()) throw std::runtime_error("forward returns an empty tuple");
  Node *unpack = graph.appendNode(graph.createTupleUnpack(out));
  graph.eraseOutput(0);
  graph.registerOutput(unpack->output(0));
}

// A node computed again in each piece that uses its outputs, instead of
// passing them: constants, attributes, and pure operations that give no
// tensor (sizes, shape lists, tuples of what they are given).
bool recomputed(Node *n) {
  const auto kind = n->kind();
  if (kind == c10::prim::Constant || kind == c10::prim::GetAttr) return true;
  if (kind == c10::prim::CallMethod || kind == c10::prim::CallFunction || !n->blocks().empty() ||
      n->hasSideEffects() || n->isNondeterministic()) {
    return false;
  }
  for (Value *out : n->outputs()) {
    if (out->type()->isSubtypeOf(*c10::TensorType::get())) return false;
  }
  return true;
}

bool is_tensor(const c10::TypePtr &type) { return type->isSubtypeOf(*c10::TensorType::get()); }

// How many tensors carry `v` across a cut: 1 for a tensor, k for a tuple of
// k tensors; 0 when it cannot cross.
size_t slots(Value *v) {
  if (is_tensor(v->type())) return 1;
  if (auto tuple = v->type()->cast<c10::TupleType>()) {
    for (const auto &e : tuple->elements()) {
      if (!is_tensor(e)) return 0;
    }
    return tuple->elements().size();
  }
  return 0;
}

// The cut, before its pieces become graphs: which segment computes each
// node, and what each segment takes from before it.
struct Cut {
  Graph *graph = nullptr;
  Value *self = nullptr;
  // Segment of every node a segment computes (recomputed nodes have none).
  std::unordered_map<Node *, int> segment;
  // The unit each segment calls ("" for the code between calls).
  std::vector<std::string> units;
  // Values passed into each segment, per segment, and where each is made
  // (-1: a graph input) and last used (segments.size(): the result).
  std::vector<std::vector<Value *>> takes;
  std::unordered_map<Value *, int> made, last_use;
  // Passed values in the order they are first made (the order of slots).
  std::vector<Value *> order;

  std::string where(int s) const {
    if (s < 0) return "the inputs";
    if (s >= static_cast<int>(units.size())) return "the result";
    if (!units[s].empty()) return "unit `" + units[s] + "`";
    std::string before = "the start", after = "the end";
    for (int i = s - 1; i >= 0; --i) {
      if (!units[i].empty()) {
        before = "unit `" + units[i] + "`";
        break;
      }
    }
    for (size_t i = s + 1; i < units.size(); ++i) {
      if (!units[i].empty()) {
        after = "unit `" + units[i] + "`";
        break;
      }
    }
    return "the code between " + before + " and " + after;
  }

  void note(Value *v, int made_in) {
    if (!made.count(v)) {
      made[v] = made_in;
      order.push_back(v);
    }
  }

  // Records that segment `s` needs `v`: passed in, or computed again there.
  void need(Value *v, int s, std::unordered_set<Value *> &seen) {
    if (v == self || !seen.insert(v).second) return;
    Node *n = v->node();
    if (n->kind() == c10::prim::Param) {
      note(v, -1);
      takes[s].push_back(v);
      last_use[v] = std::max(last_use[v], s);
      return;
    }
    auto at = segment.find(n);
    if (at != segment.end() && at->second == s) return;
    if (recomputed(n)) {
      for (Value *in : n->inputs()) need(in, s, seen);
      return;
    }
    if (at == segment.end()) throw std::runtime_error("a value made outside the graph's top level");
    if (slots(v) == 0) {
      std::ostringstream why;
      why << "the value " << value_name(v) << " of type " << v->type()->repr_str() << ", made by "
          << n->kind().toQualString() << " in " << where(at->second) << " and used in " << where(s)
          << ", can be neither passed between units (hearth passes tensors and tuples of tensors) "
             "nor computed again; choose other units";
      throw std::runtime_error(why.str());
    }
    note(v, at->second);
    takes[s].push_back(v);
    last_use[v] = std::max(last_use[v], s);
  }
};

Cut cut(Graph &graph, const std::vector<Node *> &calls) {
  Cut c;
  c.graph = &graph;
  c.self = graph.inputs()[0];
  std::unordered_set<Node *> is_call(calls.begin(), calls.end());
  int s = 0;
  c.units.push_back("");
  for (Node *n : graph.nodes()) {
    if (is_call.count(n)) {
      c.units.push_back(*path_of(n->input(0), c.self));
      c.segment[n] = ++s;
      c.units.push_back("");
      ++s;
    } else if (!recomputed(n)) {
      c.segment[n] = s;
    }
  }
  c.takes.resize(c.units.size());
  for (size_t i = 1; i < graph.inputs().size(); ++i) c.note(graph.inputs()[i], -1);
  for (Node *n : graph.nodes()) {
    auto at = c.segment.find(n);
    if (at == c.segment.end()) continue;
    std::unordered_set<Value *> seen;
    for (Value *in : n->inputs()) c.need(in, at->second, seen);
    for (Value *out : n->outputs()) {
      if (slots(out) > 0) c.note(out, at->second);
    }
  }
  // The result is used after the last segment.
  const int end = static_cast<int>(c.units.size());
  Value *result = graph.outputs()[0];
  if (!is_tensor(result->type())) throw std::runtime_error("forward returns no tensor");
  c.takes.push_back({});
  std::unordered_set<Value *> seen;
  c.need(result, end, seen);
  return c;
}

// Whether segment `s` computes anything (the code between two unit calls
// is often nothing at all).
bool computes(const Cut &c, int s) {
  for (const auto &[node, segment] : c.segment) {
    if (segment == s) return true;
  }
  return false;
}

// The values live across the boundary before segment `s`: made before it,
// used at or after it. The first piece takes every input of the graph.
std::vector<Value *> live_before(const Cut &c, int s, bool first) {
  std::vector<Value *> live;
  for (Value *v : c.order) {
    const int made = c.made.at(v);
    auto last = c.last_use.find(v);
    if (first && made == -1) {
      live.push_back(v);
    } else if (made < s && last != c.last_use.end() && last->second >= s) {
      live.push_back(v);
    }
  }
  return live;
}

// The graph of the piece made of segments [from, to): it takes the root
// and `in`, and returns the tuple of `out` (tuples flattened).
std::shared_ptr<Graph> piece_graph(const Cut &c, int from, int to, const std::vector<Value *> &in,
                                   const std::vector<Value *> &out) {
  auto g = std::make_shared<Graph>();
  std::unordered_map<Value *, Value *> env;
  Value *self = g->addInput("self");
  self->setType(c.self->type());
  env[c.self] = self;
  for (Value *v : in) {
    if (is_tensor(v->type())) {
      Value *x = g->addInput();
      x->setType(c10::TensorType::get());
      env[v] = x;
      continue;
    }
    std::vector<Value *> parts;
    for (size_t k = 0; k < slots(v); ++k) {
      parts.push_back(g->addInput());
      parts.back()->setType(c10::TensorType::get());
    }
    env[v] = g->appendNode(g->createTuple(parts))->output();
  }
  std::function<Value *(Value *)> resolve = [&](Value *v) -> Value * {
    auto found = env.find(v);
    if (found != env.end()) return found->second;
    Node *n = v->node();
    if (!recomputed(n)) {
      throw std::runtime_error("internal: " + value_name(v) + " reached a piece it was not passed to");
    }
    Node *copy = g->appendNode(g->createClone(n, resolve));
    for (size_t i = 0; i < n->outputs().size(); ++i) env[n->output(i)] = copy->output(i);
    return env.at(v);
  };
  for (Node *n : c.graph->nodes()) {
    auto at = c.segment.find(n);
    if (at == c.segment.end() || at->second < from || at->second >= to) continue;
    for (Value *input : n->inputs()) resolve(input);
    Node *copy = g->appendNode(g->createClone(n, resolve));
    for (size_t i = 0; i < n->outputs().size(); ++i) env[n->output(i)] = copy->output(i);
  }
  std::vector<Value *> returned;
  for (Value *v : out) {
    Value *x = resolve(v);
    if (is_tensor(v->type())) {
      returned.push_back(x);
      continue;
    }
    Node *unpack = g->appendNode(g->createTupleUnpack(x));
    for (Value *part : unpack->outputs()) returned.push_back(part);
  }
  g->registerOutput(g->appendNode(g->createTuple(returned))->output());
  g->lint();
  return g;
}

size_t slot_count(const std::vector<Value *> &values) {
  size_t n = 0;
  for (Value *v : values) n += slots(v);
  return n;
}

// Names every module a piece calls and every tensor it reads by name.
std::vector<std::string> uses_of(Graph &g) {
  std::set<std::string> uses;
  Value *self = g.inputs()[0];
  for (Node *n : g.nodes()) {
    if (n->kind() == c10::prim::CallMethod) {
      if (auto p = path_of(n->input(0), self)) uses.insert(*p);
    } else if (n->kind() == c10::prim::GetAttr && is_tensor(n->output()->type())) {
      if (auto p = path_of(n->output(), self)) uses.insert(*p);
    }
  }
  return {uses.begin(), uses.end()};
}

Program build(const torch::jit::Module &module, const std::set<std::string> &units) {
  auto graph = module.get_method("forward").graph()->copy();
  inline_unit_holders(*graph, units);
  auto calls = unit_calls(*graph, units);
  return_first_element(*graph);
  Cut c = cut(*graph, calls);
  // Segments that compute nothing join no piece; the others each make one,
  // and the last piece returns the result.
  std::vector<int> kept;
  const int n = static_cast<int>(c.units.size());
  for (int s = 0; s < n; ++s) {
    if (!c.units[s].empty() || computes(c, s)) kept.push_back(s);
  }
  if (kept.empty()) kept.push_back(0);
  Program program;
  program.self = module._ivalue();
  for (size_t k = 0; k < kept.size(); ++k) {
    const int from = k == 0 ? 0 : kept[k];
    const int to = k + 1 < kept.size() ? kept[k + 1] : n;
    auto in = live_before(c, from, k == 0);
    auto out = k + 1 < kept.size() ? live_before(c, to, false) : std::vector<Value *>{graph->outputs()[0]};
    Piece piece;
    piece.unit = c.units[kept[k]];
    auto g = piece_graph(c, from, to, in, out);
    piece.uses = uses_of(*g);
    piece.inputs = slot_count(in);
    piece.outputs = slot_count(out);
    std::string name = "hearth_piece_" + std::to_string(k);
    piece.function = std::make_unique<torch::jit::GraphFunction>(name, g, nullptr);
    program.pieces.push_back(std::move(piece));
  }
  return program;
}

}  // namespace
}  // namespace hearth_units

// Cuts `module`'s forward at the calls of the `n` unit paths `units`
// (hearth_units::build); *out receives the program.
extern "C" char *hearth_jit_cut(void *module, const char **units, int n, void **out) {
  return hearth_abi::guarded([&] {
    std::set<std::string> paths;
    for (int i = 0; i < n; ++i) {
      if (units[i][0] != '\0') paths.insert(units[i]);
    }
    auto &m = *static_cast<torch::jit::Module *>(module);
    *out = new hearth_units::Program(hearth_units::build(m, paths));
  });
}

extern "C" void hearth_jit_cut_free(void *program) {
  delete static_cast<hearth_units::Program *>(program);
}

extern "C" int hearth_jit_cut_pieces(void *program) {
  return static_cast<int>(static_cast<hearth_units::Program *>(program)->pieces.size());
}

// Piece `k`: how many tensors it takes and gives, its unit (to `unit`),
// and each module or tensor it uses (to `use`).
extern "C" char *hearth_jit_cut_piece(void *program, int k, int64_t *inputs, int64_t *outputs,
                                      void (*name)(void *, int, const char *), void *ctx) {
  return hearth_abi::guarded([&] {
    const auto &piece = static_cast<hearth_units::Program *>(program)->pieces.at(k);
    *inputs = static_cast<int64_t>(piece.inputs);
    *outputs = static_cast<int64_t>(piece.outputs);
    name(ctx, 0, piece.unit.c_str());
    for (const auto &use : piece.uses) name(ctx, 1, use.c_str());
  });
}

// Runs piece `k` on the `n` tensors `in`; each tensor it gives goes to
// `give` as a new at::Tensor, in order.
extern "C" char *hearth_jit_cut_run(void *program, int k, at::Tensor **in, int n,
                                    void (*give)(void *, at::Tensor *), void *ctx) {
  return hearth_abi::guarded([&] {
    auto &p = *static_cast<hearth_units::Program *>(program);
    auto &piece = p.pieces.at(k);
    if (static_cast<size_t>(n) != piece.inputs) {
      throw std::runtime_error("piece " + std::to_string(k) + " takes " +
                               std::to_string(piece.inputs) + " tensors, not " + std::to_string(n));
    }
    torch::jit::Stack stack;
    stack.reserve(n + 1);
    stack.emplace_back(p.self);
    for (int i = 0; i < n; ++i) stack.emplace_back(*in[i]);
    piece.function->run(stack);
    const auto &out = stack.back().toTupleRef().elements();
    for (const auto &v : out) give(ctx, new at::Tensor(v.toTensor()));
  });
}
