// libtorch's Kineto profiler, as torch.profiler drives it: prepare (warm-up),
// enable (record), disable (the result: events and a Chrome trace), and
// record_function spans for hearth's own steps.
//
// Same conventions as shim.cpp: nothing throws across the C boundary;
// functions return NULL or an error message freed with hearth_free_error.

#include "guarded.h"
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>

// From torch/csrc/profiler/kineto_shim.h, which needs Kineto's own headers.
namespace torch::autograd::profiler {
TORCH_API void addMetadataJson(const std::string &key, const std::string &value);
}

namespace {

using hearth_abi::guarded;
using torch::autograd::profiler::ProfilerResult;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// The bits of `activities` the Rust side sets (ProfilerActivity).
constexpr int kCpu = 1;
constexpr int kCuda = 2;

ProfilerConfig config(bool shapes, bool memory, bool stack, bool flops, bool modules) {
  return ProfilerConfig(ProfilerState::KINETO, shapes, memory, stack, flops, modules);
}

std::set<ActivityType> activity_set(int activities) {
  std::set<ActivityType> out;
  if (activities & kCpu) out.insert(ActivityType::CPU);
  if (activities & kCuda) out.insert(ActivityType::CUDA);
  return out;
}

// A record_function span: owns its name, since RecordFunction keeps a view.
struct Span {
  explicit Span(const char *name) : name(name), record(at::RecordScope::USER_SCOPE) {
    if (record.isActive()) record.before(std::string_view(this->name));
  }
  std::string name;
  at::RecordFunction record;
};

}  // namespace

extern "C" {

// torch.profiler's prepare_trace: Kineto starts up (warm-up steps).
char *hearth_profiler_prepare(int activities, bool shapes, bool memory, bool stack, bool flops,
                              bool modules) {
  return guarded([&] {
    torch::autograd::profiler::prepareProfiler(config(shapes, memory, stack, flops, modules),
                                               activity_set(activities));
  });
}

// torch.profiler's start_trace: events are recorded from here on, on this
// thread (and, for CUDA, on the device).
char *hearth_profiler_enable(int activities, bool shapes, bool memory, bool stack, bool flops,
                             bool modules) {
  return guarded([&] {
    torch::autograd::profiler::enableProfiler(config(shapes, memory, stack, flops, modules),
                                              activity_set(activities));
  });
}

// A key of the trace's top-level object (torch.profiler's
// add_metadata_json); `value` is JSON text. Only while recording.
char *hearth_profiler_add_metadata(const char *key, const char *value) {
  return guarded([&] { torch::autograd::profiler::addMetadataJson(key, value); });
}

// torch.profiler's stop_trace: recording ends; `*out` owns what was recorded
// (freed with hearth_profiler_result_free).
char *hearth_profiler_disable(ProfilerResult **out) {
  return guarded([&] { *out = torch::autograd::profiler::disableProfiler().release(); });
}

// Writes the Chrome trace (the file torch.profiler's export_chrome_trace writes).
char *hearth_profiler_save(ProfilerResult *result, const char *path) {
  return guarded([&] { result->save(path); });
}

void hearth_profiler_result_free(ProfilerResult *result) { delete result; }

// Calls `on_event` for each recorded event, with its name, start and
// duration in nanoseconds, thread, Kineto activity type, device type,
// estimated FLOPs and the bytes a memory event (de)allocated.
char *hearth_profiler_events(ProfilerResult *result, void *ctx,
                             void (*on_event)(void *, const char *, uint64_t, uint64_t, uint64_t,
                                              uint8_t, int, uint64_t, int64_t)) {
  return guarded([&] {
    for (const auto &event : result->events()) {
      auto name = event.name();
      on_event(ctx, name.c_str(), event.startNs(), event.durationNs(), event.startThreadId(),
               event.activityType(), static_cast<int>(event.deviceType()), event.flops(),
               event.nBytes());
    }
  });
}

// A record_function("name") span on this thread; ended by
// hearth_span_exit. Cheap when no profiler is recording.
void *hearth_span_enter(const char *name) {
  try {
    return new Span(name);
  } catch (...) {
    return nullptr;
  }
}

void hearth_span_exit(void *span) { delete static_cast<Span *>(span); }

}  // extern "C"
