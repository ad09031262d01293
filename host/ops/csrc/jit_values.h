// What the graph passes (jit_fuse.cpp, jit_patterns.cpp) read of a
// TorchScript value: the constant it holds, if any, as a number, an int, a
// bool or None.
#pragma once

#include <torch/csrc/jit/ir/ir.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace hearth_jit_values {

using torch::jit::Value;

// What a prim::Constant holds; none for any other value.
inline std::optional<c10::IValue> constant(Value *v) {
  if (v->node()->kind() != c10::prim::Constant) return std::nullopt;
  return torch::jit::toIValue(v);
}

// The number a constant holds: a Python float, int or bool, or a
// one-element floating tensor (a traced Python scalar); none for anything
// else.
inline std::optional<double> constant_number(Value *v) {
  auto iv = constant(v);
  if (!iv) return std::nullopt;
  if (iv->isDouble()) return iv->toDouble();
  if (iv->isInt()) return static_cast<double>(iv->toInt());
  if (iv->isBool()) return iv->toBool() ? 1.0 : 0.0;
  if (iv->isTensor()) {
    const auto &t = iv->toTensor();
    if (t.defined() && t.numel() == 1 && (t.is_floating_point() || t.scalar_type() == at::kLong))
      return t.item<double>();
  }
  return std::nullopt;
}

inline bool is_number(Value *v, double want) {
  auto got = constant_number(v);
  return got && std::fabs(*got - want) <= 1e-6 * std::fabs(want);
}

inline std::optional<int64_t> constant_int(Value *v) {
  auto iv = constant(v);
  return iv && iv->isInt() ? std::optional<int64_t>(iv->toInt()) : std::nullopt;
}

inline std::optional<bool> constant_bool(Value *v) {
  auto iv = constant(v);
  return iv && iv->isBool() ? std::optional<bool>(iv->toBool()) : std::nullopt;
}

inline bool is_none(Value *v) {
  auto iv = constant(v);
  return iv && iv->isNone();
}

}  // namespace hearth_jit_values
