// The host side that the fused logits GEMMs (csrc/cuda/sm90, csrc/cuda/sm100) share: the
// epilogue's parameters, the operand checks, CUTLASS's arguments, and the launch. Included by
// those two CUTLASS translation units only, after their NDEBUG (Gemm is their
// GemmUniversalAdapter).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "cuda/params.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/gemm.h"

namespace flce {
namespace cuda {
namespace fused_gemm {

// What the epilogue reads, per launch.
struct EpilogueParams {
  const float* bias;  // [v] or nullptr
  float softcap;      // <= 0: none
  float temperature;
  const int64_t* target;
  int64_t target_stride;
  int64_t col_offset;
  int64_t ignore_index;
  int64_t v;
  __nv_bfloat16* e;  // [n, v], row stride e_ld
  int64_t e_ld;
  float* partials;   // [n, tiles, kPartialCols]
  int64_t tiles;     // ceil(v / kFusedTileCols)
};

// The operands' type (x, w and E alike) and the elements of one 16-byte access of it: TMA's
// rule for x's and w's base pointers and row strides, E's for the epilogues' stores.
using Element = cutlass::bfloat16_t;
constexpr int kAlignment = 16 / sizeof(Element);

// The CUTLASS plumbing of an operator-style collective epilogue that stores E and the partials
// itself: no C / D tensor for CUTLASS to load or store, no workspace, its parameters as given.
struct EpilogueBase {
  using ElementC = Element;
  using ElementD = Element;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = cute::Stride<int64_t, cute::_1, int64_t>;
  using ThreadEpilogueOp = void;
  struct SharedStorage {};
  using Arguments = EpilogueParams;
  using Params = EpilogueParams;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  // E, the partials and the targets given, N the shard's columns, and E's base and row stride
  // allowing stores of store_elems elements.
  template <class ProblemShape>
  static bool args_ok(ProblemShape const& problem_shape, Arguments const& args,
                      int64_t store_elems) {
    return args.e != nullptr && args.partials != nullptr && args.target != nullptr &&
           args.e_ld % store_elems == 0 &&
           reinterpret_cast<uintptr_t>(args.e) % (store_elems * sizeof(Element)) == 0 &&
           args.v == int64_t(cute::get<1>(problem_shape));
  }
};

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Shapes CUTLASS takes as int, and the 16-byte rule above.
inline bool operands_ok(const FusedLogitsParams& p) {
  if (p.n <= 0 || p.v <= 0 || p.d <= 0 || p.n > INT_MAX || p.v > INT_MAX || p.d > INT_MAX) {
    return false;
  }
  return aligned16(p.x) && aligned16(p.w) && aligned16(p.e) && p.x_ld % kAlignment == 0 &&
         p.w_ld % kAlignment == 0 && p.e_ld % kAlignment == 0 && p.d % kAlignment == 0 &&
         p.x_ld >= p.d && p.w_ld >= p.d && p.e_ld >= p.v;
}

inline int sm_count_of(int device) {
  int sm_count = 0;
  if (cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return sm_count;
}

// probe(device) once per device and process (a few microseconds of host work, no stream work:
// safe under graph capture); flag: the caller's own cache, one per kernel.
template <class Probe>
bool once_per_device(std::atomic<int> (&known)[64], int device, Probe&& probe) {
  if (device < 0 || device >= 64) return false;
  const int k = known[device].load(std::memory_order_relaxed);  // 0 unknown, 1 yes, 2 no
  if (k != 0) return k == 1;
  const bool yes = probe(device);
  (void)cudaGetLastError();  // a failed query is not the next launch's error
  known[device].store(yes ? 1 : 2, std::memory_order_relaxed);
  return yes;
}

// The compute capability of device, or (0, 0).
inline void capability(int device, int& major, int& minor) {
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    major = minor = 0;
  }
}

// CUTLASS's arguments for p on a device of sm_count SMs: x [n, d] is A = (M, K) K-major, w [v, d]
// is B = (N, K) K-major.
template <class Gemm>
typename Gemm::Arguments make_args(const FusedLogitsParams& p, int device, int sm_count) {
  using ElementA = typename Gemm::GemmKernel::ElementA;
  using ElementB = typename Gemm::GemmKernel::ElementB;
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = cute::make_shape(int(p.n), int(p.v), int(p.d), 1);
  args.mainloop.ptr_A = static_cast<const ElementA*>(p.x);
  args.mainloop.dA = cute::make_stride(p.x_ld, cute::_1{}, int64_t(0));
  args.mainloop.ptr_B = static_cast<const ElementB*>(p.w);
  args.mainloop.dB = cute::make_stride(p.w_ld, cute::_1{}, int64_t(0));
  args.epilogue = EpilogueParams{p.bias,          p.softcap,
                                 p.temperature,   p.target,
                                 p.target_stride, p.col_offset,
                                 p.ignore_index,  p.v,
                                 static_cast<__nv_bfloat16*>(p.e), p.e_ld,
                                 p.partials,      (p.v + kFusedTileCols - 1) / kFusedTileCols};
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

// Whether Gemm takes p on the current device, runs_kernel(device) telling whether the device
// runs this module's real kernel image: the operands, then CUTLASS's own checks and no
// workspace (there is no allocator here: a configuration that needed one is refused rather
// than run without it). The caller may ask before it has E, the partials or the targets:
// stand-ins at an aligned address (only their alignment is read).
template <class Gemm, class RunsKernel>
bool supported(const FusedLogitsParams& p, RunsKernel&& runs_kernel) {
  if (!operands_ok(p)) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const int sm_count = sm_count_of(device);
  if (sm_count <= 0 || !runs_kernel(device)) return false;
  FusedLogitsParams q = p;
  void* const stand_in = reinterpret_cast<void*>(uintptr_t{256});
  if (q.e == nullptr) q.e = stand_in;
  if (q.partials == nullptr) q.partials = static_cast<float*>(stand_in);
  if (q.target == nullptr) q.target = static_cast<const int64_t*>(stand_in);
  const typename Gemm::Arguments args = make_args<Gemm>(q, device, sm_count);
  return Gemm::get_workspace_size(args) == 0 &&
         Gemm::can_implement(args) == cutlass::Status::kSuccess;
}

inline cudaError_t status_error(cutlass::Status s) {
  if (s == cutlass::Status::kSuccess) return cudaSuccess;
  const cudaError_t last = cudaGetLastError();
  return last != cudaSuccess ? last : cudaErrorUnknown;
}

// One launch on stream, once supported() said yes (the caller's launcher checks again).
template <class Gemm>
cudaError_t launch(const FusedLogitsParams& p, cudaStream_t stream) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  Gemm gemm;
  cutlass::Status s = gemm.initialize(make_args<Gemm>(p, device, sm_count_of(device)), nullptr,
                                      stream);
  if (s != cutlass::Status::kSuccess) return status_error(s);
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return status_error(s);
  return cudaGetLastError();
}

}  // namespace fused_gemm
}  // namespace cuda
}  // namespace flce
