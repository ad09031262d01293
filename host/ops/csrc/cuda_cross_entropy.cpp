// Cross-entropy of bfloat16 logits on a GPU in two kernels: the forward
// reads each row once (an online max and sum of exponentials) and keeps one
// log-sum-exp per row; the backward reads the row again and writes the
// gradient in bfloat16. What autocast does instead — cast the logits to
// float32, log_softmax, nll_loss, and the same three backwards — moves a
// [tokens, vocab] float32 tensor through memory six times; at GPT-2's
// vocabulary that was 3 to 4 ms of a 27 ms step on an H200.
//
// The kernels are CUDA C compiled at run time by NVRTC (the libnvrtc that
// torch's CUDA wheels install beside libcudart, opened with dlopen) for the
// GPU at hand, loaded and launched through the driver API (libcuda, opened
// likewise) on libtorch's current stream, so a CUDA graph captures them.
// Part of the embedded CUDA library (build.rs): it calls libtorch_cuda by
// symbol. hearth_ce_available says why the kernels cannot run, if they
// cannot; hearth then scores the logits as autocast would (train/loss.rs).

#include "guarded.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ne.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nvrtc.h>
#include <torch/csrc/autograd/custom_function.h>

#include <dlfcn.h>
#include <glob.h>
#include <link.h>

#include <array>
#include <mutex>
#include <string>
#include <vector>

namespace at::cuda {
cudaDeviceProp *getDeviceProperties(c10::DeviceIndex device);
}  // namespace at::cuda

namespace {

// One block per row. bfloat16 is handled as its 16 bits (no CUDA headers
// under NVRTC); 8 values at a time where rows start on 16 bytes.
const char *const kSource = R"CUDA(
typedef unsigned short bf16;
typedef long long i64;
struct alignas(16) Pack { unsigned int w[4]; };

__device__ __forceinline__ float widen(bf16 v) { return __uint_as_float(((unsigned int)v) << 16); }

// Round to nearest even, as at::BFloat16 does; NaN stays NaN.
__device__ __forceinline__ bf16 narrow(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (bf16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}

#define NEG_INF __int_as_float(0xff800000)

// (m, s): the largest value seen and the sum of exp(value - m).
__device__ __forceinline__ void add(float &m, float &s, float x) {
  if (x == NEG_INF) return;
  if (x > m) { s = s * expf(m - x) + 1.0f; m = x; }
  else s += expf(x - m);
}

__device__ __forceinline__ void merge(float &m, float &s, float m2, float s2) {
  if (m2 == NEG_INF) return;
  if (m == NEG_INF) { m = m2; s = s2; return; }
  if (m2 > m) { s = s * expf(m - m2) + s2; m = m2; }
  else s += s2 * expf(m2 - m);
}

// Per row: lse = log sum exp(x), loss = lse - x[target] (0 where the
// target is ignored, NaN where it is outside the vocabulary).
extern "C" __global__ void hearth_ce_forward(const bf16 *logits, const i64 *targets, float *loss,
                                             float *lse, i64 vocab, i64 ignore_index, int packed) {
  const bf16 *x = logits + (i64)blockIdx.x * vocab;
  float m = NEG_INF, s = 0.0f;
  if (packed) {
    const Pack *p = (const Pack *)x;
    for (i64 i = threadIdx.x; i < vocab / 8; i += blockDim.x) {
      Pack v = p[i];
      for (int k = 0; k < 4; ++k) {
        add(m, s, widen((bf16)(v.w[k] & 0xffffu)));
        add(m, s, widen((bf16)(v.w[k] >> 16)));
      }
    }
  } else {
    for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) add(m, s, widen(x[i]));
  }
  for (int offset = 16; offset > 0; offset >>= 1)
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
  __shared__ float ms[32], ss[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { ms[warp] = m; ss[warp] = s; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x / 32); ++w) merge(m, s, ms[w], ss[w]);
    const float row_lse = m + logf(s);
    const i64 t = targets[blockIdx.x];
    float row_loss;
    if (t == ignore_index) row_loss = 0.0f;
    else if (t < 0 || t >= vocab) row_loss = __int_as_float(0x7fc00000);
    else row_loss = row_lse - widen(x[t]);
    lse[blockIdx.x] = row_lse;
    loss[blockIdx.x] = row_loss;
  }
}

// grad = scale * (softmax(x) - onehot(target)), in bfloat16; 0 on the rows
// whose target is ignored. `scale` is the loss's gradient over the number
// of scored rows, on the device (nothing waits for it).
extern "C" __global__ void hearth_ce_backward(const bf16 *logits, const i64 *targets,
                                              const float *lse, const float *scale, bf16 *grad,
                                              i64 vocab, i64 ignore_index, int packed) {
  const i64 row = blockIdx.x;
  const bf16 *x = logits + row * vocab;
  bf16 *g = grad + row * vocab;
  const i64 t = targets[row];
  const bool scored = t != ignore_index;
  const float w = scored ? *scale : 0.0f, l = lse[row];
  if (packed) {
    const Pack *p = (const Pack *)x;
    Pack *q = (Pack *)g;
    for (i64 i = threadIdx.x; i < vocab / 8; i += blockDim.x) {
      Pack v = p[i], out;
      for (int k = 0; k < 4; ++k) {
        const i64 j = i * 8 + 2 * k;
        float lo = scored ? w * (expf(widen((bf16)(v.w[k] & 0xffffu)) - l) - (j == t ? 1.0f : 0.0f)) : 0.0f;
        float hi = scored ? w * (expf(widen((bf16)(v.w[k] >> 16)) - l) - (j + 1 == t ? 1.0f : 0.0f)) : 0.0f;
        out.w[k] = (unsigned int)narrow(lo) | ((unsigned int)narrow(hi) << 16);
      }
      q[i] = out;
    }
  } else {
    for (i64 j = threadIdx.x; j < vocab; j += blockDim.x)
      g[j] = narrow(scored ? w * (expf(widen(x[j]) - l) - (j == t ? 1.0f : 0.0f)) : 0.0f);
  }
}
)CUDA";

constexpr unsigned kThreads = 256;

// The NVRTC and driver functions used, resolved with dlsym.
struct Api {
  decltype(&nvrtcCreateProgram) create;
  decltype(&nvrtcCompileProgram) compile;
  decltype(&nvrtcGetProgramLogSize) log_size;
  decltype(&nvrtcGetProgramLog) log;
  decltype(&nvrtcGetCUBINSize) cubin_size;
  decltype(&nvrtcGetCUBIN) cubin;
  decltype(&nvrtcDestroyProgram) destroy;
  decltype(&cuCtxGetCurrent) ctx_get_current;
  decltype(&cuCtxSetCurrent) ctx_set_current;
  decltype(&cuDeviceGet) device_get;
  decltype(&cuDevicePrimaryCtxRetain) primary_ctx_retain;
  decltype(&cuModuleLoadData) module_load_data;
  decltype(&cuModuleGetFunction) module_get_function;
  decltype(&cuLaunchKernel) launch;
  decltype(&cuGetErrorString) error_string;
};

// Folders of the loaded CUDA wheels' libraries (libcudart, libcublas...):
// libnvrtc lies in the same one (CUDA 13) or in a sibling cuda_nvrtc/lib
// (CUDA 12), which need not be on the loader's path.
std::vector<std::string> cuda_library_folders() {
  std::vector<std::string> folders;
  dl_iterate_phdr(
      [](dl_phdr_info *info, size_t, void *data) {
        std::string path = info->dlpi_name ? info->dlpi_name : "";
        if (path.find("/nvidia/") != std::string::npos && path.find("/lib/lib") != std::string::npos) {
          std::string folder = path.substr(0, path.rfind('/'));
          auto *out = static_cast<std::vector<std::string> *>(data);
          out->push_back(folder);
          out->push_back(folder + "/../../cuda_nvrtc/lib");
        }
        return 0;
      },
      &folders);
  return folders;
}

void *find_nvrtc() {
  const char *names[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  for (const char *name : names)
    if (void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
  for (const std::string &folder : cuda_library_folders())
    for (const char *name : names)
      if (void *h = dlopen((folder + "/" + name).c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
  return nullptr;
}

// libnvrtc, with the libnvrtc-builtins beside it loaded first: NVRTC opens
// that by its bare name, which the loader finds only on its own path.
void *open_nvrtc() {
  void *nvrtc = find_nvrtc();
  Dl_info info{};
  void *symbol = nvrtc ? dlsym(nvrtc, "nvrtcCreateProgram") : nullptr;
  if (symbol && dladdr(symbol, &info) && info.dli_fname) {
    std::string path = info.dli_fname;
    glob_t found{};
    const std::string pattern = path.substr(0, path.rfind('/') + 1) + "libnvrtc-builtins.so.*";
    if (glob(pattern.c_str(), 0, nullptr, &found) == 0)
      for (size_t i = 0; i < found.gl_pathc; ++i) dlopen(found.gl_pathv[i], RTLD_NOW | RTLD_LOCAL);
    globfree(&found);
  }
  return nvrtc;
}

template <typename F> void resolve(void *handle, const char *name, F &out) {
  out = reinterpret_cast<F>(dlsym(handle, name));
  TORCH_CHECK(out, "hearth's cross-entropy kernels: ", name, " is missing");
}

const Api &api() {
  static const Api loaded = [] {
    Api a{};
    void *nvrtc = open_nvrtc();
    TORCH_CHECK(nvrtc, "hearth's cross-entropy kernels need NVRTC (libnvrtc.so.13 or .12, which "
                       "torch's CUDA wheels install beside libcudart); none could be opened");
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(cuda, "hearth's cross-entropy kernels: the CUDA driver (libcuda.so.1) could not be opened");
    resolve(nvrtc, "nvrtcCreateProgram", a.create);
    resolve(nvrtc, "nvrtcCompileProgram", a.compile);
    resolve(nvrtc, "nvrtcGetProgramLogSize", a.log_size);
    resolve(nvrtc, "nvrtcGetProgramLog", a.log);
    resolve(nvrtc, "nvrtcGetCUBINSize", a.cubin_size);
    resolve(nvrtc, "nvrtcGetCUBIN", a.cubin);
    resolve(nvrtc, "nvrtcDestroyProgram", a.destroy);
    resolve(cuda, "cuCtxGetCurrent", a.ctx_get_current);
    resolve(cuda, "cuCtxSetCurrent", a.ctx_set_current);
    resolve(cuda, "cuDeviceGet", a.device_get);
    resolve(cuda, "cuDevicePrimaryCtxRetain", a.primary_ctx_retain);
    resolve(cuda, "cuModuleLoadData", a.module_load_data);
    resolve(cuda, "cuModuleGetFunction", a.module_get_function);
    resolve(cuda, "cuLaunchKernel", a.launch);
    resolve(cuda, "cuGetErrorString", a.error_string);
    return a;
  }();
  return loaded;
}

void check_cu(CUresult r, const char *what) {
  if (r == CUDA_SUCCESS) return;
  const char *text = nullptr;
  api().error_string(r, &text);
  TORCH_CHECK(false, "hearth's cross-entropy kernels: ", what, ": ", text ? text : "unknown error");
}

// The kernels compiled for `device`'s architecture and loaded into its
// primary context, once per device.
struct Kernels {
  CUfunction forward = nullptr, backward = nullptr;
};

std::vector<char> compile(int major, int minor) {
  const Api &a = api();
  nvrtcProgram program;
  TORCH_CHECK(a.create(&program, kSource, "hearth_cross_entropy.cu", 0, nullptr, nullptr) == NVRTC_SUCCESS,
              "hearth's cross-entropy kernels: NVRTC could not create its program");
  const std::string arch = "--gpu-architecture=sm_" + std::to_string(major) + std::to_string(minor);
  const char *options[] = {arch.c_str(), "--std=c++17"};
  const nvrtcResult compiled = a.compile(program, 2, options);
  size_t size = 0;
  if (compiled != NVRTC_SUCCESS) {
    a.log_size(program, &size);
    std::string log(size, '\0');
    a.log(program, log.data());
    a.destroy(&program);
    TORCH_CHECK(false, "hearth's cross-entropy kernels did not compile for sm_", major, minor, ": ", log);
  }
  a.cubin_size(program, &size);
  std::vector<char> cubin(size);
  a.cubin(program, cubin.data());
  a.destroy(&program);
  return cubin;
}

const Kernels &kernels(c10::DeviceIndex device) {
  static std::mutex lock;
  static std::array<Kernels, 64> loaded{};
  TORCH_CHECK(device >= 0 && device < 64, "hearth's cross-entropy kernels: device ", int(device));
  std::lock_guard<std::mutex> guard(lock);
  Kernels &k = loaded[device];
  if (k.forward) return k;
  const Api &a = api();
  CUcontext context = nullptr;
  check_cu(a.ctx_get_current(&context), "cuCtxGetCurrent");
  if (!context) {
    CUdevice dev;
    check_cu(a.device_get(&dev, device), "cuDeviceGet");
    check_cu(a.primary_ctx_retain(&context, dev), "cuDevicePrimaryCtxRetain");
    check_cu(a.ctx_set_current(context), "cuCtxSetCurrent");
  }
  const cudaDeviceProp *p = at::cuda::getDeviceProperties(device);
  const std::vector<char> cubin = compile(p->major, p->minor);
  CUmodule module;
  check_cu(a.module_load_data(&module, cubin.data()), "cuModuleLoadData");
  check_cu(a.module_get_function(&k.backward, module, "hearth_ce_backward"), "cuModuleGetFunction");
  check_cu(a.module_get_function(&k.forward, module, "hearth_ce_forward"), "cuModuleGetFunction");
  return k;
}

void launch(CUfunction f, int64_t rows, void **args, c10::DeviceIndex device) {
  if (rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  check_cu(api().launch(f, unsigned(rows), 1, 1, kThreads, 1, 1, 0,
                        reinterpret_cast<CUstream>(stream), args, nullptr),
           "cuLaunchKernel");
}

struct FusedCrossEntropy : torch::autograd::Function<FusedCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &logits,
                            const at::Tensor &targets, int64_t ignore_index) {
    const c10::cuda::CUDAGuard guard(logits.device());
    at::Tensor x = logits.contiguous(), t = targets.contiguous();
    int64_t rows = x.size(0), vocab = x.size(1);
    const at::TensorOptions floats = x.options().dtype(at::kFloat);
    at::Tensor loss = at::empty({rows}, floats), lse = at::empty({rows}, floats);
    const void *xp = x.const_data_ptr(), *tp = t.const_data_ptr();
    void *lp = loss.mutable_data_ptr(), *sp = lse.mutable_data_ptr();
    int packed = vocab % 8 == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0;
    void *args[] = {&xp, &tp, &lp, &sp, &vocab, &ignore_index, &packed};
    launch(kernels(x.device().index()).forward, rows, args, x.device().index());
    const at::Tensor scored = t.ne(ignore_index).sum().to(at::kFloat);
    ctx->save_for_backward({x, t, lse, scored});
    ctx->saved_data["ignore_index"] = ignore_index;
    return at::div(loss.sum(), scored);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!torch::autograd::GradMode::is_enabled(),
                "hearth's bfloat16 cross-entropy has no second derivative (create_graph)");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &t = saved[1], &lse = saved[2], &scored = saved[3];
    const c10::cuda::CUDAGuard guard(x.device());
    int64_t ignore_index = ctx->saved_data["ignore_index"].toInt(), vocab = x.size(1);
    const at::Tensor scale = at::div(grads[0].to(at::kFloat), scored).contiguous();
    at::Tensor grad = at::empty_like(x);
    const void *xp = x.const_data_ptr(), *tp = t.const_data_ptr(), *lp = lse.const_data_ptr(),
               *cp = scale.const_data_ptr();
    void *gp = grad.mutable_data_ptr();
    int packed = vocab % 8 == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(gp) % 16 == 0;
    void *args[] = {&xp, &tp, &lp, &cp, &gp, &vocab, &ignore_index, &packed};
    launch(kernels(x.device().index()).backward, x.size(0), args, x.device().index());
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

// Whether the kernels can run on GPU `device` (compiling and loading them
// if they have not been): null if so, else why not.
char *hearth_ce_available(int device) {
  return hearth_abi::guarded([&] { kernels(static_cast<c10::DeviceIndex>(device)); });
}

// out = the mean cross-entropy of `logits` ([rows, vocab], bfloat16, on a
// GPU) against `targets` ([rows], int64), leaving out rows whose target is
// `ignore_index`: float32, as F.cross_entropy(logits.float(), targets)
// gives, with a bfloat16 gradient.
char *hearth_ce_bf16(at::Tensor *logits, at::Tensor *targets, int64_t ignore_index,
                     at::Tensor **out) {
  return hearth_abi::guarded([&] {
    TORCH_CHECK(logits->dim() == 2 && logits->scalar_type() == at::kBFloat16 && logits->is_cuda(),
                "hearth's cross-entropy kernels take [rows, vocab] bfloat16 logits on a GPU");
    TORCH_CHECK(targets->dim() == 1 && targets->size(0) == logits->size(0) &&
                    targets->scalar_type() == at::kLong && targets->device() == logits->device(),
                "hearth's cross-entropy kernels take one int64 target per row, on the logits' GPU");
    *out = new at::Tensor(FusedCrossEntropy::apply(*logits, *targets, ignore_index));
  });
}

}  // extern "C"
