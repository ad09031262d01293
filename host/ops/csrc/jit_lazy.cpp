// Loading a TorchScript file without reading its weights (issue 59: under
// FULL_SHARD no process holds the whole model, the load included). The
// archive is read through an adapter that skips the bytes of its tensor
// records (`<archive>/data/<n>` in the zip, `data/<n>` to the reader): libtorch allocates each storage as usual
// but its memory is never written, so the kernel never gives it pages, and
// the adapter notes where in the file each storage's bytes are. hearth
// then reads a storage's bytes (hearth_jit_lazy_read) when the unit
// holding it is about to be sharded, one unit at a time.

#include <caffe2/serialize/file_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>

#include "guarded.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace hearth_lazy {
namespace {

// Where each storage's bytes are in the file, by the storage's memory.
struct Records {
  struct Range {
    uint64_t start;
    uint64_t size;
  };
  std::vector<Range> ranges;  // the tensor records, by start
  std::map<const char *, Range> by_memory;
  std::mutex lock;
};

// The file, its tensor records' bytes skipped (their destinations noted).
class Skipping final : public caffe2::serialize::ReadAdapterInterface {
 public:
  Skipping(const std::string &path, Records *records) : file_(path), records_(records) {}
  size_t size() const override { return file_.size(); }
  size_t read(uint64_t pos, void *buf, size_t n, const char *what) const override {
    std::lock_guard<std::mutex> hold(records_->lock);
    auto &ranges = records_->ranges;
    auto it = std::upper_bound(ranges.begin(), ranges.end(), pos,
                               [](uint64_t p, const Records::Range &r) { return p < r.start; });
    if (it != ranges.begin()) {
      const auto &r = *std::prev(it);
      if (pos >= r.start && pos + n <= r.start + r.size && n > 0) {
        records_->by_memory[static_cast<const char *>(buf) - (pos - r.start)] = r;
        return n;
      }
    }
    return file_.read(pos, buf, n, what);
  }

 private:
  caffe2::serialize::FileAdapter file_;
  Records *records_;
};

// The file offsets and sizes of the archive's tensor records.
std::vector<Records::Range> tensor_records(const std::string &path) {
  caffe2::serialize::PyTorchStreamReader reader(path);
  std::vector<Records::Range> ranges;
  // The reader names records from the archive's root: `data/<n>` are the
  // tensors' storages (`constants/`, `code/` and the pickles are read).
  for (const auto &name : reader.getAllRecords()) {
    if (name.rfind("data/", 0) != 0 || name.find('/', 5) != std::string::npos) continue;
    const size_t size = reader.getRecordSize(name);
    if (size == 0) continue;
    ranges.push_back({reader.getRecordOffset(name), size});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Records::Range &a, const Records::Range &b) { return a.start < b.start; });
  return ranges;
}

// A module loaded lazily, and where its storages' bytes are.
struct Lazy {
  std::string path;
  Records records;
};

}  // namespace
}  // namespace hearth_lazy

// Loads the module at `path` on the CPU without reading its tensors' bytes;
// *out gets the module, *lazy what hearth_jit_lazy_read needs.
extern "C" char *hearth_jit_load_lazy(const char *path, void **out, void **lazy) {
  return hearth_abi::guarded([&] {
    auto state = std::make_unique<hearth_lazy::Lazy>();
    state->path = path;
    state->records.ranges = hearth_lazy::tensor_records(path);
    auto adapter = std::make_shared<hearth_lazy::Skipping>(path, &state->records);
    *out = new torch::jit::Module(torch::jit::load(adapter, at::Device(at::kCPU)));
    *lazy = state.release();
  });
}

extern "C" void hearth_jit_lazy_free(void *lazy) { delete static_cast<hearth_lazy::Lazy *>(lazy); }

// The memory and size of t's storage (the pointer as an integer, 0 for a
// storage without memory).
extern "C" void hearth_storage_of(at::Tensor *t, uint64_t *memory, uint64_t *bytes) {
  if (!t->has_storage()) {
    *memory = *bytes = 0;
    return;
  }
  const auto &s = t->storage();
  *memory = reinterpret_cast<uint64_t>(s.data());
  *bytes = s.nbytes();
}

// Where in the file the storage at `memory` has its bytes: *offset and
// *size; false when that storage was not skipped (read already, or not
// from the file).
extern "C" bool hearth_jit_lazy_find(void *lazy, uint64_t memory, uint64_t *offset, uint64_t *size) {
  auto &records = static_cast<hearth_lazy::Lazy *>(lazy)->records;
  std::lock_guard<std::mutex> hold(records.lock);
  auto it = records.by_memory.find(reinterpret_cast<const char *>(memory));
  if (it == records.by_memory.end()) return false;
  *offset = it->second.start;
  *size = it->second.size;
  return true;
}

// Forgets the storage at `memory` (its bytes were read).
extern "C" void hearth_jit_lazy_done(void *lazy, uint64_t memory) {
  auto &records = static_cast<hearth_lazy::Lazy *>(lazy)->records;
  std::lock_guard<std::mutex> hold(records.lock);
  records.by_memory.erase(reinterpret_cast<const char *>(memory));
}

