// Backward kernels around the gradient tile (row_grad, flce_rows.cu):
//
// row_coef_kernel: one thread per row turns (m_x, s_x, z_t, u_x, grad_loss, grad_lse,
//   grad_entropy) into math.h's RowGrad (ref, A, U, dz_t, div, h, k, rdiv) and a bound on
//   max_j |dz_j| (below) used to pick the power-of-two scale of the fp16 gradient tile.
// target_fix_kernel: dE rows += the 16-bit tile's rounding residual of the target entry times
//   the target's weight row, in fp32: the dominant target column's gradient at fp32 accuracy.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "flce/math.h"
#include "params.h"

namespace flce {
namespace cuda {
namespace {

__global__ void row_coef_kernel(const RowCoefParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= p.n) return;
  const LossOptions opt{p.label_smoothing, p.z_loss, p.softcap, p.vocab_size};
  const bool ignored = p.target[row * p.target_stride] == p.ignore_index;
  const float* st = p.stats + row * p.stats_row_stride;  // (m_x, s_x, z_t, u_x)
  const OnlineLse x{st[0], st[p.stats_col_stride], st[3 * p.stats_col_stride]};
  const float z_t = st[2 * p.stats_col_stride];
  const float g = p.grad_loss[row * p.grad_loss_stride];
  const float g_lse = p.grad_lse != nullptr ? p.grad_lse[row * p.grad_lse_stride] : 0.f;
  const float g_ent =
      p.grad_entropy != nullptr ? p.grad_entropy[row * p.grad_entropy_stride] : 0.f;
  const RowGrad rg = row_grad(x, z_t, ignored, g, g_lse, opt, g_ent);
  *reinterpret_cast<float4*>(p.coef + row * 8) = make_float4(rg.ref, rg.a, rg.u, rg.dz_t);
  *reinterpret_cast<float4*>(p.coef + row * 8 + 4) = make_float4(rg.div, rg.h, rg.k, rg.rdiv);
  // For an ignored row dz_t is never used (it has no target column). A non-target column's
  // p_j a is at most p_max |a|, p_max = exp(m_x - lse) the row's largest non-target probability:
  // a confident row's tile is ~q, far below |a| ~ g, and a scale taken from |a| pushed it under
  // fp16's subnormals (a chunk of confident rows lost its whole gradient). The entropy's term
  // p_j |log p_j + H| is at most 1/e + H, H = log div - k. The stored dz is times the chain rule
  // softcap' / T, softcap' in [0, 1]: a temperature below 1 raises it (missing that 1/T, the
  // fp16 tile's scale overflowed to inf at T = 0.05).
  const float lse = logaddexp(lse_value(x), z_t);
  const float p_max = x.m == neg_inf() ? 0.f : fminf(expf(x.m - lse), 1.f);
  const float ent = logf(rg.div) - rg.k;
  const float ent_bound = rg.h != 0.f ? fabsf(rg.h) * (0.36788f + fabsf(ent)) : 0.f;
  p.bound[row] = (fabsf(rg.a) * p_max + fabsf(rg.u) + (ignored ? 0.f : fabsf(rg.dz_t)) +
                  ent_bound) / p.temperature;
}

// A target distribution's row (math.h soft_row_grad) from its state (m_x, s_x, p, u_x, y_a,
// y_rest, g): the coefficients (u = g, which the soft row_grad multiplies by each column's
// y_c), and the bound of |dz|: a non-pivot column's A p_c - u y_c is at most
// |A| p_max + |u| max_c |y_c| <= |A| p_max + |u| (|y_a| + |y_rest|)
// (target weights of one sign: probabilities, class weights >= 0; conservative otherwise only
// where they cancel), the pivot's |dz_t|, and the entropy's term as row_coef_kernel's.
__global__ void soft_coef_kernel(const RowCoefParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= p.n) return;
  const float* st = p.stats + row * p.stats_row_stride;
  const int64_t c = p.stats_col_stride;
  const OnlineLse x{st[0], st[c], st[3 * c]};
  const float piv = st[2 * c], y_a = st[4 * c], y_rest = st[5 * c];
  const float zw = p.z_weight != nullptr ? p.z_weight[row * p.z_weight_stride] : y_a + y_rest;
  const float g = p.grad_loss[row * p.grad_loss_stride];
  const float g_lse = p.grad_lse != nullptr ? p.grad_lse[row * p.grad_lse_stride] : 0.f;
  const float g_ent =
      p.grad_entropy != nullptr ? p.grad_entropy[row * p.grad_entropy_stride] : 0.f;
  const RowGrad rg = soft_row_grad(x, piv, y_a, y_rest, zw, g, g_lse, p.z_loss, g_ent);
  *reinterpret_cast<float4*>(p.coef + row * 8) = make_float4(rg.ref, rg.a, rg.u, rg.dz_t);
  *reinterpret_cast<float4*>(p.coef + row * 8 + 4) = make_float4(rg.div, rg.h, rg.k, rg.rdiv);
  const float lse = logaddexp(lse_value(x), piv);
  const float p_max = x.m == neg_inf() ? 0.f : fminf(expf(x.m - lse), 1.f);
  const float ent = logf(rg.div) - rg.k;
  const float ent_bound = rg.h != 0.f ? fabsf(rg.h) * (0.36788f + fabsf(ent)) : 0.f;
  const float dz_max = fabsf(rg.a) * p_max + fabsf(rg.u) * (fabsf(y_a) + fabsf(y_rest)) +
                       fabsf(rg.dz_t) + ent_bound;
  p.bound[row] = dz_max / p.temperature;
}

// One CTA per row; rows without their target in the block return at once.
template <typename T>
__global__ void target_fix_kernel(const TargetFixParams p) {
  const int64_t row = blockIdx.x;
  const int64_t tcol = target_column(p.target[row * p.target_stride], p.ignore_index,
                                     p.col_offset, p.v);
  if (tcol < 0) return;
  const float r = p.target_resid[row] * (p.inv_scale != nullptr ? *p.inv_scale : 1.f);
  if (r == 0.f) return;  // the 16-bit tile held dz_t exactly
  const T* w = static_cast<const T*>(p.weight) + tcol * p.weight_row_stride;
  float* s = p.sum + row * p.d;  // a complete fp32 row: one rounding
  for (int64_t j = threadIdx.x; j < p.d; j += blockDim.x) {
    s[j] += r * to_float<T>(w[j * p.weight_col_stride]);
  }
}

}  // namespace

cudaError_t launch_target_fix(const TargetFixParams& p, DType dtype, cudaStream_t stream) {
  if (p.n == 0 || p.d == 0) return cudaSuccess;
  if (p.n > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const unsigned grid = static_cast<unsigned>(p.n);
  switch (dtype) {
    case DType::kBFloat16:
      launch_kernel<target_fix_kernel<__nv_bfloat16>>(dim3(grid), dim3(256), 0, stream, p);
      break;
    case DType::kFloat16:
      launch_kernel<target_fix_kernel<__half>>(dim3(grid), dim3(256), 0, stream, p);
      break;
    default:
      return cudaErrorInvalidValue;  // fp32 tiles are exact: nothing to fix
  }
  return cudaGetLastError();
}

cudaError_t launch_row_coef(const RowCoefParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (p.n + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (p.soft) {
    launch_kernel<soft_coef_kernel>(dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
                                    p);
  } else {
    launch_kernel<row_coef_kernel>(dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
                                   p);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace flce
