// CUDA graphs for hearth: libtorch's at::cuda::CUDAGraph and CUDA streams
// behind a C ABI. Unlike shim.cpp this code calls libtorch_cuda and
// libc10_cuda by symbol, so it is built as a shared library of its own
// (build.rs), embedded in hearth and opened at run time only where
// libtorch_cuda is loaded (src/ops/cuda_graph.rs). Every function returns
// null on success or a malloc'd error message for hearth_free_error.

#include "guarded.h"
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>

namespace at::cuda {
// From ATen/cuda/CUDAContextLight.h, which would pull in the cuBLAS,
// cuSPARSE and cuSOLVER headers.
cudaDeviceProp *getDeviceProperties(c10::DeviceIndex device);
}  // namespace at::cuda

namespace {

using hearth_abi::guarded;

// The side stream that warm-up and capture run on (capture cannot use the
// default stream), and the stream that was current before.
std::optional<c10::cuda::CUDAStream> side;
std::optional<c10::cuda::CUDAStream> before;

}  // namespace

extern "C" {

void hearth_cg_free_error(char *error) { free(error); }

char *hearth_cg_new(void **out) {
  return guarded([&] { *out = new at::cuda::CUDAGraph(); });
}

void hearth_cg_delete(void *graph) { delete static_cast<at::cuda::CUDAGraph *>(graph); }

// Makes a side stream current, after the device has finished all queued work.
char *hearth_cg_enter_side_stream() {
  return guarded([&] {
    c10::cuda::device_synchronize();
    if (!side) side = c10::cuda::getStreamFromPool();
    before = c10::cuda::getCurrentCUDAStream();
    c10::cuda::setCurrentCUDAStream(*side);
  });
}

// Waits for the side stream's work and makes the earlier stream current again.
char *hearth_cg_leave_side_stream() {
  return guarded([&] {
    c10::cuda::device_synchronize();
    if (before) c10::cuda::setCurrentCUDAStream(*before);
    before.reset();
  });
}

// Starts capturing the current stream's work into `graph`, with a private
// memory pool for what it allocates.
char *hearth_cg_capture_begin(void *graph) {
  return guarded([&] { static_cast<at::cuda::CUDAGraph *>(graph)->capture_begin(); });
}

char *hearth_cg_capture_end(void *graph) {
  return guarded([&] { static_cast<at::cuda::CUDAGraph *>(graph)->capture_end(); });
}

// Launches the captured work on the current stream.
char *hearth_cg_replay(void *graph) {
  return guarded([&] { static_cast<at::cuda::CUDAGraph *>(graph)->replay(); });
}

// The GPU's name and compute capability.
char *hearth_cg_device(int index, char *name, size_t len, int *major, int *minor) {
  return guarded([&] {
    cudaDeviceProp *p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
    snprintf(name, len, "%s", p->name);
    *major = p->major;
    *minor = p->minor;
  });
}

}  // extern "C"
