// The SIMT kernels of the fused logits path (FLCE_CUDA_FUSED_LOGITS=1; docs/cuda.md "Fused
// logits"), with the arithmetic of flce/tile_epilogue.h:
//
// logits_epilogue_kernel  the stand-in for the fused GEMM's epilogue (csrc/cuda/sm90): fp32
//                         logits from cuBLAS -> E softcap'(z) [n, v] bf16 and a partial per
//                         (row, tile);
//                         where the fused GEMM does not run (sm_80, the host emulation,
//                         unaligned operands), and as its reference on the GPU;
// fused_merge_kernel      each row's tile partials merged in a fixed order -> [n, kPartialCols];
// fused_grad_kernel       E softcap'(z) -> dz in place, per (row, tile) one factor
//                         f = a exp(r - ref) rdiv and per element one multiply-add; the target
//                         entry from the fp32 z_t.
//
// One warp per (row, tile of kFusedTileCols = 256 columns): lane k owns the kLaneCols = 8
// adjacent columns [8k, 8k + 8) of the tile (one 16-byte access of bf16; the tests'
// share_of(c, 32)), consecutive warps take consecutive tiles of a row. Merges are butterflies
// (symmetric operations) and, across tiles, lane-strided then a butterfly: a fixed order,
// bitwise reproducible, no atomics.
#include <cuda_bf16.h>

#include <algorithm>

#include "common.cuh"
#include "flce/tile_epilogue.h"
#include "params.h"

namespace flce {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLaneCols = kFusedTileCols / 32;  // [8] adjacent columns of one lane

struct alignas(16) Bf16x8 {
  bf16 v[kLaneCols];
};

// The (row, tile) pairs of a launch, one per warp, consecutive tiles of a row on consecutive
// warps; f(row, tile) runs warp-uniformly (the shuffles inside need the whole warp). The grid
// stride is split into rows and tiles once: no 64-bit division per pair.
template <typename F>
__device__ __forceinline__ void for_row_tiles(int64_t n, int64_t tiles, F&& f) {
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t stride_rows = stride / tiles, stride_tiles = stride % tiles;
  int64_t row = warp / tiles, tile = warp % tiles;
  while (row < n) {
    f(row, tile);
    row += stride_rows;
    tile += stride_tiles;
    if (tile >= tiles) {
      tile -= tiles;
      ++row;
    }
  }
}

// Whether this lane's kLaneCols columns from c can move as one 16-byte access.
__device__ __forceinline__ bool lane_vector(const bf16* row, int64_t ld, int64_t c, int64_t v) {
  return c + kLaneCols <= v && ld % kLaneCols == 0 &&
         reinterpret_cast<uintptr_t>(row) % sizeof(Bf16x8) == 0;
}

__global__ void __launch_bounds__(kThreads) logits_epilogue_kernel(const FusedLogitsParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t tiles = (p.v + kFusedTileCols - 1) / kFusedTileCols;
  for_row_tiles(p.n, tiles, [&](int64_t row, int64_t tile) {
    const int64_t tcol =
        target_column(p.target[row * p.target_stride], p.ignore_index, p.col_offset, p.v);
    const int64_t c0 = tile * kFusedTileCols + lane * kLaneCols;
    const float* acc = p.logits + row * p.logits_ld;
    // [kLaneCols] this lane's logits; columns past v are outside the problem
    float z[kLaneCols];
    EpiRow st = epi_row_empty();
#pragma unroll
    for (int k = 0; k < kLaneCols; ++k) {
      const int64_t c = c0 + k;
      z[k] = c < p.v ? epi_logit(acc[c], p.bias != nullptr ? p.bias[c] : 0.f, p.softcap,
                                 p.temperature)
                     : 0.f;
      if (c < p.v) epi_see(st, z[k], c == tcol);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      const EpiRow o{__shfl_xor_sync(0xffffffffu, st.m, off),
                     __shfl_xor_sync(0xffffffffu, st.zt, off)};
      st = epi_merge(st, o);
    }
    const float r = epi_ref(st.m);
    float s = 0.f;
    Bf16x8 e;
#pragma unroll
    for (int k = 0; k < kLaneCols; ++k) {
      const float ek = c0 + k < p.v ? epi_exp(z[k], r, c0 + k == tcol) : 0.f;
      s += ek;
      e.v[k] = from_float<bf16>(epi_stored(ek, z[k], p.softcap, p.temperature));
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    bf16* out = static_cast<bf16*>(p.e) + row * p.e_ld;
    if (lane_vector(out, p.e_ld, c0, p.v)) {
      *reinterpret_cast<Bf16x8*>(out + c0) = e;
    } else {
      for (int k = 0; k < kLaneCols && c0 + k < p.v; ++k) out[c0 + k] = e.v[k];
    }
    if (lane == 0) epi_store_partial(p.partials + (row * tiles + tile) * kPartialCols, st.m, s, st.zt);
  });
}

// One warp per row: lane k merges tiles k, k + 32, ... in order, then a butterfly.
__global__ void __launch_bounds__(kThreads) fused_merge_kernel(const float* partials, int64_t n,
                                                               int64_t tiles, float* merged) {
  const int lane = threadIdx.x % 32;
  for_row_tiles(n, 1, [&](int64_t row, int64_t) {
    RowPartial acc{lse_empty(), neg_inf(), 0.f};
    for (int64_t t = lane; t < tiles; t += 32) {
      const float* q = partials + (row * tiles + t) * kPartialCols;
      acc = merge(acc, RowPartial{partial_lse(q), q[2], q[3]});
    }
    acc = warp_merge(acc);
    if (lane == 0) store_partial(merged + row * kPartialCols, acc.lse, acc.zt, acc.sum);
  });
}

// dz of one (row, tile) over its stored values, in place; with kColSums each column's fp32 dz
// (before the rounding to bf16; the target's whole dz_t) is added to colsum, the lane's 8
// columns.
template <bool kColSums>
__device__ __forceinline__ void grad_row_tile(const FusedGradParams& p, int64_t row,
                                              int64_t tile, int64_t tiles, float inv_t,
                                              float (&colsum)[kLaneCols]) {
  const int lane = threadIdx.x % 32;
  const int64_t tcol =
      target_column(p.target[row * p.target_stride], p.ignore_index, p.col_offset, p.v);
  if (p.target_resid != nullptr && tcol < 0 && tile == 0 && lane == 0) p.target_resid[row] = 0.f;
  const RowGrad rg = load_row_grad(p.coef, row);
  const float f = epi_grad_factor(rg, p.partials[(row * tiles + tile) * kPartialCols]);
  const int64_t c0 = tile * kFusedTileCols + lane * kLaneCols;
  bf16* e = static_cast<bf16*>(p.e) + row * p.e_ld;
  const bool vec = lane_vector(e, p.e_ld, c0, p.v);
  // [kLaneCols] this lane's stored values in, dz out (each element read before it is written,
  // by the same thread)
  Bf16x8 q;
  if (vec) {
    q = *reinterpret_cast<const Bf16x8*>(e + c0);
  } else {
#pragma unroll
    for (int k = 0; k < kLaneCols; ++k) q.v[k] = c0 + k < p.v ? e[c0 + k] : bf16{};
  }
  float g[kLaneCols];
#pragma unroll
  for (int k = 0; k < kLaneCols; ++k) g[k] = epi_logit_grad(f, to_float<bf16>(q.v[k]), rg.u, inv_t);
  const int64_t slot = tcol - c0;
  if (slot >= 0 && slot < kLaneCols) {  // the target's whole gradient, its owner only
    const float dz_t =
        epi_target_grad(rg.dz_t, p.stats[row * kStatsCols + 2], p.softcap, p.temperature);
#pragma unroll
    for (int k = 0; k < kLaneCols; ++k) {
      if (k == slot) g[k] = dz_t;
    }
    if (p.target_resid != nullptr) p.target_resid[row] = dz_t - to_float<bf16>(from_float<bf16>(dz_t));
  }
#pragma unroll
  for (int k = 0; k < kLaneCols; ++k) {
    q.v[k] = from_float<bf16>(g[k]);
    if constexpr (kColSums) colsum[k] += g[k];
  }
  if (vec) {
    *reinterpret_cast<Bf16x8*>(e + c0) = q;
  } else {
    for (int k = 0; k < kLaneCols && c0 + k < p.v; ++k) e[c0 + k] = q.v[k];
  }
}

// One warp per (row, tile); with col_partials one warp per (block of rows_per_block rows, tile),
// its rows in order, the lane's column sums stored once per block (the bias gradient's first
// level, as row_grad_kernel's: launch_column_sum and the compensated add finish it).
__global__ void __launch_bounds__(kThreads) fused_grad_kernel(const FusedGradParams p) {
  const int64_t tiles = (p.v + kFusedTileCols - 1) / kFusedTileCols;
  const float inv_t = 1.f / p.temperature;
  if (p.col_partials == nullptr) {
    for_row_tiles(p.n, tiles, [&](int64_t row, int64_t tile) {
      float unused[kLaneCols];
      grad_row_tile<false>(p, row, tile, tiles, inv_t, unused);
    });
    return;
  }
  const int64_t rows = p.rows_per_block, blocks = (p.n + rows - 1) / rows;
  for_row_tiles(blocks, tiles, [&](int64_t b, int64_t tile) {
    float colsum[kLaneCols] = {};
    for (int64_t row = b * rows; row < p.n && row < (b + 1) * rows; ++row) {
      grad_row_tile<true>(p, row, tile, tiles, inv_t, colsum);
    }
    const int64_t c0 = tile * kFusedTileCols + (threadIdx.x % 32) * kLaneCols;
    for (int k = 0; k < kLaneCols && c0 + k < p.v; ++k) p.col_partials[b * p.v + c0 + k] = colsum[k];
  });
}

// At most kMaxCtas CTAs (16384 warps), each warp then walking its pairs with the grid's stride:
// about two waves of an H200's resident CTAs at 8 per SM, and a grid whose stride the host
// emulation's tests exceed (run_fused: more than 16384 pairs).
constexpr int64_t kMaxCtas = 2048;

unsigned grid_for(int64_t pairs) {
  const int64_t ctas = (pairs + kWarps - 1) / kWarps;
  return static_cast<unsigned>(std::clamp<int64_t>(ctas, 1, kMaxCtas));
}

}  // namespace

// A build without CUTLASS's headers or without the arch in its list, and the host emulation
// (no WGMMA or TMA): that fused GEMM is never available, the stand-in runs.
#if !defined(FLCE_WITH_CUTLASS_SM90)
bool fused_logits_sm90_supported(const FusedLogitsParams&) { return false; }
cudaError_t launch_fused_logits_sm90(const FusedLogitsParams&, cudaStream_t) {
  return cudaErrorNotSupported;
}
#endif

cudaError_t launch_logits_epilogue(const FusedLogitsParams& p, cudaStream_t stream) {
  if (p.n == 0 || p.v == 0) return cudaSuccess;
  if (p.logits == nullptr || !(p.temperature > 0.f)) return cudaErrorInvalidValue;
  const int64_t tiles = (p.v + kFusedTileCols - 1) / kFusedTileCols;
  launch_kernel<logits_epilogue_kernel>(dim3(grid_for(p.n * tiles)), dim3(kThreads), 0, stream,
                                        p);
  return cudaGetLastError();
}

cudaError_t launch_fused_merge(const float* partials, int64_t n, int64_t tiles, float* merged,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  launch_kernel<fused_merge_kernel>(dim3(grid_for(n)), dim3(kThreads), 0, stream, partials, n,
                                    tiles, merged);
  return cudaGetLastError();
}

cudaError_t launch_fused_grad(const FusedGradParams& p, cudaStream_t stream) {
  if (p.n == 0 || p.v == 0) return cudaSuccess;
  if (!(p.temperature > 0.f) || (p.col_partials != nullptr && p.rows_per_block < 1)) {
    return cudaErrorInvalidValue;
  }
  const int64_t tiles = (p.v + kFusedTileCols - 1) / kFusedTileCols;
  const int64_t units = p.col_partials != nullptr ? (p.n + p.rows_per_block - 1) / p.rows_per_block
                                                  : p.n;
  launch_kernel<fused_grad_kernel>(dim3(grid_for(units * tiles)), dim3(kThreads), 0, stream, p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace flce
