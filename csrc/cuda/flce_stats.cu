// Forward kernel: logit tiles folded straight into per-row online statistics.
//
// 1-D grid over (row block bx, split s), grouped (grouped_tile, kGroupRows row blocks at a time:
// the resident CTAs share their input rows and weight tiles in L2). CTA (bx, s) owns rows
// [bx*kBlockN, +kBlockN) and vocab tiles
// [s*tiles_per_split, (s+1)*tiles_per_split); it walks its tiles in order, keeps the per-row
// state (m, s, z_t, sum_z with its Neumaier compensation) in shared memory and writes it once to
// partials[s] [n, 4]. Splits are merged by launch_combine in split order: no atomics, so the
// result is bitwise reproducible for a given shape, dtype and GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "flce/math.h"
#include "params.h"
#include "tiles.cuh"

namespace flce {
namespace cuda {
namespace {

// Row blocks per rasterization group: with ~33 splits, 8 x 33 CTAs (about the resident count on
// 132 SMs at 2 CTAs/SM) touch 8 input row blocks and 33 weight tiles: ~41 MiB at D = 4096.
constexpr int64_t kGroupRows = 8;

// Per-row running state of one CTA (shared memory).
struct RowState {
  float m, s, u;     // OnlineLse over non-target columns (u: the entropy's sum)
  float zt;          // target logit, -inf until seen
  float sum, comp;   // sum_z and its compensation
  int64_t tcol;      // target column relative to the weight block, or -1
};

template <typename Tile>
__device__ void fold_tile(const float* epi, RowState* rows, int64_t m0, int64_t n0,
                          const LinearArgs& a) {
  constexpr int kWarps = Tile::kThreads / 32;
  constexpr int kPerLane = Tile::kBlockV / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Row r is always folded by warp r % kWarps, so lane 0 of that warp is the only writer of its
  // (m, s, sum, comp) and no two tiles race.
  for (int r = warp; r < Tile::kBlockN; r += kWarps) {
    if (m0 + r >= a.n) break;  // warp-uniform; later rows are out of range too
    const int64_t tcol = rows[r].tcol;
    float z[kPerLane];
    float mx = neg_inf(), sum_z = 0.f;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      const int64_t col = n0 + c;
      z[i] = 0.f;
      if (col < a.v) {
        z[i] = logit_of(epi[r * Tile::kEpiLd + c], a.bias, col, a.softcap, a.temperature);
        sum_z += z[i];
        nan |= isnan(z[i]);
        if (col == tcol) {
          rows[r].zt = z[i];  // the single lane (in the whole grid) that owns the target
        } else {
          mx = z[i] > mx ? z[i] : mx;
        }
      }
    }
    mx = warp_max(mx);
    float se = 0.f, ue = 0.f;
    // Same tile semantics as the CPU backend: a tile without a finite max (no non-target column,
    // or all -inf, e.g. -inf bias on padded vocabulary entries) adds the empty sum, and a NaN
    // anywhere in the tile (target included) poisons s, since the max comparisons skip NaN.
    if (mx != neg_inf()) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int64_t col = n0 + lane + 32 * i;
        if (col < a.v && col != tcol && z[i] != neg_inf()) {
          const float e = expf(z[i] - mx);
          se += e;
          ue += e * (mx - z[i]);
        }
      }
    }
    se = warp_sum(se);
    ue = warp_sum(ue);
    sum_z = warp_sum(sum_z);
    nan = __any_sync(0xffffffffu, nan);
    if (lane == 0) {
      OnlineLse st{rows[r].m, rows[r].s, rows[r].u};
      lse_add_tile(st, mx, nan ? NAN : se, nan ? NAN : ue);
      rows[r].m = st.m;
      rows[r].s = st.s;
      rows[r].u = st.u;
      kahan_add(rows[r].sum, rows[r].comp, sum_z);
    }
  }
}

template <typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 2) partial_stats_kernel(const StatsParams p) {
  FLCE_DYNAMIC_SHARED(smem);
  float* epi = reinterpret_cast<float*>(smem + Tile::kEpiOffset);  // [kBlockN, kEpiLd]
  RowState* rows = reinterpret_cast<RowState*>(smem + Tile::kSmemBytes);  // [kBlockN]
  const LinearArgs& a = p.lin;
  const int64_t row_blocks = (a.n + Tile::kBlockN - 1) / Tile::kBlockN;
  const TileCoord tc = grouped_tile(blockIdx.x, row_blocks, p.splits, kGroupRows);
  const int64_t m0 = tc.row_block * Tile::kBlockN;
  const int64_t split = tc.col;
  const int64_t num_tiles = (a.v + Tile::kBlockV - 1) / Tile::kBlockV;
  const int64_t t_begin = split * p.tiles_per_split;
  const int64_t t_end = t_begin + p.tiles_per_split < num_tiles ? t_begin + p.tiles_per_split
                                                                 : num_tiles;
  for (int r = threadIdx.x; r < Tile::kBlockN; r += Tile::kThreads) {
    const int64_t row = m0 + r;
    rows[r] = RowState{neg_inf(), 0.f, 0.f, neg_inf(), 0.f, 0.f, -1};
    if (row < a.n) {
      rows[r].tcol = target_column(a.target[row * a.target_stride], a.ignore_index, a.col_offset,
                                   a.v);
    }
  }
  __syncthreads();
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t n0 = t * Tile::kBlockV;
    Tile::compute(a, m0, n0, smem, epi);
    fold_tile<Tile>(epi, rows, m0, n0, a);
    __syncthreads();  // epi (and the pipeline it aliases) is free again
  }
  float* out = p.partials + split * a.n * kPartialCols;
  for (int r = threadIdx.x; r < Tile::kBlockN; r += Tile::kThreads) {
    const int64_t row = m0 + r;
    if (row >= a.n) break;
    const RowState st = rows[r];
    store_partial(out + row * kPartialCols, OnlineLse{st.m, st.s, st.u}, st.zt,
                  kahan_result(st.sum, st.comp));
  }
}

template <typename Tile>
cudaError_t launch(const StatsParams& p, cudaStream_t stream) {
  constexpr int kSmem = Tile::kSmemBytes + Tile::kBlockN * static_cast<int>(sizeof(RowState));
  static_assert(Tile::kSmemBytes % alignof(RowState) == 0, "row state alignment");
  // More than 48 KiB of dynamic shared memory must be opted into, per device: set it on every
  // launch (a cheap host call) rather than once per process.
  const cudaError_t attr = cudaFuncSetAttribute(
      partial_stats_kernel<Tile>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) return attr;
  const int64_t row_blocks = (p.lin.n + Tile::kBlockN - 1) / Tile::kBlockN;
  if (row_blocks == 0 || p.splits == 0) return cudaSuccess;
  const int64_t ctas = row_blocks * p.splits;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  launch_kernel<partial_stats_kernel<Tile>>(dim3(static_cast<unsigned>(ctas)), dim3(Tile::kThreads),
                                            kSmem, stream, p);
  return cudaGetLastError();
}

}  // namespace

TileShape tile_shape(DType dtype) {
  if (dtype == DType::kFloat32) return TileShape{SimtTile::kBlockN, SimtTile::kBlockV};
  return TileShape{MmaTile<__nv_bfloat16>::kBlockN, MmaTile<__nv_bfloat16>::kBlockV};
}

cudaError_t launch_partial_stats(const StatsParams& p, DType dtype, cudaStream_t stream) {
  return with_tile(dtype, [&](auto tile) { return launch<decltype(tile)>(p, stream); });
}

}  // namespace cuda
}  // namespace flce
