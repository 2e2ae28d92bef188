// Device helpers shared by the flce kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "device.cuh"
#include "flce/math.h"

namespace flce {
namespace cuda {

// Column of the target within a weight block whose row 0 is vocabulary id col_offset, or -1 when
// the row is ignored or the block does not hold the target.
__device__ __forceinline__ int64_t target_column(int64_t t, int64_t ignore_index,
                                                 int64_t col_offset, int64_t cols) {
  if (t == ignore_index) return -1;
  const int64_t c = t - col_offset;
  return (c >= 0 && c < cols) ? c : -1;
}

// Conversions between fp32 and the storage dtypes (round to nearest even).
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}

// Row `row` of launch_row_coef's coefficients [n, 8] = (ref, a, u, dz_t), (div, h, k, rdiv).
__device__ __forceinline__ RowGrad load_row_grad(const float* coef, int64_t row) {
  const float4 c = *reinterpret_cast<const float4*>(coef + row * 8);
  const float4 c2 = *reinterpret_cast<const float4*>(coef + row * 8 + 4);
  return RowGrad{c.x, c.y, c.z, c.w, c2.x, c2.y, c2.z, c2.w};
}

// One row of partial statistics [kPartialCols] = (m, s, z_t, sum_z, u), and back.
__device__ __forceinline__ void store_partial(float* q, OnlineLse st, float zt, float sum) {
  q[0] = st.m;
  q[1] = st.s;
  q[2] = zt;
  q[3] = sum;
  q[4] = st.u;
}
__device__ __forceinline__ OnlineLse partial_lse(const float* q) {
  return OnlineLse{q[0], q[1], q[4]};
}

// One row's partial statistics as a kernel merges them (threads, warps, column splits, tiles):
// the non-target state, the target logit (-inf where the columns do not hold it) and the logit
// sum.
struct RowPartial {
  OnlineLse lse;
  float zt;
  float sum;
};

__device__ __forceinline__ RowPartial merge(RowPartial a, const RowPartial& b) {
  a.lse = lse_merge(a.lse, b.lse);
  if (b.zt != neg_inf()) a.zt = b.zt;  // only the owner of the target column has one
  a.sum += b.sum;
  return a;
}

// Every lane of the warp ends with the merge of the warp's 32 partials (a butterfly: lse_merge
// and + are symmetric in their arguments, so both partners compute the same value).
__device__ __forceinline__ RowPartial warp_merge(RowPartial p) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    RowPartial o;
    o.lse.m = __shfl_xor_sync(0xffffffffu, p.lse.m, off);
    o.lse.s = __shfl_xor_sync(0xffffffffu, p.lse.s, off);
    o.lse.u = __shfl_xor_sync(0xffffffffu, p.lse.u, off);
    o.zt = __shfl_xor_sync(0xffffffffu, p.zt, off);
    o.sum = __shfl_xor_sync(0xffffffffu, p.sum, off);
    p = merge(p, o);
  }
  return p;
}

// kVec4 values of T moved with one access (16 bytes for fp32, 8 for 16-bit types).
constexpr int kVec4 = 4;
template <typename T>
struct alignas(sizeof(T) * kVec4) Pack {
  T v[kVec4];
};

// True when ptr allows Pack<T> accesses (element offsets that are multiples of kVec4).
template <typename T>
__device__ __forceinline__ bool pack_aligned(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % sizeof(Pack<T>) == 0;
}

}  // namespace cuda
}  // namespace flce
