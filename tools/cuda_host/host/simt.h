// flce host SIMT emulation: what CUDA device code sees when a .cu file is compiled by a host C++
// compiler with -DFLCE_CUDA_HOST (included from csrc/cuda/device.cuh, never directly).
//
// The CUDA headers (cuda_runtime.h, cuda_bf16.h, cuda_fp16.h) compile as host C++ and give the
// types (dim3, float4, __half, __nv_bfloat16) and the host conversions; this header adds the
// device side: threadIdx/blockIdx/blockDim/gridDim, __syncthreads, the warp shuffles and votes,
// __cvta_generic_to_shared, the bit casts and the launch. All of it is implemented out of line by
// the runtime (runtime.cpp), which is not instrumented: in a race-checked build only the kernel
// code is.
#pragma once

#if defined(__CUDACC__)
#error "tools/cuda_host/host/simt.h is the host emulation; nvcc compiles the real device code"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <tuple>
#include <type_traits>

#include "runtime.h"

// Function-scope __shared__ variables: blocks run one after another, so one static object per
// variable is the block's copy. (Dynamic shared memory, FLCE_DYNAMIC_SHARED in device.cuh, is the
// poisoned, race-checked arena; static __shared__ storage is neither poisoned nor race-checked.)
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)

using std::isinf;
using std::isnan;

namespace flce {
namespace host {
namespace detail {

struct ThreadView {
  uint3 idx;
};

// What inline kernel code reads of the execution state (one object: the race detector skips it).
struct ExecView {
  const ThreadView* thread;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  char* dynamic_smem;
};
extern ExecView g_view;

enum class Op : int {
  kShflIdx,
  kShflUp,
  kShflDown,
  kShflXor,
  kVoteAny,
  kVoteAll,
  kVoteBallot,
};

void syncthreads(const char* file, unsigned line);
void shfl(Op op, unsigned mask, void* value, int bytes, int arg, int width, const char* file,
          unsigned line);
unsigned vote(Op op, unsigned mask, int pred, const char* file, unsigned line);
std::size_t cvta_generic_to_shared(const void* p, const void* pc);

struct LaunchSpec {
  const void* kernel;
  const char* signature;  // __PRETTY_FUNCTION__ of kernel_signature<kKernel>()
  dim3 grid;
  dim3 block;
  std::size_t dynamic_smem;
  bool instrumented;  // the kernel's TU was compiled with -fsanitize=thread
};
void run_launch(const LaunchSpec& spec, void (*thunk)(void*), void* params);

template <auto kKernel>
const char* kernel_signature() {
  return __PRETTY_FUNCTION__;
}

template <auto kKernel, typename Tuple>
void thunk(void* params) {
  std::apply(kKernel, *static_cast<Tuple*>(params));
}

template <typename Fn>
struct KernelParams;
template <typename... P>
struct KernelParams<void (*)(P...)> {
  using type = std::tuple<std::decay_t<P>...>;
};

}  // namespace detail

// The host version of kernel<<<grid, block, smem, stream>>>(args...): arguments are converted to
// the kernel's parameter types once, as a launch copies them to parameter memory, and every
// emulated thread calls the kernel with them. Runs the whole grid before it returns.
template <auto kKernel, typename... Args>
void launch(dim3 grid, dim3 block, std::size_t smem, cudaStream_t, Args&&... args) {
  using Params = typename detail::KernelParams<decltype(kKernel)>::type;
  Params params(static_cast<Args&&>(args)...);
#if defined(__SANITIZE_THREAD__)
  constexpr bool kInstrumented = true;
#else
  constexpr bool kInstrumented = false;
#endif
  const detail::LaunchSpec spec{reinterpret_cast<const void*>(kKernel),
                                detail::kernel_signature<kKernel>(), grid, block, smem,
                                kInstrumented};
  detail::run_launch(spec, &detail::thunk<kKernel, Params>, &params);
}

inline char* dynamic_shared() { return detail::g_view.dynamic_smem; }

}  // namespace host
}  // namespace flce

// The C++ overload that cuda_runtime.h declares for nvcc only.
template <class T>
inline cudaError_t cudaFuncSetAttribute(T* func, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(func), attr, value);
}

#define threadIdx (::flce::host::detail::g_view.thread->idx)
#define blockIdx (::flce::host::detail::g_view.block_idx)
#define blockDim (::flce::host::detail::g_view.block_dim)
#define gridDim (::flce::host::detail::g_view.grid_dim)
inline constexpr int warpSize = 32;

inline void __syncthreads(std::source_location loc = std::source_location::current()) {
  ::flce::host::detail::syncthreads(loc.file_name(), loc.line());
}

#define FLCE_HOST_SHFL(NAME, OP)                                                                  \
  template <typename T>                                                                          \
  inline T NAME(unsigned mask, T var, int arg, int width = warpSize,                             \
                std::source_location loc = std::source_location::current()) {                    \
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move <= 8 bytes"); \
    ::flce::host::detail::shfl(::flce::host::detail::Op::OP, mask, &var, sizeof(T), arg, width,  \
                               loc.file_name(), loc.line());                                      \
    return var;                                                                                  \
  }
FLCE_HOST_SHFL(__shfl_sync, kShflIdx)
FLCE_HOST_SHFL(__shfl_up_sync, kShflUp)
FLCE_HOST_SHFL(__shfl_down_sync, kShflDown)
FLCE_HOST_SHFL(__shfl_xor_sync, kShflXor)
#undef FLCE_HOST_SHFL

inline int __any_sync(unsigned mask, int pred,
                      std::source_location loc = std::source_location::current()) {
  return static_cast<int>(::flce::host::detail::vote(::flce::host::detail::Op::kVoteAny, mask,
                                                     pred, loc.file_name(), loc.line()));
}
inline int __all_sync(unsigned mask, int pred,
                      std::source_location loc = std::source_location::current()) {
  return static_cast<int>(::flce::host::detail::vote(::flce::host::detail::Op::kVoteAll, mask,
                                                     pred, loc.file_name(), loc.line()));
}
inline unsigned __ballot_sync(unsigned mask, int pred,
                              std::source_location loc = std::source_location::current()) {
  return ::flce::host::detail::vote(::flce::host::detail::Op::kVoteBallot, mask, pred,
                                    loc.file_name(), loc.line());
}

__attribute__((noinline)) inline std::size_t __cvta_generic_to_shared(const void* p) {
  return ::flce::host::detail::cvta_generic_to_shared(p, __builtin_return_address(0));
}

inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}
inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, sizeof(i));
  return i;
}
