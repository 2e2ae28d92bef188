// Small deterministic reductions and elementwise passes: the split/rank combine, column sums of
// the bias-gradient partials, and the compensated accumulation of the GEMM results.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "flce/math.h"
#include "params.h"
#include "static_switch.h"

namespace flce {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// Grid-stride launches: cap the grid, loop with 64-bit indices.
unsigned grid_for(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
}

template <bool kFinalize>
__global__ void combine_kernel(const CombineParams p) {
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < p.n;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    OnlineLse st = lse_empty();
    float zt = neg_inf(), sum = 0.f, comp = 0.f;
    for (int64_t r = 0; r < p.ranks; ++r) {  // fixed order: deterministic
      const float* q = p.partials + (r * p.n + row) * kPartialCols;
      st = lse_merge(st, partial_lse(q));
      if (q[2] != neg_inf()) zt = q[2];  // only the owner has it (NaN passes through)
      kahan_add(sum, comp, q[3]);
    }
    if (!kFinalize) {
      store_partial(p.merged + row * kPartialCols, st, zt, kahan_result(sum, comp));
      continue;
    }
    const int64_t t = p.target[row * p.target_stride];
    const bool ignored = t == p.ignore_index;
    // A benign race: every offending thread stores the same value.
    if (!ignored && (t < 0 || t >= p.vocab_size)) *p.error_flag = 1;
    const LossOptions opt{p.label_smoothing, p.z_loss, 0.f, p.vocab_size};
    const RowLoss rl = row_loss(st, zt, kahan_result(sum, comp), ignored, opt);
    p.loss[row] = rl.loss;
    p.lse[row] = rl.lse;
    if (p.entropy != nullptr) p.entropy[row] = row_entropy(st, zt, ignored);
    // (m_x, s_x, z_t, u_x): the backward's p_j = exp(z_j - M) / S, and the entropy's state
    float* out = p.stats + row * kStatsCols;
    out[0] = st.m;
    out[1] = st.s;
    out[2] = zt;
    out[3] = st.u;
  }
}

// A target distribution's states, merged in rank order (soft_merge keeps the earlier pivot on
// ties: a fixed order gives a fixed pivot).
template <bool kFinalize>
__global__ void soft_combine_kernel(const SoftCombineParams p) {
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < p.n;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    SoftRow st = soft_empty();
    for (int64_t r = 0; r < p.ranks; ++r) {
      st = soft_merge(st, soft_load(p.partials + (r * p.n + row) * kSoftCols,
                                    p.pivots[r * p.n + row]));
    }
    soft_store(st, p.stats + row * kSoftCols);
    p.pivot[row] = st.a;
    if (!kFinalize) continue;
    const SoftLoss sl =
        soft_row_loss(st, p.z_weight != nullptr ? p.z_weight[row] : st.y_a + st.y_rest, p.z_loss);
    p.loss[row] = sl.loss;
    p.lse[row] = sl.lse;
    if (p.entropy != nullptr) p.entropy[row] = row_entropy(st.x, st.p, st.a < 0);
  }
}

__global__ void column_sum_kernel(const float* __restrict__ x, int64_t rows, int64_t cols,
                                  float* __restrict__ out) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f, comp = 0.f;
    for (int64_t r = 0; r < rows; ++r) kahan_add(s, comp, x[r * cols + c]);
    out[c] = kahan_result(s, comp);
  }
}

__global__ void kahan_accumulate_kernel(float* __restrict__ sum, float* __restrict__ comp,
                                        const float* __restrict__ x, int64_t count,
                                        const float* __restrict__ inv_scale) {
  const float k = inv_scale != nullptr ? *inv_scale : 1.f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = sum[i], c = comp[i];
    kahan_add(s, c, x[i] * k);  // k is a power of two: exact unless x * k leaves fp32 range
    sum[i] = s;
    comp[i] = c;
  }
}

template <typename T>
__global__ void scale_store_kernel(T* __restrict__ out, const float* __restrict__ x,
                                   int64_t count, const float* __restrict__ inv_scale) {
  const float k = inv_scale != nullptr ? *inv_scale : 1.f;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // Packs of kVec4 elements where both pointers allow them, then the tail one by one.
  const int64_t packs = pack_aligned<T>(out) && pack_aligned<float>(x) ? count / kVec4 : 0;
  for (int64_t i = start; i < packs; i += stride) {
    const Pack<float> q = reinterpret_cast<const Pack<float>*>(x)[i];
    Pack<T> o;
#pragma unroll
    for (int e = 0; e < kVec4; ++e) o.v[e] = from_float<T>(q.v[e] * k);
    reinterpret_cast<Pack<T>*>(out)[i] = o;
  }
  for (int64_t i = packs * kVec4 + start; i < count; i += stride) {
    out[i] = from_float<T>(x[i] * k);
  }
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, bool finalize, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  BOOL_SWITCH(finalize, kFinalize, [&] {
    launch_kernel<combine_kernel<kFinalize>>(dim3(grid_for(p.n)), dim3(kThreads), 0, stream, p);
  });
  return cudaGetLastError();
}

cudaError_t launch_soft_combine(const SoftCombineParams& p, bool finalize, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  BOOL_SWITCH(finalize, kFinalize, [&] {
    launch_kernel<soft_combine_kernel<kFinalize>>(dim3(grid_for(p.n)), dim3(kThreads), 0, stream,
                                                  p);
  });
  return cudaGetLastError();
}

cudaError_t launch_column_sum(const float* x, int64_t rows, int64_t cols, float* out,
                              cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  launch_kernel<column_sum_kernel>(dim3(grid_for(cols)), dim3(kThreads), 0, stream, x, rows, cols,
                                   out);
  return cudaGetLastError();
}

cudaError_t launch_kahan_accumulate(float* sum, float* comp, const float* x, int64_t count,
                                    const float* inv_scale, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  launch_kernel<kahan_accumulate_kernel>(dim3(grid_for(count)), dim3(kThreads), 0, stream, sum,
                                         comp, x, count, inv_scale);
  return cudaGetLastError();
}

cudaError_t launch_scale_store(void* out, DType dtype, const float* x, int64_t count,
                               const float* inv_scale, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      launch_kernel<scale_store_kernel<float>>(dim3(grid_for(count)), dim3(kThreads), 0, stream,
                                               static_cast<float*>(out), x, count, inv_scale);
      break;
    case DType::kBFloat16:
      launch_kernel<scale_store_kernel<__nv_bfloat16>>(dim3(grid_for(count)), dim3(kThreads), 0,
                                                       stream, static_cast<__nv_bfloat16*>(out), x,
                                                       count, inv_scale);
      break;
    case DType::kFloat16:
      launch_kernel<scale_store_kernel<__half>>(dim3(grid_for(count)), dim3(kThreads), 0, stream,
                                                static_cast<__half*>(out), x, count, inv_scale);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace flce
