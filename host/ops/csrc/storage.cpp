// A parameter's memory dropped after its unit's forward pass and given
// back before that unit's backward (FULL_SHARD without recomputation, as
// FSDP's `_free_storage` / unshard do), and backward from given output
// gradients. Autograd keeps views of the parameter for backward (the
// transposed weight a matmul saved): they share its storage, so freeing
// the storage frees their memory too, and giving the storage memory again
// gives them their values back. The memory is moved in as it is (a data
// pointer changes hands), so no version counter moves and autograd's
// in-place check still holds.

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include "guarded.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace {

c10::StorageImpl *storage_of(const at::Tensor &t) {
  if (!t.has_storage()) throw std::runtime_error("a tensor without storage");
  return t.storage().unsafeGetStorageImpl();
}

}  // namespace

// The bytes t's storage holds now (0 once freed).
extern "C" int64_t hearth_storage_bytes(at::Tensor *t) {
  return t->has_storage() ? static_cast<int64_t>(storage_of(*t)->nbytes()) : 0;
}

// Frees the memory of t's storage; t and every view of it keep their
// sizes and must not be read until hearth_storage_take gives it back.
extern "C" char *hearth_storage_free(at::Tensor *t) {
  return hearth_abi::guarded([&] {
    auto *storage = storage_of(*t);
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
    storage->set_nbytes(0);
  });
}

// Gives t's freed storage the memory of `values` (t's sizes, contiguous,
// in a storage of its own), which is left empty and must be dropped.
extern "C" char *hearth_storage_take(at::Tensor *t, at::Tensor *values) {
  return hearth_abi::guarded([&] {
    const at::Tensor &v = *values;
    if (!t->is_contiguous() || t->storage_offset() != 0) {
      throw std::runtime_error("storage_take: the tensor is not a whole contiguous storage");
    }
    const size_t bytes = static_cast<size_t>(t->numel()) * t->element_size();
    auto *from = storage_of(v);
    auto *to = storage_of(*t);
    if (v.scalar_type() != t->scalar_type() || v.device() != t->device() || !v.is_contiguous() ||
        v.storage_offset() != 0 || from->nbytes() != bytes || v.numel() != t->numel()) {
      throw std::runtime_error("storage_take: the values are not a storage of the tensor's size, kind and device");
    }
    if (from == to) return;
    at::DataPtr moved = from->set_data_ptr(at::DataPtr(nullptr, from->device()));
    from->set_nbytes(0);
    to->set_data_ptr_noswap(std::move(moved));
    to->set_nbytes(bytes);
  });
}

// torch::autograd::backward(tensors, grads) over the n pairs given, the
// graph freed after it.
extern "C" char *hearth_autograd_backward(at::Tensor **tensors, at::Tensor **grads, int n) {
  return hearth_abi::guarded([&] {
    std::vector<at::Tensor> outputs, gradients;
    for (int i = 0; i < n; ++i) {
      outputs.push_back(*tensors[i]);
      gradients.push_back(*grads[i]);
    }
    torch::autograd::backward(outputs, gradients, /*retain_graph=*/false, /*create_graph=*/false);
  });
}
