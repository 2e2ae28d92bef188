// flce::distill_rows_ on the CUDA backend: the row math of flce.linear_distillation's chunk loop
// (python/flce/distill.py; its logit and gradient GEMMs are cuBLAS's through torch.mm), the same
// passes as the CPU op (csrc/cpu/distill_cpu.cpp) with the formulas of flce/math.h (dominant,
// dominant_log_p, mix_row, mix, kl_grad, hard_grad; docs/numerics.md "Distillation").
//
// One CTA of kThreads threads per row (a grid-stride loop over the rows); thread k owns the
// columns k, k + kThreads, ... (each warp access one contiguous span; the loops unrolled 4 deep,
// so that a thread has several columns' loads in flight: a chunk of ~130 rows is ~130 CTAs, about
// one per SM). Per row, four passes over both logit rows:
//   1. each distribution's largest logit and its first column (the first NaN where there is
//      one, as torch.argmax), and the un-tempered student's for a tempered hard term;
//   2. s = sum_{j != a} exp(u_j - u_a) of each (math.h dominant);
//   3. the divergence's per-column log ratios (JSD: mix) and their weighted sums c, with the
//      probabilities' sums, in double (math.h kl_center);
//   4. the gradients, written over the logits (each element read by its own thread before it
//      is written); the log ratios are recomputed here rather than kept, so the chunk's
//      [rows, V] logit buffers are the only large memory.
// Reductions run in a fixed tree (per thread in column order, warp butterflies, the warps in
// order): bitwise reproducible, no atomics. All single-element reads of a row (its dominant
// classes' logits, the target's) happen before the barrier that precedes pass 4.
#include <cstdint>

#include "device.cuh"
#include "flce/math.h"
#include "params.h"

namespace flce {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kNone = INT64_MAX;

// A running first maximum of a row's values: m at column i (-1: no value yet), and the first
// NaN's column (kNone: none). Columns arrive in increasing order within a thread, so the first
// of equals is kept by a strict comparison.
template <typename T>
struct Arg {
  T m;
  int64_t i, nan;
};

template <typename T>
__device__ __forceinline__ void arg_add(Arg<T>& a, T u, int64_t j) {
  if (u != u) {
    a.nan = a.nan == kNone ? j : a.nan;
  } else if (a.i < 0 || u > a.m) {
    a.m = u;
    a.i = j;
  }
}

// Symmetric in its arguments (the butterfly's partners compute the same value).
template <typename T>
__device__ __forceinline__ Arg<T> arg_merge(Arg<T> a, const Arg<T>& b) {
  a.nan = b.nan < a.nan ? b.nan : a.nan;
  if (b.i >= 0 && (a.i < 0 || b.m > a.m || (b.m == a.m && b.i < a.i))) {
    a.m = b.m;
    a.i = b.i;
  }
  return a;
}

// The row's dominant column: its first NaN, else its first maximum (0 for V = 0, not launched).
template <typename T>
__device__ __forceinline__ int64_t arg_column(const Arg<T>& a) {
  return a.nan != kNone ? a.nan : (a.i >= 0 ? a.i : 0);
}

// Every thread ends with the merge of the block's values in the fixed tree; slots [kWarps] of
// shared memory, not reused before the row's closing barrier.
template <typename T>
__device__ __forceinline__ Arg<T> block_arg(Arg<T> a, Arg<T>* slots) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const Arg<T> o{__shfl_xor_sync(0xffffffffu, a.m, off), __shfl_xor_sync(0xffffffffu, a.i, off),
                   __shfl_xor_sync(0xffffffffu, a.nan, off)};
    a = arg_merge(a, o);
  }
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = a;
  __syncthreads();
  Arg<T> all = slots[0];
  for (int w = 1; w < kWarps; ++w) all = arg_merge(all, slots[w]);
  return all;
}

template <typename T>
__device__ __forceinline__ T block_sum(T x, T* slots) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = x;
  __syncthreads();
  T all = slots[0];
  for (int w = 1; w < kWarps; ++w) all += slots[w];
  return all;
}

// The row's shared memory: each reduction of a row its own slots.
template <typename T>
struct Slots {
  Arg<T> arg[3][kWarps];  // pass 1: student, teacher, un-tempered student
  T sum[3][kWarps];       // pass 2: the same three
  double c[4][kWarps];    // pass 3: c_S, c_T and the probabilities' sums (kl_center)
};

// The hard term's distribution: none (hard_weight 0), the tempered student's own (temperature
// 1: H = S), or the un-tempered student's (its own pass-1 and pass-2 statistics).
enum class Hard { kNone, kSame, kOwn };

// A distribution's row statistics over u = z / temp: its dominant column a, u_a and math.h's
// Dominant (l = log1p(s), e = s / (1 + s)).
template <typename T>
struct Side {
  int64_t a;
  T u_a;
  Dominant<T> d;
};

// fp32: two CTAs per SM (at most 128 registers a thread): with no minimum, ptxas for sm_100 held
// the fp32 instances to 64 registers and spilled. fp64 (float64 inputs: gradcheck, references)
// one CTA: its JSD instance spilled at 128 registers on sm_100.
template <typename T, DistillDiv kDiv>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 4 ? 2 : 1)
    distill_rows_kernel(const DistillRowsParams p) {
  FLCE_DYNAMIC_SHARED(smem);
  Slots<T>& sh = *reinterpret_cast<Slots<T>*>(smem);
  const int64_t v = p.v;
  const T temp = static_cast<T>(p.temperature);
  const T beta = static_cast<T>(p.beta), omb = static_cast<T>(1.0 - p.beta);
  const T logit_beta = static_cast<T>(p.logit_beta);
  const T hw = static_cast<T>(p.hard_weight), sw = static_cast<T>(p.soft_weight);
  const T k = static_cast<T>(p.soft_weight / p.temperature);
  const Hard hard = p.hard_weight == 0.0 ? Hard::kNone
                    : p.temperature == 1.0 ? Hard::kSame : Hard::kOwn;
  const int64_t j0 = threadIdx.x;
  for (int64_t row = blockIdx.x; row < p.n; row += gridDim.x) {
    T* zs = static_cast<T*>(p.z_s) + row * v;
    T* zt = static_cast<T*>(p.z_t) + row * v;
    T* loss = static_cast<T*>(p.loss);
    if (!p.valid[row]) {
      // an ignored row: no loss and no gradient, whatever its logits
      if (threadIdx.x == 0) loss[row] = T(0);
      for (int64_t j = j0; j < v; j += kThreads) {
        if (p.grad_s) zs[j] = T(0);
        if (p.grad_t) zt[j] = T(0);
      }
      continue;  // (no shared memory touched)
    }
    // 1. the dominant columns
    Arg<T> as{T(0), -1, kNone}, at{T(0), -1, kNone}, ah{T(0), -1, kNone};
#pragma unroll 4
    for (int64_t j = j0; j < v; j += kThreads) {
      const T z = zs[j];
      arg_add(as, z / temp, j);
      arg_add(at, zt[j] / temp, j);
      if (hard == Hard::kOwn) arg_add(ah, z, j);
    }
    const int64_t a_s = arg_column(block_arg(as, sh.arg[0]));
    const int64_t a_t = arg_column(block_arg(at, sh.arg[1]));
    const int64_t a_h = hard == Hard::kOwn ? arg_column(block_arg(ah, sh.arg[2])) : a_s;
    const T us_a = zs[a_s] / temp, ut_a = zt[a_t] / temp, uh_a = zs[a_h];
    // 2. the sums of the other columns' exp(u_j - u_a)
    T ss = 0, st = 0, sh_ = 0;
#pragma unroll 4
    for (int64_t j = j0; j < v; j += kThreads) {
      const T z = zs[j];
      const T es = exp_t(z / temp - us_a), et = exp_t(zt[j] / temp - ut_a);
      ss += j == a_s ? T(0) : es;
      st += j == a_t ? T(0) : et;
      if (hard == Hard::kOwn) sh_ += j == a_h ? T(0) : exp_t(z - uh_a);
    }
    const Side<T> S{a_s, us_a, dominant(block_sum(ss, sh.sum[0]))};
    const Side<T> P{a_t, ut_a, dominant(block_sum(st, sh.sum[1]))};
    const Side<T> H = hard == Hard::kOwn ? Side<T>{a_h, uh_a, dominant(block_sum(sh_, sh.sum[2]))}
                                         : S;
    const T ls = S.d.l, lt = P.d.l;
    // the other model's logit at each dominant class, and rho = log(S / T) there
    const T ut_as = zt[a_s] / temp, us_at = zs[a_t] / temp;
    const T rho_as = dominant_log_p(us_a, us_a, ls) - dominant_log_p(ut_as, ut_a, lt);
    const T rho_at = dominant_log_p(us_at, us_a, ls) - dominant_log_p(ut_a, ut_a, lt);
    // The hard term's log p_t, read now (pass 4 overwrites the logits); a target outside the
    // row gives NaN, never an out-of-bounds read.
    T log_pt = 0;
    int64_t t = -1;
    if (hard != Hard::kNone) {
      t = p.target[row];
      log_pt = t >= 0 && t < v ? dominant_log_p(zs[t], H.u_a, H.d.l) : static_cast<T>(NAN);
    }
    // JSD: relative to the dominant class, mix(x_j) - mix(x_a) = mix(x_j - x_a) with
    // logit(w') = x_a + logit(w) (docs/numerics.md, "Distillation").
    const T xs_a = -rho_as, xt_a = rho_at;
    MixRow<T> ms{}, mt{};
    if constexpr (kDiv == DistillDiv::kJsd) {
      ms = mix_row<T>(xs_a + logit_beta);
      mt = mix_row<T>(xt_a - logit_beta);
    }
    // Column j's log ratios relative to the dominant classes: r_s (P = S, reverse KL and JSD)
    // and r_t (P = T, forward KL and JSD), as pass 3 forms them and pass 4 again.
    auto ratios = [&](T us, T ut, T& r_s, T& r_t) {
      const T rel_s = (us - us_a) - (ut - ut_as);
      const T rel_t = (us - us_at) - (ut - ut_a);
      if constexpr (kDiv == DistillDiv::kForwardKl) {
        r_s = 0;
        r_t = -rel_t;
      } else if constexpr (kDiv == DistillDiv::kReverseKl) {
        r_s = rel_s;
        r_t = 0;
      } else {
        r_s = -mix(-rel_s, ms);
        r_t = -mix(rel_t, mt);
      }
    };
    // 3. c = sum_{j != a} P_j r_j of each divergence's P, and sum_j P_j, in double
    // (math.h kl_center: the gradient's row then sums to 0 but for its entries' roundings)
    double cs = 0, ct = 0, ns = 0, nt = 0;
#pragma unroll 4
    for (int64_t j = j0; j < v; j += kThreads) {
      const T us = zs[j] / temp, ut = zt[j] / temp;
      T r_s, r_t;
      ratios(us, ut, r_s, r_t);
      if constexpr (kDiv != DistillDiv::kForwardKl) {
        const T ps = exp_t(dominant_log_p(us, us_a, ls));
        cs += j == a_s ? 0.0 : static_cast<double>(ps) * r_s;
        ns += ps;
      }
      if constexpr (kDiv != DistillDiv::kReverseKl) {
        const T pt = exp_t(dominant_log_p(ut, ut_a, lt));
        ct += j == a_t ? 0.0 : static_cast<double>(pt) * r_t;
        nt += pt;
      }
    }
    KlCenter<T> c_s{}, c_t{};
    if constexpr (kDiv != DistillDiv::kForwardKl) {
      c_s = kl_center<T>(block_sum(cs, sh.c[0]), block_sum(ns, sh.c[1]));
    }
    // (block_sum's barrier: every thread has read its single elements before pass 4 writes)
    if constexpr (kDiv != DistillDiv::kReverseKl) {
      c_t = kl_center<T>(block_sum(ct, sh.c[2]), block_sum(nt, sh.c[3]));
    }
    const T soft = distill_soft<kDiv>(rho_as, rho_at, c_s, c_t, logit_beta, beta, omb);
    T row_loss = sw * soft;
    if (hard != Hard::kNone) row_loss = row_loss - hw * log_pt;
    if (threadIdx.x == 0) loss[row] = row_loss;
    if (p.grad_s || p.grad_t) {
      // 4. the gradients. P_S - P_T at a shared dominant class: e_T - e_S (1 - e rounds to 1
      // there).
      const int64_t shared_a = a_s == a_t ? a_s : -1;
      const T diff_a = P.d.e - S.d.e;
      const bool t_dominant = t == H.a;
#pragma unroll 4
      for (int64_t j = j0; j < v; j += kThreads) {
        const T z_s = zs[j];
        const T us = z_s / temp, ut = zt[j] / temp;
        const T ps = exp_t(dominant_log_p(us, us_a, ls));
        const T pt = exp_t(dominant_log_p(ut, ut_a, lt));
        const T diff = j == shared_a ? diff_a : ps - pt;
        T r_s, r_t;
        ratios(us, ut, r_s, r_t);
        T gs, gt;
        distill_grads<kDiv>(ps, pt, diff, r_s, r_t, c_s, c_t, beta, omb, gs, gt);
        gs = gs * k;
        gt = gt * k;
        if (hard == Hard::kSame) {
          gs = gs + hw * hard_grad(ps, j == t, t_dominant, H.d.e);
        } else if (hard == Hard::kOwn) {
          gs = gs + hw * hard_grad(exp_t(dominant_log_p(z_s, H.u_a, H.d.l)), j == t, t_dominant,
                                   H.d.e);
        }
        if (p.grad_s) zs[j] = gs;
        if (p.grad_t) zt[j] = gt;
      }
    }
    __syncthreads();  // the slots are reused by the next row
  }
}

template <typename T>
cudaError_t launch_typed(const DistillRowsParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.n < 0x7fffffff ? p.n : 0x7fffffff));
  switch (p.div) {
    case DistillDiv::kForwardKl:
      launch_kernel<distill_rows_kernel<T, DistillDiv::kForwardKl>>(
          grid, dim3(kThreads), sizeof(Slots<T>), stream, p);
      break;
    case DistillDiv::kReverseKl:
      launch_kernel<distill_rows_kernel<T, DistillDiv::kReverseKl>>(
          grid, dim3(kThreads), sizeof(Slots<T>), stream, p);
      break;
    case DistillDiv::kJsd:
      launch_kernel<distill_rows_kernel<T, DistillDiv::kJsd>>(grid, dim3(kThreads),
                                                             sizeof(Slots<T>), stream, p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_distill_rows(const DistillRowsParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.v < 1 || p.z_s == nullptr || p.z_t == nullptr || p.loss == nullptr ||
      p.valid == nullptr || (p.hard_weight != 0.0 && p.target == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return p.fp64 ? launch_typed<double>(p, stream) : launch_typed<float>(p, stream);
}

}  // namespace cuda
}  // namespace flce
