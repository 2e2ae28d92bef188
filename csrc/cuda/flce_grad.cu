// Backward kernels.
//
// row_coef_kernel: one thread per row turns (m_x, s_x, z_t, grad_loss, grad_lse) into math.h's
//   RowGrad (ref, A, U, dz_t, div) and a bound on max_j |dz_j| ((|A| + |U| + |dz_t|) / T, since
//   p_j <= 1 and the softcap derivative is in [0, 1]) used to pick the power-of-two scale of the 16-bit
//   gradient tile.
// grad_logits_kernel: 1-D grid over (row block, vocab tile) pairs, grouped (grouped_tile,
//   kGroupRows row blocks at a time, so the resident CTAs share rows and weight tiles in L2),
//   one logit tile per CTA,
//   recomputed on tensor cores (or SIMT fp32); the epilogue forms the fp32 gradient tile with the
//   collapse-safe target term and the softcap chain rule, stores scale * dz in the compute dtype
//   and writes the CTA's fp32 column sums (bias gradient) to its own row of col_partials. No
//   atomics anywhere: the binding reduces col_partials in row-block order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "flce/math.h"
#include "params.h"
#include "ptx.cuh"
#include "tiles.cuh"

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
  // p_j |log p_j + H| is at most 1/e + H, H = lse - k. The stored dz is times the chain rule
  // softcap' / T, softcap' in [0, 1]: a temperature below 1 raises it (missing that 1/T, the
  // fp16 tile's scale overflowed to inf at T = 0.05).
  const float lse = logaddexp(lse_value(x), z_t);
  const float p_max = x.m == neg_inf() ? 0.f : fminf(expf(x.m - lse), 1.f);
  const float ent_bound = rg.h != 0.f ? fabsf(rg.h) * (0.36788f + fabsf(lse - rg.k)) : 0.f;
  p.bound[row] = (fabsf(rg.a) * p_max + fabsf(rg.u) + (ignored ? 0.f : fabsf(rg.dz_t)) +
                  ent_bound) / p.temperature;
}

// Row blocks per rasterization group: 16 x ~16 resident column tiles touch 16 input row blocks
// and ~16 weight tiles (~33 MiB at D = 4096); each weight chunk is read from DRAM once per group.
constexpr int64_t kGroupRows = 16;

struct RowCoef {
  RowGrad rg;
  int64_t tcol;
};

template <typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 2) grad_logits_kernel(const GradParams p) {
  using T = typename TileElem<Tile>::type;
  constexpr int kWarps = Tile::kThreads / 32;
  constexpr int kPerLane = Tile::kBlockV / 32;
  FLCE_DYNAMIC_SHARED(smem);
  float* epi = reinterpret_cast<float*>(smem + Tile::kEpiOffset);       // [kBlockN, kEpiLd]
  RowCoef* rows = reinterpret_cast<RowCoef*>(smem + Tile::kSmemBytes);  // [kBlockN]
  const LinearArgs& a = p.lin;
  const int64_t row_blocks = (a.n + Tile::kBlockN - 1) / Tile::kBlockN;
  const int64_t col_blocks = (a.v + Tile::kBlockV - 1) / Tile::kBlockV;
  const TileCoord tc = grouped_tile(blockIdx.x, row_blocks, col_blocks, kGroupRows);
  const int64_t m0 = tc.row_block * Tile::kBlockN;
  const int64_t n0 = tc.col * Tile::kBlockV;

  for (int r = threadIdx.x; r < Tile::kBlockN; r += Tile::kThreads) {
    const int64_t row = m0 + r;
    RowCoef rc{RowGrad{0.f, 0.f, 0.f, 0.f}, -1};
    if (row < a.n) {
      rc.rg = load_row_grad(p.coef, row);
      rc.tcol = target_column(a.target[row * a.target_stride], a.ignore_index, a.col_offset, a.v);
    }
    rows[r] = rc;
  }
  // rows[] is first read after compute()'s barriers.
  Tile::compute(a, m0, n0, smem, epi);

  const float scale = p.scale != nullptr ? *p.scale : 1.f;
  T* out = static_cast<T*>(p.grad_logits);     // [n, v], row stride v
  T* lo = static_cast<T*>(p.grad_logits_lo);   // [n, v] or nullptr
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < Tile::kBlockN; r += kWarps) {
    const int64_t row = m0 + r;
    const RowCoef rc = rows[r];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      const int64_t col = n0 + c;
      float dz = 0.f;  // rows/columns outside the matrix add nothing to the column sums
      if (row < a.n && col < a.v) {
        const float z = logit_of(epi[r * Tile::kEpiLd + c], a.bias, col, a.softcap, a.temperature);
        dz = (col == rc.tcol ? rc.rg.dz_t : logit_grad(rc.rg, z)) *
             logit_transform_grad(z, a.softcap, a.temperature);
        const float sd = dz * scale;
        const T hi = from_float<T>(sd);
        out[row * a.v + col] = hi;
        if (lo != nullptr) lo[row * a.v + col] = from_float<T>(sd - to_float<T>(hi));
        // The one thread (of the whole grid) holding this row's target entry.
        if (col == rc.tcol && p.target_resid != nullptr) p.target_resid[row] = sd - to_float<T>(hi);
      }
      epi[r * Tile::kEpiLd + c] = dz;
    }
  }
  if (p.col_partials == nullptr) return;
  __syncthreads();
  // Column sums of the fp32 tile, rows in order, compensated.
  for (int c = threadIdx.x; c < Tile::kBlockV; c += Tile::kThreads) {
    const int64_t col = n0 + c;
    if (col >= a.v) break;
    float s = 0.f, comp = 0.f;
    for (int r = 0; r < Tile::kBlockN; ++r) kahan_add(s, comp, epi[r * Tile::kEpiLd + c]);
    p.col_partials[tc.row_block * a.v + col] = kahan_result(s, comp);
  }
}

template <typename Tile>
cudaError_t launch(const GradParams& p, cudaStream_t stream) {
  constexpr int kSmem = Tile::kSmemBytes + Tile::kBlockN * static_cast<int>(sizeof(RowCoef));
  static_assert(Tile::kSmemBytes % alignof(RowCoef) == 0, "row coefficient alignment");
  const cudaError_t attr = cudaFuncSetAttribute(
      grad_logits_kernel<Tile>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return attr;
  const int64_t row_blocks = (p.lin.n + Tile::kBlockN - 1) / Tile::kBlockN;
  const int64_t col_blocks = (p.lin.v + Tile::kBlockV - 1) / Tile::kBlockV;
  if (row_blocks == 0 || col_blocks == 0) return cudaSuccess;
  const int64_t ctas = row_blocks * col_blocks;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  launch_kernel<grad_logits_kernel<Tile>>(dim3(static_cast<unsigned>(ctas)), dim3(Tile::kThreads),
                                          kSmem, stream, p);
  return cudaGetLastError();
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
  float* s = p.sum + row * p.d;
  if (p.comp == nullptr) {  // a complete fp32 row (the single pass): one rounding
    for (int64_t j = threadIdx.x; j < p.d; j += blockDim.x) {
      s[j] += r * to_float<T>(w[j * p.weight_col_stride]);
    }
    return;
  }
  float* c = p.comp + row * p.d;
  for (int64_t j = threadIdx.x; j < p.d; j += blockDim.x) {
    kahan_add(s[j], c[j], r * to_float<T>(w[j * p.weight_col_stride]));
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
  launch_kernel<row_coef_kernel>(dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, p);
  return cudaGetLastError();
}

cudaError_t launch_grad_logits(const GradParams& p, DType dtype, cudaStream_t stream) {
  return with_tile(dtype, [&](auto tile) { return launch<decltype(tile)>(p, stream); });
}

}  // namespace cuda
}  // namespace flce
