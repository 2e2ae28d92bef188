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
// scale_grad_kernel the deferred gradients -> the gradient, scaled in double, rounded once;
// row_argmax_kernel return_predicted_tokens' column of each row's largest non-target logit (its
//                   own pass, launched only when asked).
//
// A row is walked in tiles of kTile = 4096 columns: thread k owns the kVecs groups of kVec = 4
// adjacent columns c0 + i * kThreads * kVec + k * kVec (16-byte loads and stores where the rows
// are aligned, so each warp instruction moves one contiguous 512-byte span). Partial results are
// combined in a fixed tree (per thread in column order, warp butterflies, then the warps in
// order): bitwise reproducible, no atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common.cuh"
#include "flce/math.h"
#include "heuristics.h"
#include "params.h"
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
// range of whole tiles, dealt out evenly (two splits differ by at most one tile).
struct ColRange {
  int64_t begin, end;
};
__device__ __forceinline__ ColRange split_cols(int64_t v, int splits) {
  const int64_t tiles = (v + kTile - 1) / kTile;
  const int64_t s = blockIdx.y;
  const int64_t b = s * tiles / splits * kTile;
  const int64_t e = (s + 1) * tiles / splits * kTile;
  return ColRange{b < v ? b : v, e < v ? e : v};
}

// Tile-local column of this thread's element e (0 <= e < kPerThread), in [0, kTile): 32-bit
// arithmetic inside a row, whose pointer the caller has advanced to the tile.
__device__ __forceinline__ int local_col(int e) {
  return (e / kVec) * (kThreads * kVec) + static_cast<int>(threadIdx.x) * kVec + e % kVec;
}

// This thread's element index of column tcol in the tile that starts at column c0, or -1 (not
// in the tile, or another thread's): the target is located once per tile, not compared with
// every element's column.
__device__ __forceinline__ int target_slot(int64_t tcol, int64_t c0) {
  const int64_t rel = tcol - c0;
  if (rel < 0 || rel >= kTile) return -1;
  const int r = static_cast<int>(rel), group = r / kVec;
  return group % kThreads == static_cast<int>(threadIdx.x) ? (group / kThreads) * kVec + r % kVec
                                                          : -1;
}

// True when rows of stride ld starting at ptr allow Pack<T> accesses at every column that is a
// multiple of kVec.
template <typename T>
__device__ __forceinline__ bool vec_aligned(const void* ptr, int64_t ld) {
  return ld % kVec == 0 && pack_aligned<T>(ptr);
}

// This thread's raw values of a whole tile (z: the tile's first column of an aligned row), one
// Pack<TIn> per kVec columns: 16-byte loads for fp32 logits, 8-byte for 16-bit ones. Loaded a
// tile ahead of their use (the row loops below), so that the next tile's loads are in flight
// while this one is computed.
template <typename TIn>
struct TilePacks {
  Pack<TIn> q[kVecs];
};

template <typename TIn>
__device__ __forceinline__ void load_full(const TIn* z, TilePacks<TIn>& t) {
#pragma unroll
  for (int i = 0; i < kVecs; ++i) t.q[i] = *reinterpret_cast<const Pack<TIn>*>(z + local_col(i * kVec));
}

template <typename TIn>
__device__ __forceinline__ void widen(const TilePacks<TIn>& t, float (&x)[kPerThread]) {
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) x[i * kVec + k] = to_float<TIn>(t.q[i].v[k]);
  }
}

// This thread's kPerThread columns of the tile at z (its first column), of which `left` remain
// in the row (0 past them, nothing past them read), in fp32: the row's last tile, and every
// tile of a row that does not allow Pack accesses.
template <typename TIn>
__device__ __forceinline__ void load_partial(const TIn* z, int64_t left, bool aligned,
                                             float (&x)[kPerThread]) {
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int j = local_col(i * kVec);
    if (aligned && j + kVec <= left) {
      const Pack<TIn> q = *reinterpret_cast<const Pack<TIn>*>(z + j);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[i * kVec + k] = to_float<TIn>(q.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[i * kVec + k] = j + k < left ? to_float<TIn>(z[j + k]) : 0.f;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The logit transform z = softcap(u + b) / T of the row kernels, per element. math.h's
// logit_transform / logit_transform_grad compute the same function with divisions and tanhf:
// ~105 more sm_90a instructions per logit in row_stats and ~225 in row_grad than the plain
// instances; these forms cost ~5 (bias, T) and ~21 (softcap) in row_stats (docs/cuda.md, "Row
// kernels with a bias, a softcap or a temperature"). The CPU backend keeps math.h's tanhf and
// division, so they live here.
//
// kAffine (a bias or a temperature, no softcap): z = (u + b) / T as q = u' (1/T) corrected once,
// q + (u' - T q) (1/T), with u' = u + b (one add) and u' - T q exact by an FMA: with 1/T rounded
// to nearest this is the division's correctly rounded quotient (Markstein's correction;
// tests/cuda_host/test_kernels.cpp row_transform checks it bit for bit against u' / T). 1/T is
// taken once per thread. At T = 1 it is u + b exactly.
//
// kCap (a softcap cap, with or without bias and temperature): with y = u' / cap (u' (1/cap),
// two roundings), z = cap tanh(y) / T from one of two forms, both evaluated, one selected by |y|:
//   |y| < 1:   z = w + w (x P(x)),  w = u' (1/T), x = y^2, tanh(y) = y (1 + x P(x)): P of degree
//              6 fitted to tanh on [0, 1] for relative error (0.08 2^-24 for the polynomial
//              itself, ~1.2 2^-24 with Horner in fp32): relative accuracy down to y -> 0, where
//              z -> u' / T.
//   |y| >= 1:  z = sign(y) (1 - q) cap / T,  q = 2 / (E + 1),  E = 2^(2 |y| log2 e): one
//              ex2.approx and one rcp.approx. With e_E <= 6 2^-24 (2 ulp, the bound CUDA
//              documents for exp2f, plus the rounding of 2 |y| log2 e) and e_R <= 2 2^-24 (1
//              ulp, PTX's bound for rcp.approx.f32), t = 1 - q carries a relative error of at
//              most (e_E E / (E + 1) + 2^-24 + e_R) q / t + 2^-24 <= 3.6 2^-24 (at y = 1, where
//              q / t = 0.31 is largest; it falls as e^-2y above): tanhf's documented 2 ulp.
//              E = inf (|y| > 44) gives t = 1 exactly; NaN stays NaN.
// With the roundings of y (propagated as (1 - t^2) y / t <= 1 times them), of 1/T, cap / T and
// the last product, z carries at most about 6-7 2^-24 |z| with the documented MUFU bounds; on the
// host (exact exp2 and 1/x) row_transform holds it to 6 2^-24 |z| and measures ~2. The softmax
// only needs z to an absolute error of a few ulps of the logits' scale (shared NUMERICS.md); the
// float64 checks of tests/cuda_host/test_kernels.cpp (kU |u| + 4 kU |z| for tanh, kU |z| for
// / T, as for tanhf and two divisions) hold unchanged.
//
// The chain rule (row_grad): dz/du = (1 - t^2) / T with t = z T / cap = z (1 / cap_t), as math.h
// logit_transform_grad; without a softcap 1 / T.
// ---------------------------------------------------------------------------------------------
enum class Xf { kNone, kAffine, kCap };

// The per-kernel constants of the transform (taken once per thread, outside the row loops).
struct Xform {
  const float* bias;
  float temp, inv_t;   // T, 1 / T
  float rcap;          // 1 / cap
  float cap_t, rcap_t; // cap / T, T / cap
};

__device__ __forceinline__ Xform make_xform(const float* bias, float cap, float temp) {
  Xform x;
  x.bias = bias;
  x.temp = temp;
  x.inv_t = 1.f / temp;
  x.rcap = cap > 0.f ? 1.f / cap : 0.f;
  x.cap_t = cap / temp;
  x.rcap_t = cap > 0.f ? temp / cap : 0.f;
  return x;
}

// 2^a for a >= 0 and 1 / d for d >= 2: ex2.approx and rcp.approx on the GPU (one MUFU each;
// the .ftz forms, which only differ on subnormal inputs and results, none of which occur here);
// the host emulation has no such instructions and uses exp2f and a division.
__device__ __forceinline__ float ex2_approx(float a) {
#if defined(__CUDACC__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
#else
  return exp2f(a);
#endif
}
__device__ __forceinline__ float rcp_approx(float d) {
#if defined(__CUDACC__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return r;
#else
  return 1.f / d;
#endif
}

// tanh(y) / y - 1 = x P(x), x = y^2, on [0, 1] (coefficients of x^0 .. x^6, fitted for this file).
__device__ __forceinline__ float tanh_poly(float x) {
  float p = -0x1.77daf6p-12f;
  p = fmaf(p, x, 0x1.2da410p-9f);
  p = fmaf(p, x, -0x1.04607cp-7f);
  p = fmaf(p, x, 0x1.60097cp-6f);
  p = fmaf(p, x, -0x1.b96220p-5f);
  p = fmaf(p, x, 0x1.110be2p-3f);
  p = fmaf(p, x, -0x1.55553cp-2f);
  return p;
}

// The logit z of u, the raw value plus its bias (add_bias).
template <Xf kXf>
__device__ __forceinline__ float xform_logit(float u, const Xform& c) {
  if constexpr (kXf == Xf::kNone) {
    return u;
  } else {
    if constexpr (kXf == Xf::kAffine) {
      const float q = u * c.inv_t;
      // An infinite u' (a -inf bias: a masked vocabulary column) stays infinite: the
      // correction would take inf - inf = NaN and turn the row's loss into NaN.
      return fabsf(u) == INFINITY ? q : fmaf(fmaf(-c.temp, q, u), c.inv_t, q);
    } else {
      const float y = u * c.rcap;
      const float x = y * y;
      const float w = u * c.inv_t;
      const float small = fmaf(w, x * tanh_poly(x), w);
      const float e = ex2_approx(fabsf(y) * 2.88539008177792681f);  // 2 log2(e)
      const float t = fmaf(-2.f, rcp_approx(e + 1.f), 1.f);
      const float big = copysignf(t, y) * c.cap_t;
      return fabsf(y) < 1.f ? small : big;
    }
  }
}

// dz/du at the logit z = xform_logit(u) (the chain rule's factor).
template <Xf kXf>
__device__ __forceinline__ float xform_grad(float z, const Xform& c) {
  if constexpr (kXf == Xf::kNone) {
    return 1.f;
  } else if constexpr (kXf == Xf::kAffine) {
    return c.inv_t;
  } else {
    const float t = z * c.rcap_t;
    return fmaf(-t, t, 1.f) * c.inv_t;
  }
}

// u + b for this thread's columns of the tile at column c0 (`left` of them in the row): one
// 16-byte load per kVec columns in whole tiles (the kernels take the whole-tile path only where
// the bias allows it: vec_aligned), per column with bounds otherwise.
template <bool kFull>
__device__ __forceinline__ void add_bias(float (&x)[kPerThread], const float* bias, int64_t c0,
                                         int64_t left) {
  if (bias == nullptr) return;
  const float* b = bias + c0;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int j = local_col(i * kVec);
    if constexpr (kFull) {
      const Pack<float> q = *reinterpret_cast<const Pack<float>*>(b + j);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[i * kVec + k] += q.v[k];
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (j + k < left) x[i * kVec + k] += b[j + k];
      }
    }
  }
}

// The row loop of both kernels: the split's whole tiles with Pack loads one tile ahead when the
// row allows them (kFull = true: no per-element bounds), then what is left one tile at a time
// with bounds (kFull = false). tile(x, c0, left) gets the tile's fp32 values, its first column
// and the columns left in the row from it.
template <typename TIn, typename F>
__device__ __forceinline__ void for_tiles(const TIn* z, ColRange cols, int64_t v, bool aligned,
                                          F&& tile) {
  int64_t c0 = cols.begin;
  if (aligned && c0 + kTile <= cols.end) {
    TilePacks<TIn> next;
    load_full(z + c0, next);
    for (; c0 + kTile <= cols.end; c0 += kTile) {
      const TilePacks<TIn> cur = next;
      if (c0 + 2 * kTile <= cols.end) load_full(z + c0 + kTile, next);
      float x[kPerThread];
      widen(cur, x);
      tile.template operator()<true>(x, c0, v - c0);
    }
  }
  for (; c0 < cols.end; c0 += kTile) {
    float x[kPerThread];
    load_partial(z + c0, v - c0, aligned, x);
    tile.template operator()<false>(x, c0, v - c0);
  }
}

// The max mx of this thread's tile values x (fmaxf skips NaN) and the first of its equals (0
// where every value is NaN).
__device__ __forceinline__ int first_max(const float (&x)[kPerThread], float& mx) {
  mx = x[0];
#pragma unroll
  for (int e = 1; e < kPerThread; ++e) mx = fmaxf(mx, x[e]);
  int a = 0;
#pragma unroll
  for (int e = kPerThread - 1; e >= 0; --e) a = x[e] == mx ? e : a;
  return a;
}

// kXf: the logits go through bias and temperature (kAffine) or bias, softcap and temperature
// (kCap), xform_logit; kNone: they are used as they are. kSum: the row's sum of logits (label
// smoothing only); kU: the entropy's running sum u (only where the entropy is returned).
// Without them 0 is stored in their place. Per element of a whole tile without these: the
// widening, a max, exp(z - max) and a sum (the target is located once per tile, the -inf guard
// once per thread and tile).
template <typename TIn, Xf kXf, bool kSum, bool kU>
__global__ void __launch_bounds__(kThreads, 2) row_stats_kernel(const RowStatsParams p) {
  FLCE_DYNAMIC_SHARED(smem);
  RowPartial* warp_part = reinterpret_cast<RowPartial*>(smem);  // [kWarps]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const TIn* logits = static_cast<const TIn*>(p.logits);
  const Xform xf = make_xform(p.bias, p.softcap, p.temperature);
  const bool aligned = vec_aligned<TIn>(logits, p.ld) &&
                       (kXf == Xf::kNone || p.bias == nullptr || pack_aligned<float>(p.bias));
  const ColRange cols = split_cols(p.v, p.splits);
  for (int64_t row = blockIdx.x; row < p.n; row += gridDim.x) {
    const int64_t tcol =
        target_column(p.target[row * p.target_stride], p.ignore_index, p.col_offset, p.v);
    OnlineLse st = lse_empty();
    float zt = neg_inf(), sum = 0.f, comp = 0.f;
    for_tiles(logits + row * p.ld, cols, p.v, aligned,
              [&]<bool kFull>(float (&x)[kPerThread], int64_t c0, int64_t left) {
      if constexpr (kXf != Xf::kNone) add_bias<kFull>(x, xf.bias, c0, left);
      // Columns past the row's end (0 from load_partial): -inf, and out of the logit sum.
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        const int j = local_col(e);
        const bool in = kFull || j < left;
        const float zj = xform_logit<kXf>(x[e], xf);
        if constexpr (kSum) {
          if (in) kahan_add(sum, comp, zj);
        }
        x[e] = in ? zj : neg_inf();
      }
      // The target leaves (max, sum exp): its owner takes it out, once per tile.
      const int slot = target_slot(tcol, c0);
      if (slot >= 0) {
#pragma unroll
        for (int e = 0; e < kPerThread; ++e) {
          if (e == slot) {
            zt = x[e];
            x[e] = neg_inf();
          }
        }
      }
      // Two passes over the thread's columns: their max (fmaxf skips NaN), then sum exp(z - max)
      // and the entropy's exp(z - max) (max - z), merged into the row state once
      // (lse_add_tile). -inf columns add exp(-inf) = 0. A thread tile of -inf only (or NaN)
      // has max -inf: the exponents are then taken against 0, which keeps -inf - -inf out of
      // the sum (exp(-inf) = 0 again) and NaN in it, without a branch.
      float mx = x[0];
#pragma unroll
      for (int e = 1; e < kPerThread; ++e) mx = fmaxf(mx, x[e]);
      const float ref = mx == neg_inf() ? 0.f : mx;
      float ts = 0.f, tu = 0.f;
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        const float ex = expf(x[e] - ref);
        ts += ex;
        if constexpr (kU) tu += ex == 0.f ? 0.f : ex * (ref - x[e]);
      }
      lse_add_tile(st, mx, ts, tu);
    });
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

// ---------------------------------------------------------------------------------------------
// Soft mode (target distributions, math.h SoftRow; opt-in, never run on a GPU): each column's
// target weight y_c = w_c (alpha q_c + beta) (params.h SoftTargetParams) read beside its logit,
// one element at a time (the dense q in its own dtype, or the row's class column).
// ---------------------------------------------------------------------------------------------
// A row's source of target weights: its probabilities (bytes of its column 0), or its class.
struct SoftRowY {
  const char* q;  // nullptr: class targets
  int64_t tcol;   // the class's column here, or -1
  bool none;      // class targets: an ignored row (every y_c = 0)
};

__device__ __forceinline__ SoftRowY soft_row_y(const SoftTargetParams& s, int64_t row,
                                               int64_t col_offset, int64_t v) {
  if (s.q != nullptr) {
    const int64_t size = s.q_dtype == DType::kFloat32 ? 4 : 2;
    return SoftRowY{static_cast<const char*>(s.q) + row * s.ldq * size, -1, false};
  }
  const int64_t t = s.t[row * s.t_stride];
  return SoftRowY{nullptr, target_column(t, s.ignore_index, col_offset, v), t == s.ignore_index};
}

// y_c of column col (in the row) of the row r.
__device__ __forceinline__ float soft_y(const SoftTargetParams& s, const SoftRowY& r,
                                        int64_t col) {
  float y;
  if (r.q != nullptr) {
    float q;
    switch (s.q_dtype) {
      case DType::kBFloat16:
        q = to_float<__nv_bfloat16>(reinterpret_cast<const __nv_bfloat16*>(r.q)[col]);
        break;
      case DType::kFloat16:
        q = to_float<__half>(reinterpret_cast<const __half*>(r.q)[col]);
        break;
      default:
        q = reinterpret_cast<const float*>(r.q)[col];
    }
    y = q * s.alpha + s.beta;
  } else {
    y = r.none ? 0.f : (col == r.tcol ? s.beta + s.alpha : s.beta);
  }
  return s.w != nullptr ? y * s.w[col] : y;
}

// r merged with lane + off's state (a tree over the warp: lane 0 ends with the warp's states
// merged in a fixed order, the lower lanes' states first).
__device__ __forceinline__ SoftRow soft_merge_down(const SoftRow& r, int off) {
  SoftRow o;
  o.p = __shfl_down_sync(0xffffffffu, r.p, off);
  o.a = __shfl_down_sync(0xffffffffu, r.a, off);
  o.y_a = __shfl_down_sync(0xffffffffu, r.y_a, off);
  o.x.m = __shfl_down_sync(0xffffffffu, r.x.m, off);
  o.x.s = __shfl_down_sync(0xffffffffu, r.x.s, off);
  o.x.u = __shfl_down_sync(0xffffffffu, r.x.u, off);
  o.y_rest = __shfl_down_sync(0xffffffffu, r.y_rest, off);
  o.g = __shfl_down_sync(0xffffffffu, r.g, off);
  return soft_merge(r, o);
}

// row_stats in soft mode: one CTA per (row, column split), each thread folding its columns of
// every tile as the CPU's fold_soft_row folds a tile (the thread tile's largest logit, the first
// of equals, is its pivot; the others' online logsumexp with the entropy's u, y_rest and G via
// soft_gap_term), its tiles merged in column order (soft_merge), then the warp's lanes (a tree)
// and the CTA's warps in order. Columns past the row's end are -inf with y = 0, and a thread
// without a column in the row folds nothing (its pivot would be no column).
template <typename TIn, Xf kXf>
__global__ void __launch_bounds__(kThreads, 2) soft_stats_kernel(const SoftStatsParams p) {
  FLCE_DYNAMIC_SHARED(smem);
  SoftRow* warp_state = reinterpret_cast<SoftRow*>(smem);  // [kWarps]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const TIn* logits = static_cast<const TIn*>(p.logits);
  const Xform xf = make_xform(p.bias, p.softcap, p.temperature);
  const bool aligned = vec_aligned<TIn>(logits, p.ld) &&
                       (kXf == Xf::kNone || p.bias == nullptr || pack_aligned<float>(p.bias));
  const ColRange cols = split_cols(p.v, p.splits);
  for (int64_t row = blockIdx.x; row < p.n; row += gridDim.x) {
    const SoftRowY ry = soft_row_y(p.y, row, p.col_offset, p.v);
    SoftRow st = soft_empty();
    for_tiles(logits + row * p.ld, cols, p.v, aligned,
              [&]<bool kFull>(float (&x)[kPerThread], int64_t c0, int64_t left) {
      if (!kFull && local_col(0) >= left) return;
      if constexpr (kXf != Xf::kNone) add_bias<kFull>(x, xf.bias, c0, left);
      float y[kPerThread];
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        const int j = local_col(e);
        const bool in = kFull || j < left;
        x[e] = in ? xform_logit<kXf>(x[e], xf) : neg_inf();
        y[e] = in ? soft_y(p.y, ry, c0 + j) : 0.f;
      }
      float mx;
      const int a = first_max(x, mx);
      float piv = 0.f, y_a = 0.f;
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        if (e == a) {
          piv = x[e];
          y_a = y[e];
          x[e] = neg_inf();
          y[e] = 0.f;
        }
      }
      // The others as row_stats_kernel's two passes (against 0 where all are -inf).
      float m = x[0];
#pragma unroll
      for (int e = 1; e < kPerThread; ++e) m = fmaxf(m, x[e]);
      const float ref = m == neg_inf() ? 0.f : m;
      float ts = 0.f, tu = 0.f, yr = 0.f, g = 0.f;
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        const float ex = expf(x[e] - ref);
        ts += ex;
        tu += ex == 0.f ? 0.f : ex * (ref - x[e]);
        yr += y[e];
        g += soft_gap_term(y[e], piv, x[e]);
      }
      st = soft_merge(st, SoftRow{piv, p.col_offset + c0 + local_col(a), y_a,
                                  OnlineLse{m, ts, tu}, yr, g});
    });
#pragma unroll
    for (int off = 16; off > 0; off /= 2) st = soft_merge_down(st, off);
    if (lane == 0) warp_state[warp] = st;
    __syncthreads();
    if (threadIdx.x == 0) {
      SoftRow all = soft_empty();
      for (int w = 0; w < kWarps; ++w) all = soft_merge(all, warp_state[w]);
      const int64_t k = blockIdx.y * p.n + row;
      soft_store(all, p.partials + k * kSoftCols);
      p.pivots[k] = all.a;
    }
    __syncthreads();  // warp_state is reused by the next row
  }
}

// A row's argmax so far (launch_row_argmax): the largest non-target z and its global column
// (-1: none yet, -2: a NaN). merge keeps the larger, the lower column of equals, -2 for good:
// symmetric, so a butterfly's partners agree.
struct ArgMax {
  float m;
  int64_t col;
};

__device__ __forceinline__ ArgMax arg_merge(const ArgMax& a, const ArgMax& b) {
  if (a.col == -2 || b.col == -2) return ArgMax{a.m, -2};
  if (b.col < 0) return a;
  return a.col < 0 || b.m > a.m || (b.m == a.m && b.col < a.col) ? b : a;
}

// launch_row_argmax: each thread folds its tiles' first max (first_max; a later tile's only
// where larger), then the lanes (a butterfly) and the warps in order. A thread tile whose
// candidates are all -inf takes its first candidate: first_max could name the masked target.
template <typename TIn, Xf kXf>
__global__ void __launch_bounds__(kThreads, 2) row_argmax_kernel(const RowArgmaxParams p) {
  FLCE_DYNAMIC_SHARED(smem);
  ArgMax* warp_arg = reinterpret_cast<ArgMax*>(smem);  // [kWarps]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const TIn* logits = static_cast<const TIn*>(p.logits);
  const Xform xf = make_xform(p.bias, p.softcap, p.temperature);
  const bool aligned = vec_aligned<TIn>(logits, p.ld) &&
                       (kXf == Xf::kNone || p.bias == nullptr || pack_aligned<float>(p.bias));
  for (int64_t row = blockIdx.x; row < p.n; row += gridDim.x) {
    const int64_t tcol =
        target_column(p.target[row * p.target_stride], p.ignore_index, p.col_offset, p.v);
    ArgMax best{neg_inf(), -1};
    for_tiles(logits + row * p.ld, ColRange{0, p.v}, p.v, aligned,
              [&]<bool kFull>(float (&x)[kPerThread], int64_t c0, int64_t left) {
      if constexpr (kXf != Xf::kNone) add_bias<kFull>(x, xf.bias, c0, left);
      const int slot = target_slot(tcol, c0);
      int first = -1;
      bool nan = false;
#pragma unroll
      for (int e = kPerThread - 1; e >= 0; --e) {
        const bool in = (kFull || local_col(e) < left) && e != slot;
        const float z = xform_logit<kXf>(x[e], xf);
        nan = nan || (in && z != z);
        first = in ? e : first;
        x[e] = in ? z : neg_inf();
      }
      if (first < 0) return;
      float mx;
      const int a = first_max(x, mx);
      const int64_t col = p.col_offset + c0 + local_col(mx == neg_inf() ? first : a);
      best = arg_merge(best, ArgMax{mx, nan ? -2 : col});
    });
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      const ArgMax o{__shfl_xor_sync(0xffffffffu, best.m, off),
                     __shfl_xor_sync(0xffffffffu, best.col, off)};
      best = arg_merge(best, o);
    }
    if (lane == 0) warp_arg[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      ArgMax all = warp_arg[0];
      for (int w = 1; w < kWarps; ++w) all = arg_merge(all, warp_arg[w]);
      p.argmax[row] = all.col;
    }
    __syncthreads();  // warp_arg is reused by the next row
  }
}

// kXf != kNone: bias, softcap (kCap), temperature or the entropy's term in the coefficients
// (xform_logit, xform_grad, logit_grad); kNone: none of them, dz_j = A exp(z_j - ref) / S - U
// straight (logit_grad_plain). kExtras: the master weights' residual tile (grad_lo) or the
// bias's column sums (col_partials), each where its pointer is set (the target entry's residual,
// target_resid, is written by every instance where it is set). Per element of a whole tile without them: the widening, exp, two
// multiply-adds, the rounding to T and its share of a Pack store; the target is written once per
// tile. Two CTAs per SM (at most 128 registers a thread; ptxas reports no spill): with one, a
// transform instance (118-157 registers unbounded) left 8 warps per SM to cover the memory
// latency. The 16-bit-logits instances with extras keep one (they would spill 8 bytes).
// kSoft: soft mode (row_grad_kernel's body for soft_grad_kernel, below): the target is the row's
// pivot, and every other column subtracts u y_c (math.h soft_logit_grad; u = g from
// soft_row_grad). Only with a transform instance (kXf != kNone).
template <typename TIn, typename T, Xf kXf, bool kExtras, bool kSoft>
__device__ __forceinline__ void row_grad_rows(const RowGradParams& p) {
  static_assert(!kSoft || kXf != Xf::kNone, "soft mode takes logit_grad (a transform instance)");
  const int64_t rows = p.rows_per_cta;
  const int64_t blocks = (p.n + rows - 1) / rows;
  const TIn* logits = static_cast<const TIn*>(p.logits);
  // (the residual tile, where there is one, is written element by element: any alignment)
  const Xform xf = make_xform(p.bias, p.softcap, p.temperature);
  const bool aligned = vec_aligned<TIn>(logits, p.ld) && vec_aligned<T>(p.grad, p.grad_ld) &&
                       (kXf == Xf::kNone || p.bias == nullptr || pack_aligned<float>(p.bias));
  const ColRange cols = split_cols(p.v, p.col_splits);
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = b * rows + r;
      if (row >= p.n) break;  // CTA-uniform
      T* out = static_cast<T*>(p.grad) + row * p.grad_ld;
      T* lo = kExtras && p.grad_lo != nullptr ? static_cast<T*>(p.grad_lo) + row * p.grad_lo_ld
                                              : nullptr;
      float* colsum = kExtras && p.col_partials != nullptr ? p.col_partials + b * p.v : nullptr;
      const RowGrad rg = load_row_grad(p.coef, row);
      SoftRowY ry{};
      if constexpr (kSoft) ry = soft_row_y(p.mode.y, row, p.col_offset, p.v);
      const int64_t tcol =
          target_column(p.target[row * p.target_stride], p.ignore_index, p.col_offset, p.v);
      if (p.target_resid != nullptr && tcol < 0 && threadIdx.x == 0 && blockIdx.y == 0) {
        p.target_resid[row] = 0.f;
      }
      // The target's whole gradient dz_t z'(u_t), taken once per row by the thread whose tile
      // columns hold it (the one target_slot names in its tile), from its logit read before any
      // thread writes this row (same arithmetic as the tile's: widened, + bias, xform_logit),
      // with its residual; the tile loop only puts it in place.
      float gt = 0.f;
      if (tcol >= cols.begin && tcol < cols.end &&
          target_slot(tcol, cols.begin + (tcol - cols.begin) / kTile * kTile) >= 0) {
        float ut = to_float<TIn>(logits[row * p.ld + tcol]);
        if (kXf != Xf::kNone && xf.bias != nullptr) ut += xf.bias[tcol];
        gt = rg.dz_t * xform_grad<kXf>(xform_logit<kXf>(ut, xf), xf);
        if (sizeof(T) == 2 && p.target_resid != nullptr) {
          p.target_resid[row] = gt - to_float<T>(from_float<T>(gt));
        }
      }
      for_tiles(logits + row * p.ld, cols, p.v, aligned,
                [&]<bool kFull>(float (&x)[kPerThread], int64_t c0, int64_t left) {
        // In place, the 16-bit gradient of tile [c0, c0 + kTile) of fp32 logits lands on the
        // bytes of logits [c0 / 2, (c0 + kTile) / 2): all of them read already by every thread
        // after this barrier (earlier tiles, and this one; the next tile's loads are in flight
        // from before it), none of a later tile. (Same-width logits are rewritten by the thread
        // that read them: no barrier needed.)
        if constexpr (sizeof(T) < sizeof(TIn)) __syncthreads();
        if constexpr (kXf != Xf::kNone) add_bias<kFull>(x, xf.bias, c0, left);
        float g[kPerThread];
#pragma unroll
        for (int e = 0; e < kPerThread; ++e) {
          if constexpr (kSoft) {
            // (past the row's end: no target weight read, nothing stored)
            const int j = local_col(e);
            const float y = kFull || j < left ? soft_y(p.mode.y, ry, c0 + j) : 0.f;
            x[e] = xform_logit<kXf>(x[e], xf);
            g[e] = soft_logit_grad(rg, x[e], y) * xform_grad<kXf>(x[e], xf);
          } else if constexpr (kXf != Xf::kNone) {
            // (columns past the row's end hold 0: their gradient is computed and not stored)
            x[e] = xform_logit<kXf>(x[e], xf);
            g[e] = logit_grad(rg, x[e]) * xform_grad<kXf>(x[e], xf);
          } else {
            g[e] = logit_grad_plain(rg, x[e]);
          }
        }
        const int slot = target_slot(tcol, c0);
        if (slot >= 0) {  // the target's whole gradient (gt), its owner only
#pragma unroll
          for (int e = 0; e < kPerThread; ++e) g[e] = e == slot ? gt : g[e];
        }
        T* o = out + c0;
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
          const int j = local_col(i * kVec);
          Pack<T> hi;
#pragma unroll
          for (int k = 0; k < kVec; ++k) hi.v[k] = from_float<T>(g[i * kVec + k]);
          if (kFull || j + kVec <= left) {
            if (kFull || aligned) {
              *reinterpret_cast<Pack<T>*>(o + j) = hi;
            } else {
#pragma unroll
              for (int k = 0; k < kVec; ++k) o[j + k] = hi.v[k];
            }
          } else {
            for (int k = 0; k < kVec && j + k < left; ++k) o[j + k] = hi.v[k];
          }
          if constexpr (kExtras) {
            for (int k = 0; k < kVec && (kFull || j + k < left); ++k) {
              const int64_t col = c0 + j + k;
              const float dz = g[i * kVec + k];
              // (an fp32 tile is exact: nothing to keep)
              if (sizeof(T) == 2 && lo != nullptr) {
                lo[col] = from_float<T>(dz - to_float<T>(hi.v[k]));
              }
              if (colsum != nullptr) colsum[col] = r == 0 ? dz : colsum[col] + dz;
            }
          }
        }
      });
    }
  }
}

template <typename TIn, typename T, Xf kXf, bool kExtras>
__global__ void __launch_bounds__(kThreads, kExtras && sizeof(TIn) == 2 ? 1 : 2)
row_grad_kernel(const RowGradParams p) {
  row_grad_rows<TIn, T, kXf, kExtras, false>(p);
}

// row_grad in soft mode (p.mode.soft; instances for fp32 logits, and 16-bit logits without
// extras).
template <typename TIn, typename T, Xf kXf, bool kExtras>
__global__ void __launch_bounds__(kThreads, kExtras && sizeof(TIn) == 2 ? 1 : 2)
soft_grad_kernel(const RowGradParams p) {
  row_grad_rows<TIn, T, kXf, kExtras, true>(p);
}

// Packs of kVec elements where every slice allows them (count a multiple of kVec, aligned
// pointers), then one element per thread for the rest. out may be x (one slice, in place: each
// element is read and then written by the same thread, once; no __restrict__ on them).
template <typename T, typename X>
__global__ void scale_grad_kernel(T* out, const X* x, int slices, int64_t count,
                                  const double* __restrict__ scale) {
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

namespace {

int elt_bytes(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16 ? 2 : 4; }

// XF_SWITCH(xf, NAME, body): the runtime Xf as the compile-time constant NAME inside body (one
// instance per transform kind, as BOOL_SWITCH).
#define XF_SWITCH(XF, CONST_NAME, ...)                  \
  [&] {                                                 \
    switch (XF) {                                       \
      case Xf::kCap: {                                  \
        constexpr static Xf CONST_NAME = Xf::kCap;      \
        return __VA_ARGS__();                           \
      }                                                 \
      case Xf::kAffine: {                               \
        constexpr static Xf CONST_NAME = Xf::kAffine;   \
        return __VA_ARGS__();                           \
      }                                                 \
      default: {                                        \
        constexpr static Xf CONST_NAME = Xf::kNone;     \
        return __VA_ARGS__();                           \
      }                                                 \
    }                                                   \
  }()

// pick(a value of the logits' type).
template <typename F>
void with_logits_type(DType dtype, F&& pick) {
  switch (dtype) {
    case DType::kFloat32:
      pick(float{});
      break;
    case DType::kBFloat16:
      pick(__nv_bfloat16{});
      break;
    case DType::kFloat16:
      pick(__half{});
      break;
  }
}

Xf stats_xf(const RowOperands& p) {
  return p.softcap > 0.f                                ? Xf::kCap
         : p.bias != nullptr || p.temperature != 1.f ? Xf::kAffine
                                                        : Xf::kNone;
}

// The row_stats_kernel instance of these parameters: fn(kernel pointer's template).
template <typename F>
void with_stats_kernel(const RowStatsParams& p, F&& fn) {
  with_logits_type(p.logits_dtype, [&](auto tin) {
    using TIn = decltype(tin);
    XF_SWITCH(stats_xf(p), kXf, [&] {
      BOOL_SWITCH(p.need_sum, kSum, [&] {
        BOOL_SWITCH(p.need_u, kU, [&] {
          fn.template operator()<row_stats_kernel<TIn, kXf, kSum, kU>>();
        });
      });
    });
  });
}

// The same for soft_stats_kernel.
template <typename F>
void with_soft_stats_kernel(const SoftStatsParams& p, F&& fn) {
  with_logits_type(p.logits_dtype, [&](auto tin) {
    using TIn = decltype(tin);
    XF_SWITCH(stats_xf(p), kXf, [&] { fn.template operator()<soft_stats_kernel<TIn, kXf>>(); });
  });
}

// The row_grad_kernel instance of these parameters (gradient type `dtype`); false when that
// pair of logits and gradient types has none.
template <typename F>
bool with_grad_kernel(const RowGradParams& p, DType dtype, F&& fn) {
  // (the entropy's term alone goes through kAffine's logit_grad, at T = 1 without a bias)
  // (soft mode: a transform instance, whose logit_grad soft_logit_grad takes)
  const Xf xf = p.softcap > 0.f ? Xf::kCap
                : p.bias != nullptr || p.temperature != 1.f || p.entropy || p.mode.soft
                    ? Xf::kAffine
                    : Xf::kNone;
  // (the target's residual is one store per row, by the target's owner: not an extra)
  const bool extras = p.grad_lo != nullptr || p.col_partials != nullptr;
  bool served = true;
  auto pick = [&](auto tin, auto tout) {
    using TIn = decltype(tin);
    using T = decltype(tout);
    XF_SWITCH(xf, kXf, [&] {
      BOOL_SWITCH(extras, kExtras, [&] {
        if (!p.mode.soft) {
          fn.template operator()<row_grad_kernel<TIn, T, kXf, kExtras>>();
        } else if constexpr (kXf != Xf::kNone && (sizeof(TIn) == 4 || !kExtras)) {
          fn.template operator()<soft_grad_kernel<TIn, T, kXf, kExtras>>();
        } else {
          served = false;  // (no caller: the logits ops have no extras)
        }
      });
    });
  };
  const bool f32_in = p.logits_dtype == DType::kFloat32;
  if (!f32_in && dtype != p.logits_dtype) return false;
  switch (dtype) {
    case DType::kFloat32:
      pick(float{}, float{});
      break;
    case DType::kBFloat16:
      if (f32_in) {
        pick(float{}, __nv_bfloat16{});
      } else {
        pick(__nv_bfloat16{}, __nv_bfloat16{});
      }
      break;
    case DType::kFloat16:
      if (f32_in) {
        pick(float{}, __half{});
      } else {
        pick(__half{}, __half{});
      }
      break;
  }
  return served;
}

int splits_for(int64_t ctas, int64_t v, int per_sm, int sm_count) {
  return binding::heuristics::row_splits(ctas, (v + kTile - 1) / kTile, per_sm, sm_count);
}

}  // namespace

int row_stats_splits(const RowStatsParams& p, int sm_count) {
  int per_sm = 1;
  with_stats_kernel(p, [&]<auto kKernel>() {
    per_sm = max_active_ctas<kKernel>(kThreads, kWarps * sizeof(RowPartial));
  });
  return splits_for(p.n, p.v, per_sm, sm_count);
}

int soft_stats_splits(const SoftStatsParams& p, int sm_count) {
  int per_sm = 1;
  with_soft_stats_kernel(p, [&]<auto kKernel>() {
    per_sm = max_active_ctas<kKernel>(kThreads, kWarps * sizeof(SoftRow));
  });
  return splits_for(p.n, p.v, per_sm, sm_count);
}

int row_grad_splits(const RowGradParams& p, DType dtype, int sm_count) {
  int per_sm = 1;
  with_grad_kernel(p, dtype, [&]<auto kKernel>() { per_sm = max_active_ctas<kKernel>(kThreads, 0); });
  return splits_for((p.n + std::max(p.rows_per_cta, 1) - 1) / std::max(p.rows_per_cta, 1), p.v,
                    per_sm, sm_count);
}

cudaError_t launch_row_stats(const RowStatsParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.splits < 1 || p.splits > 65535) return cudaErrorInvalidValue;
  with_stats_kernel(p, [&]<auto kKernel>() {
    launch_kernel<kKernel>(dim3(grid_rows(p.n), p.splits), dim3(kThreads),
                           kWarps * sizeof(RowPartial), stream, p);
  });
  return cudaGetLastError();
}

cudaError_t launch_row_argmax(const RowArgmaxParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.argmax == nullptr) return cudaErrorInvalidValue;
  with_logits_type(p.logits_dtype, [&](auto tin) {
    using TIn = decltype(tin);
    XF_SWITCH(stats_xf(p), kXf, [&] {
      launch_kernel<row_argmax_kernel<TIn, kXf>>(dim3(grid_rows(p.n)), dim3(kThreads),
                                                 kWarps * sizeof(ArgMax), stream, p);
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_soft_stats(const SoftStatsParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.splits < 1 || p.splits > 65535 || p.pivots == nullptr) return cudaErrorInvalidValue;
  with_soft_stats_kernel(p, [&]<auto kKernel>() {
    launch_kernel<kKernel>(dim3(grid_rows(p.n), p.splits), dim3(kThreads),
                           kWarps * sizeof(SoftRow), stream, p);
  });
  return cudaGetLastError();
}

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
  const bool ok = with_grad_kernel(p, dtype, [&]<auto kKernel>() {
    launch_kernel<kKernel>(grid, dim3(kThreads), 0, stream, p);
  });
  return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_target_rows(const TargetRowsParams& p, DType dtype, cudaStream_t stream) {
  if (p.n == 0 || p.d == 0 || p.rows == 0) return cudaSuccess;
  if (p.out == nullptr && (p.store == nullptr || p.base == nullptr)) return cudaErrorInvalidValue;
  // A grid-stride loop over the sorted rows: most runs of equal targets fall outside a dW piece
  // of `rows` vocabulary rows, so a CTA per row would mostly start, find no target of its piece
  // and exit.
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
