// Row kernels of the single pass (flce::sum_and_grad on CUDA, 3 GEMMs): the logits of a chunk of
// rows come from cuBLAS in fp32 ([n, v], never rounded to 16 bits), and these kernels turn them
// into the collapse-safe statistics and the gradient tile, with the math of flce/math.h. The
// same kernels serve cross-entropy on a caller's logits (flce::logits_stats / logits_backward),
// which may be bf16 or fp16: TIn is the logits' type, widened to fp32 as they are loaded.
//
// row_stats_kernel  one CTA per (row, column split): (m, s) online logsumexp over the non-target
//                   columns, z_t, sum_z, u (partial_stats' [splits, n, 5] format, merged by
//                   launch_combine);
// row_grad_kernel   one CTA per (rows_per_cta rows, column split): dz_j = (j == t ? dz_t :
//                   A p_j - U) * softcap'(z_j) from launch_row_coef's coefficients, stored in the
//                   compute dtype (over the logits where it aliases them), tile by tile;
// scale_grad_kernel the deferred gradients -> the gradient, scaled in double, rounded once.
//
// A row is walked in tiles of kTile = 4096 columns: thread k owns the kVecs groups of kVec = 4
// adjacent columns c0 + i * kThreads * kVec + k * kVec (16-byte loads and stores where the rows
// are aligned, so each warp instruction moves one contiguous 512-byte span). Partial results are
// combined in a fixed tree (per thread in column order, warp butterflies, then the warps in
// order): bitwise reproducible, no atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "flce/math.h"
#include "params.h"
#include "ptx.cuh"
#include "static_switch.h"

namespace flce {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = kVec4;                         // adjacent columns of one 16-byte access
constexpr int kVecs = 4;                            // accesses per thread per tile (in flight)
constexpr int kPerThread = kVec * kVecs;            // columns per thread per tile
constexpr int kTile = kThreads * kPerThread;        // [kTile] columns of a row per step
static_assert(kTile == kRowTileCols, "params.h's tile width");

// The columns [begin, end) of split blockIdx.y of `splits` over a row of v columns: a contiguous
// range of whole tiles (empty for a split past the last tile).
struct ColRange {
  int64_t begin, end;
};
__device__ __forceinline__ ColRange split_cols(int64_t v, int splits) {
  const int64_t tiles = (v + kTile - 1) / kTile;
  const int64_t per = (tiles + splits - 1) / splits;
  const int64_t b = static_cast<int64_t>(blockIdx.y) * per * kTile;
  const int64_t e = b + per * kTile;
  return ColRange{b < v ? b : v, e < v ? e : v};
}

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

// Column of this thread's element e (0 <= e < kPerThread) of the tile starting at c0.
__device__ __forceinline__ int64_t tile_col(int64_t c0, int e) {
  return c0 + static_cast<int64_t>(e / kVec) * (kThreads * kVec) + threadIdx.x * kVec + e % kVec;
}

// True when rows of stride ld starting at ptr allow Pack<T> accesses at every column that is a
// multiple of kVec.
template <typename T>
__device__ __forceinline__ bool vec_aligned(const void* ptr, int64_t ld) {
  return ld % kVec == 0 && pack_aligned<T>(ptr);
}

// This thread's kPerThread columns of tile [c0, c0 + kTile) of a row (0 past v), in fp32; nothing
// past v is read. One Pack<TIn> access per kVec columns (16 bytes for fp32, 8 for 16-bit logits).
template <typename TIn>
__device__ __forceinline__ void load_tile(const TIn* z, int64_t c0, int64_t v, bool aligned,
                                          float (&x)[kPerThread]) {
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t j = tile_col(c0, i * kVec);
    if (aligned && j + kVec <= v) {
      const Pack<TIn> q = *reinterpret_cast<const Pack<TIn>*>(z + j);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[i * kVec + k] = to_float<TIn>(q.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[i * kVec + k] = j + k < v ? to_float<TIn>(z[j + k]) : 0.f;
    }
  }
}

// kSum: the row's sum of logits (label smoothing only); kU: the entropy's running sum u (only
// where the entropy is returned). Without them 0 is stored in their place.
template <typename TIn, bool kSum, bool kU>
__global__ void __launch_bounds__(kThreads, 2) row_stats_kernel(const RowStatsParams p) {
  FLCE_DYNAMIC_SHARED(smem);
  RowPartial* warp_part = reinterpret_cast<RowPartial*>(smem);  // [kWarps]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const TIn* logits = static_cast<const TIn*>(p.logits);
  const bool aligned = vec_aligned<TIn>(logits, p.ld);
  const ColRange cols = split_cols(p.v, p.splits);
  for (int64_t row = blockIdx.x; row < p.n; row += gridDim.x) {
    const TIn* z = logits + row * p.ld;
    const int64_t tcol =
        target_column(p.target[row * p.target_stride], p.ignore_index, p.col_offset, p.v);
    OnlineLse st = lse_empty();
    float zt = neg_inf(), sum = 0.f, comp = 0.f;
    for (int64_t c0 = cols.begin; c0 < cols.end; c0 += kTile) {
      float x[kPerThread];
      load_tile(z, c0, p.v, aligned, x);
      // Two passes over the thread's columns of the tile: their max (the target and columns past
      // v excluded as -inf; fmaxf skips NaN), then sum exp(z - max) and the entropy's
      // exp(z - max) (max - z), merged into the row state once (lse_add_tile). A NaN logit makes
      // the sum NaN; -inf logits add nothing.
      float mx = neg_inf();
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        const int64_t j = tile_col(c0, e);
        float zj = neg_inf();
        if (j < p.v) {
          zj = logit_of(x[e], p.bias, j, p.softcap, p.temperature);
          if constexpr (kSum) kahan_add(sum, comp, zj);
          if (j == tcol) {
            zt = zj;
            zj = neg_inf();
          }
        }
        x[e] = zj;
        mx = fmaxf(mx, zj);
      }
      float ts = 0.f, tu = 0.f;
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        if (x[e] != neg_inf()) {
          const float ex = expf(x[e] - mx);
          ts += ex;
          if constexpr (kU) tu += ex * (mx - x[e]);
        }
      }
      lse_add_tile(st, mx, ts, tu);
    }
    RowPartial part = warp_merge(RowPartial{st, zt, kahan_result(sum, comp)});
    if (lane == 0) warp_part[warp] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
      RowPartial all{lse_empty(), neg_inf(), 0.f};
      float s = 0.f, c = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        all = merge(all, warp_part[w]);
        kahan_add(s, c, warp_part[w].sum);
      }
      store_partial(p.partials + (blockIdx.y * p.n + row) * kPartialCols, all.lse, all.zt,
                    kahan_result(s, c));
    }
    __syncthreads();  // warp_part is reused by the next row
  }
}

template <typename TIn, typename T>
__global__ void __launch_bounds__(kThreads, 1) row_grad_kernel(const RowGradParams p) {
  const int64_t rows = p.rows_per_cta;
  const int64_t blocks = (p.n + rows - 1) / rows;
  const TIn* logits = static_cast<const TIn*>(p.logits);
  const bool in_aligned = vec_aligned<TIn>(logits, p.ld);
  const bool out_aligned = vec_aligned<T>(p.grad, p.grad_ld);
  const ColRange cols = split_cols(p.v, p.col_splits);
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = b * rows + r;
      if (row >= p.n) break;  // CTA-uniform
      const TIn* z = logits + row * p.ld;
      T* out = static_cast<T*>(p.grad) + row * p.grad_ld;
      T* lo = p.grad_lo != nullptr ? static_cast<T*>(p.grad_lo) + row * p.grad_lo_ld : nullptr;
      float* colsum = p.col_partials != nullptr ? p.col_partials + b * p.v : nullptr;
      const RowGrad rg = load_row_grad(p.coef, row);
      const int64_t tcol =
          target_column(p.target[row * p.target_stride], p.ignore_index, p.col_offset, p.v);
      if (p.target_resid != nullptr && tcol < 0 && threadIdx.x == 0 && blockIdx.y == 0) {
        p.target_resid[row] = 0.f;
      }
      for (int64_t c0 = cols.begin; c0 < cols.end; c0 += kTile) {
        float x[kPerThread];
        load_tile(z, c0, p.v, in_aligned, x);
        // In place, the 16-bit gradient of tile [c0, c0 + kTile) of fp32 logits lands on the
        // bytes of logits [c0 / 2, (c0 + kTile) / 2): all of them read already by every thread
        // after this barrier (earlier tiles, and this one), none of a later tile. (Same-width
        // logits are rewritten by the thread that read them: no barrier needed.)
        if constexpr (sizeof(T) < sizeof(TIn)) __syncthreads();
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
          Pack<T> hi;
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const int e = i * kVec + k;
            const int64_t j = tile_col(c0, e);
            if (j >= p.v) break;
            const float zj = logit_of(x[e], p.bias, j, p.softcap, p.temperature);
            const float dz =
                (j == tcol ? rg.dz_t : logit_grad(rg, zj)) *
                logit_transform_grad(zj, p.softcap, p.temperature);
            hi.v[k] = from_float<T>(dz);
            if constexpr (sizeof(T) == 2) {  // an fp32 tile is exact: nothing to keep
              const float resid = dz - to_float<T>(hi.v[k]);
              if (lo != nullptr) lo[j] = from_float<T>(resid);
              if (j == tcol && p.target_resid != nullptr) p.target_resid[row] = resid;
            }
            if (colsum != nullptr) colsum[j] = r == 0 ? dz : colsum[j] + dz;
          }
          const int64_t j = tile_col(c0, i * kVec);
          if (out_aligned && j + kVec <= p.v) {
            *reinterpret_cast<Pack<T>*>(out + j) = hi;
          } else {
            for (int k = 0; k < kVec && j + k < p.v; ++k) out[j + k] = hi.v[k];
          }
        }
      }
    }
  }
}

// Packs of kVec elements where every slice allows them (count a multiple of kVec, aligned
// pointers), then one element per thread for the rest.
template <typename T, typename X>
__global__ void scale_grad_kernel(T* __restrict__ out, const X* __restrict__ x, int slices,
                                  int64_t count, const double* __restrict__ scale) {
  const double k = *scale;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t packs =
      count % kVec == 0 && pack_aligned<T>(out) && pack_aligned<X>(x) ? count / kVec : 0;
  for (int64_t i = start; i < packs; i += stride) {
    double v[kVec] = {};
    for (int s = 0; s < slices; ++s) {
      const Pack<X> q = reinterpret_cast<const Pack<X>*>(x + s * count)[i];
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[e] += static_cast<double>(to_float<X>(q.v[e]));
    }
    Pack<T> o;
#pragma unroll
    for (int e = 0; e < kVec; ++e) o.v[e] = from_float<T>(static_cast<float>(v[e] * k));
    reinterpret_cast<Pack<T>*>(out)[i] = o;
  }
  for (int64_t i = packs * kVec + start; i < count; i += stride) {
    double v = 0.0;
    for (int s = 0; s < slices; ++s) v += static_cast<double>(to_float<X>(x[s * count + i]));
    out[i] = from_float<T>(static_cast<float>(v * k));
  }
}

template <typename T>
__global__ void target_rows_kernel(const TargetRowsParams p) {
  for (int64_t k = blockIdx.x; k < p.n; k += gridDim.x) {
    const int64_t t = p.sorted_target[k];
    if (k > 0 && p.sorted_target[k - 1] == t) continue;  // not the first row of its run
    const int64_t c = target_column(t, p.ignore_index, p.col_offset, p.rows);
    if (c < 0) continue;
    const float inv = p.inv_scale != nullptr ? *p.inv_scale : 1.f;
    const T* x = static_cast<const T*>(p.x);
    for (int64_t j = threadIdx.x; j < p.d; j += blockDim.x) {
      float acc = 0.f;
      for (int64_t m = k; m < p.n && p.sorted_target[m] == t; ++m) {
        const int64_t row = p.order[m];
        acc += (p.resid[row] * inv) * to_float<T>(x[row * p.x_stride + j]);
      }
      if (p.out != nullptr) {
        p.out[c * p.d + j] += acc;
      } else {
        static_cast<T*>(p.store)[c * p.d + j] = from_float<T>(p.base[k * p.d + j] + acc);
      }
    }
  }
}

unsigned grid_rows(int64_t blocks) {
  return static_cast<unsigned>(blocks < 0x7fffffff ? blocks : 0x7fffffff);
}

template <typename T>
cudaError_t scale_grad_to(T* out, const void* x, DType x_dtype, int slices, int64_t count,
                          const double* scale, cudaStream_t stream) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
  switch (x_dtype) {
    case DType::kFloat32:
    case DType::kFloat32Tf32:
      launch_kernel<scale_grad_kernel<T, float>>(dim3(grid), dim3(kThreads), 0, stream, out,
                                              static_cast<const float*>(x), slices, count,
                                              scale);
      break;
    case DType::kBFloat16:
      launch_kernel<scale_grad_kernel<T, __nv_bfloat16>>(dim3(grid), dim3(kThreads), 0, stream, out,
                                              static_cast<const __nv_bfloat16*>(x), slices, count,
                                              scale);
      break;
    case DType::kFloat16:
      launch_kernel<scale_grad_kernel<T, __half>>(dim3(grid), dim3(kThreads), 0, stream, out,
                                              static_cast<const __half*>(x), slices, count,
                                              scale);
      break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_row_stats(const RowStatsParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.splits < 1 || p.splits > 65535) return cudaErrorInvalidValue;
  auto launch = [&](auto tin) {
    using TIn = decltype(tin);
    BOOL_SWITCH(p.need_sum, kSum, [&] {
      BOOL_SWITCH(p.need_u, kU, [&] {
        launch_kernel<row_stats_kernel<TIn, kSum, kU>>(dim3(grid_rows(p.n), p.splits),
                                                       dim3(kThreads), kWarps * sizeof(RowPartial),
                                                       stream, p);
      });
    });
  };
  switch (p.logits_dtype) {
    case DType::kFloat32:
    case DType::kFloat32Tf32:
      launch(float{});
      break;
    case DType::kBFloat16:
      launch(__nv_bfloat16{});
      break;
    case DType::kFloat16:
      launch(__half{});
      break;
  }
  return cudaGetLastError();
}

namespace {
int elt_bytes(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16 ? 2 : 4; }
}  // namespace

cudaError_t launch_row_grad(const RowGradParams& p, DType dtype, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.rows_per_cta < 1 || (p.col_partials == nullptr && p.rows_per_cta != 1)) {
    return cudaErrorInvalidValue;
  }
  const bool narrower = elt_bytes(dtype) < elt_bytes(p.logits_dtype);
  if (p.col_splits < 1 || p.col_splits > 65535 ||
      (p.col_splits > 1 && narrower && p.grad == p.logits)) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(grid_rows((p.n + p.rows_per_cta - 1) / p.rows_per_cta), p.col_splits);
  const bool f32_in = p.logits_dtype == DType::kFloat32 || p.logits_dtype == DType::kFloat32Tf32;
  if (!f32_in && dtype != p.logits_dtype) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat32Tf32:
      launch_kernel<row_grad_kernel<float, float>>(grid, dim3(kThreads), 0, stream, p);
      break;
    case DType::kBFloat16:
      if (f32_in) {
        launch_kernel<row_grad_kernel<float, __nv_bfloat16>>(grid, dim3(kThreads), 0, stream, p);
      } else {
        launch_kernel<row_grad_kernel<__nv_bfloat16, __nv_bfloat16>>(grid, dim3(kThreads), 0,
                                                                      stream, p);
      }
      break;
    case DType::kFloat16:
      if (f32_in) {
        launch_kernel<row_grad_kernel<float, __half>>(grid, dim3(kThreads), 0, stream, p);
      } else {
        launch_kernel<row_grad_kernel<__half, __half>>(grid, dim3(kThreads), 0, stream, p);
      }
      break;
  }
  return cudaGetLastError();
}

cudaError_t launch_target_rows(const TargetRowsParams& p, DType dtype, cudaStream_t stream) {
  if (p.n == 0 || p.d == 0 || p.rows == 0) return cudaSuccess;
  if (p.out == nullptr && (p.store == nullptr || p.base == nullptr)) return cudaErrorInvalidValue;
  // A grid-stride loop over the sorted rows: most runs of equal targets fall outside a dW piece
  // of `rows` vocabulary rows, and a CTA per row would spend the launch starting CTAs that only
  // look at one target (19 us per 2048-row piece at N = 4096 on an H200, 1.2 ms per step).
  const unsigned grid = grid_rows(std::min<int64_t>(p.n, 1024));
  switch (dtype) {
    case DType::kBFloat16:
      launch_kernel<target_rows_kernel<__nv_bfloat16>>(dim3(grid), dim3(kThreads), 0, stream, p);
      break;
    case DType::kFloat16:
      launch_kernel<target_rows_kernel<__half>>(dim3(grid), dim3(kThreads), 0, stream, p);
      break;
    default:
      return cudaErrorInvalidValue;  // fp32 tiles are exact: nothing to fix
  }
  return cudaGetLastError();
}

cudaError_t launch_scale_grad(void* out, DType dtype, const void* x, DType x_dtype, int slices,
                              int64_t count, const double* scale, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat32Tf32:
      return scale_grad_to(static_cast<float*>(out), x, x_dtype, slices, count, scale, stream);
    case DType::kBFloat16:
      return scale_grad_to(static_cast<__nv_bfloat16*>(out), x, x_dtype, slices, count, scale,
                           stream);
    case DType::kFloat16:
      return scale_grad_to(static_cast<__half*>(out), x, x_dtype, slices, count, scale, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace flce
