// The two things the kernels of csrc/cuda spell differently for nvcc and for the host SIMT
// emulation (tools/cuda_host, compiled by a host C++ compiler with -DFLCE_CUDA_HOST):
//
//   launch_kernel<kernel>(grid, block, smem, stream, args...)
//       kernel<<<grid, block, smem, stream>>>(args...) under nvcc; under the emulation the whole
//       grid runs on the CPU inside the call. Either way the launch's error is then what
//       cudaGetLastError() returns.
//   max_active_ctas<kernel>(block, smem)
//       CTAs resident per SM (the occupancy API; a fixed answer under the emulation).
//   FLCE_DYNAMIC_SHARED(name);
//       extern __shared__ __align__(16) char name[]; (the launch's dynamic shared memory). The
//       emulation gives a pointer to its per-block arena (128-byte aligned, poisoned with 0xFF
//       before every block and watched by the race detector).
//
// Everything else (threadIdx, __syncthreads, shuffles, the bit casts) is the same source for both;
// the emulation provides host definitions in tools/cuda_host/host/simt.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#if defined(__CUDACC__)
#define FLCE_DYNAMIC_SHARED(name) extern __shared__ __align__(16) char name[]
#elif defined(FLCE_CUDA_HOST)
#include "host/simt.h"
#define FLCE_DYNAMIC_SHARED(name) char* const name = ::flce::host::dynamic_shared()
#else
#error "csrc/cuda kernels compile with nvcc, or as host C++ with -DFLCE_CUDA_HOST (emulation)"
#endif

namespace flce {
namespace cuda {

template <auto kKernel, typename... Args>
inline void launch_kernel(dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                          Args&&... args) {
#if defined(__CUDACC__)
  kKernel<<<grid, block, smem, stream>>>(static_cast<Args&&>(args)...);
#else
  ::flce::host::launch<kKernel>(grid, block, smem, stream, static_cast<Args&&>(args)...);
#endif
}

// CTAs of kKernel resident per SM at this block size and dynamic shared memory: the occupancy
// API under nvcc (registers, shared memory, the launch bounds); the host emulation, which knows
// neither, answers 2 (the row kernels' launch bounds allow 2-4 on sm_80 to sm_100).
template <auto kKernel>
inline int max_active_ctas(int block, std::size_t smem) {
#if defined(__CUDACC__)
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, block, smem) != cudaSuccess) {
    (void)cudaGetLastError();  // not an error of the next launch
    return 1;
  }
  return n > 0 ? n : 1;
#else
  (void)block;
  (void)smem;
  return 2;
#endif
}

}  // namespace cuda
}  // namespace flce
