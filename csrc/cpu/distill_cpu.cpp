// flce::distill_rows_ on the CPU backend: the row math of flce.linear_distillation's chunk loop
// (python/flce/distill.py, whose _rows is the same math in torch ops and this op's oracle in the
// tests). Per row: each distribution's dominant class (a max pass and a sum pass), then one pass
// that forms the divergence's per-column log ratios and their weighted sum c (in double, with
// the probabilities' sum: kl_center), then one pass that
// writes the gradients over the logits. The formulas are flce/math.h's (dominant, mix, kl_grad,
// hard_grad); rows are split over the workers (cpu/workers.h), each with four rows of scratch
// (the log ratios, and the probabilities the gradient pass reads back instead of computing them
// again), so the chunk's [rows, V] buffers are the only large memory. The passes are compiled
// apart for temperature 1, whose logits are used as they are (no division per column).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "cpu/workers.h"
#include "flce_ops.h"
#include "flce/math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLCE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define FLCE_INLINE inline __attribute__((always_inline))
#define FLCE_FLATTEN __attribute__((flatten))
#else
#define FLCE_FLATTEN
#define FLCE_CLONES
#define FLCE_INLINE inline
#endif

namespace flce::cpu {
namespace {

using Div = Divergence;

// The op's scalars in the computation dtype, rounded once as the torch ops of _rows round them.
template <typename T>
struct Cfg {
  Div div;
  T temp;         // the logits are divided by it (1: exactly the logits)
  T beta, omb;    // beta, 1 - beta
  T logit_beta;   // log(beta / (1 - beta))
  T hw, sw, k;    // hard_weight, soft_weight, soft_weight / temperature
  bool tempered, grad_s, grad_t;
};

// A row's distribution over u = z / temp: its dominant class a (the first largest logit; the
// first NaN where there is one, as torch.argmax), u_a and the Dominant statistics.
template <typename T>
struct Side {
  int64_t a;
  T u_a;
  Dominant<T> d;
};

template <typename T>
FLCE_INLINE Side<T> side(const T* z, int64_t n, T temp) {
  T m = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t j = 0; j < n; ++j) {
    const T u = z[j] / temp;
    m = u > m ? u : m;
    nan |= u != u;
  }
  int64_t a = 0;
  for (int64_t j = 0; j < n; ++j) {
    const T u = z[j] / temp;
    if (nan ? u != u : u == m) {
      a = j;
      break;
    }
  }
  const T u_a = z[a] / temp;
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    const T e = exp_t(z[j] / temp - u_a);
    s += j == a ? T(0) : e;
  }
  return Side<T>{a, u_a, dominant(s)};
}

// The hard term's distribution in the gradient pass: none (hard_weight 0), the tempered
// student's (temperature 1), or the un-tempered student's own.
enum class Hard { none, tempered, own };

// A row's constants for its gradient pass.
template <typename T>
struct Grads {
  T temp, us_a, ut_a, ls, lt;
  int64_t as, shared_a;  // the student's dominant class; that class where the teacher's too, or -1
  T diff_a;              // e_T - e_S
  KlCenter<T> cs, ct;    // the KL gradients' c (kl_center)
  T k, beta, omb, hw;
  int64_t t;
  bool t_dominant;  // the target is the hard distribution's dominant class
  T uh_a, lh, eh;   // the hard distribution's dominant logit, log1p(s) and e
};

// The gradient pass: os[j] / ot[j] <- the loss's gradient in zs[j] / zt[j] (each element read
// before it is written; os may be zs or rs, ot zt or rt).
template <typename T, Div div, bool kTempered, Hard hard>
FLCE_INLINE void grads(const T* zs, const T* zt, int64_t n, const Grads<T>& g, const T* rs,
                       const T* rt, const T* ps_row, const T* pt_row, T* os, T* ot) {
  // (temperature 1: z / 1 folds to z)
  const T temp = kTempered ? g.temp : T(1);
  const T us_a = g.us_a, ut_a = g.ut_a, ls = g.ls, lt = g.lt;
  const int64_t shared_a = g.shared_a, t = g.t;
  const KlCenter<T> cs = g.cs, ct = g.ct;
  const T diff_a = g.diff_a, k = g.k, beta = g.beta, omb = g.omb;
  const T hw = g.hw, uh_a = g.uh_a, lh = g.lh, eh = g.eh;
  const bool t_dominant = g.t_dominant;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const T z_s = zs[j];
    const T us = z_s / temp, ut = zt[j] / temp;
    // (the probabilities the divergence's c pass formed, read back; the others formed here)
    const T ps = div != Div::kForwardKl ? ps_row[j] : exp_t(dominant_log_p(us, us_a, ls));
    const T pt = div != Div::kReverseKl ? pt_row[j] : exp_t(dominant_log_p(ut, ut_a, lt));
    const T diff = j == shared_a ? diff_a : ps - pt;
    // (the scratch row a divergence does not fill is not read)
    const T r_s = div == Div::kForwardKl ? T(0) : rs[j];
    const T r_t = div == Div::kReverseKl ? T(0) : rt[j];
    T gs, gt;
    distill_grads<div>(ps, pt, diff, r_s, r_t, cs, ct, beta, omb, gs, gt);
    gs = gs * k;
    gt = gt * k;
    if constexpr (hard == Hard::tempered) {
      gs = gs + hw * hard_grad(ps, j == t, t_dominant, eh);
    } else if constexpr (hard == Hard::own) {
      gs = gs + hw * hard_grad(exp_t(dominant_log_p(z_s, uh_a, lh)), j == t, t_dominant, eh);
    }
    os[j] = gs;
    ot[j] = gt;
  }
}

// One row: the loss, and the gradients written over zs / zt where wanted. rs, rt, ps_row,
// pt_row: [n] scratch. (The divergence and whether there is a temperature are template
// arguments: each loop then holds its own formulas alone.)
template <typename T, Div div, bool kTempered>
FLCE_INLINE T row(T* zs, T* zt, int64_t n, int64_t t, const Cfg<T>& c, T* rs, T* rt, T* ps_row,
                  T* pt_row) {
  const T temp = kTempered ? c.temp : T(1);
  const Side<T> S = side(zs, n, temp), P = side(zt, n, temp);
  const int64_t as = S.a, at = P.a;
  const T us_a = S.u_a, ut_a = P.u_a, ls = S.d.l, lt = P.d.l;
  // the other model's logit at each dominant class, and rho = log(S / T) there
  const T ut_as = zt[as] / temp, us_at = zs[at] / temp;
  const T rho_as = dominant_log_p(us_a, us_a, ls) - dominant_log_p(ut_as, ut_a, lt);
  const T rho_at = dominant_log_p(us_at, us_a, ls) - dominant_log_p(ut_a, ut_a, lt);
  // JSD: relative to the dominant class, mix(x_j) - mix(x_a) = mix(x_j - x_a) with
  // logit(w') = x_a + logit(w) (docs/numerics.md, "Distillation").
  const T xs_a = -rho_as, xt_a = rho_at;
  const MixRow<T> ms = mix_row<T>(xs_a + c.logit_beta), mt = mix_row<T>(xt_a - c.logit_beta);
  // c's sums and the probabilities' (kl_center), in double
  double cs = 0, ct = 0, ns = 0, nt = 0;
#pragma omp simd reduction(+ : cs, ct, ns, nt)
  for (int64_t j = 0; j < n; ++j) {
    const T us = zs[j] / temp, ut = zt[j] / temp;
    const T rel_s = (us - us_a) - (ut - ut_as);
    const T rel_t = (us - us_at) - (ut - ut_a);
    T r_s = 0, r_t = 0;
    if constexpr (div == Div::kForwardKl) {
      r_t = -rel_t;
    } else if constexpr (div == Div::kReverseKl) {
      r_s = rel_s;
    } else {
      r_s = -mix(-rel_s, ms);
      r_t = -mix(rel_t, mt);
    }
    if constexpr (div != Div::kForwardKl) {
      const T ps = exp_t(dominant_log_p(us, us_a, ls));
      cs += j == as ? 0.0 : static_cast<double>(ps) * r_s;
      ns += ps;
      rs[j] = r_s;
      ps_row[j] = ps;
    }
    if constexpr (div != Div::kReverseKl) {
      const T pt = exp_t(dominant_log_p(ut, ut_a, lt));
      ct += j == at ? 0.0 : static_cast<double>(pt) * r_t;
      nt += pt;
      rt[j] = r_t;
      pt_row[j] = pt;
    }
  }
  const KlCenter<T> c_s = kl_center<T>(cs, ns), c_t = kl_center<T>(ct, nt);
  const T soft = distill_soft<div>(rho_as, rho_at, c_s, c_t, c.logit_beta, c.beta, c.omb);
  T loss = c.sw * soft;
  // The hard term: the un-tempered student's distribution (the tempered one at temperature 1).
  const bool hard = c.hw != T(0);
  const Side<T> H = hard && kTempered ? side(zs, n, T(1)) : S;
  // (H's logits are zs itself: at temperature 1, zs / 1 is exactly zs)
  if (hard) loss = loss - c.hw * dominant_log_p(zs[t], H.u_a, H.d.l);
  if (!c.grad_s && !c.grad_t) return loss;
  // P_S - P_T at a shared dominant class: e_T - e_S (1 - e rounds to 1 there).
  const Grads<T> g{temp,  us_a,   ut_a,  ls, lt,      as, as == at ? as : -1, P.d.e - S.d.e,
                   c_s,   c_t,    c.k,   c.beta,      c.omb,  c.hw, t,  t == H.a,
                   H.u_a, H.d.l,  H.d.e};
  // (a gradient that is not wanted goes to the scratch row, read at j before it is written)
  T* os = c.grad_s ? zs : rs;
  T* ot = c.grad_t ? zt : rt;
  if (!hard) {
    grads<T, div, kTempered, Hard::none>(zs, zt, n, g, rs, rt, ps_row, pt_row, os, ot);
  } else if (!kTempered) {
    grads<T, div, kTempered, Hard::tempered>(zs, zt, n, g, rs, rt, ps_row, pt_row, os, ot);
  } else {
    grads<T, div, kTempered, Hard::own>(zs, zt, n, g, rs, rt, ps_row, pt_row, os, ot);
  }
  return loss;
}

template <typename T, bool kTempered>
FLCE_INLINE T any_row(T* zs, T* zt, int64_t n, int64_t t, const Cfg<T>& c, T* scratch) {
  T* rs = scratch;
  T* rt = scratch + n;
  T* ps = scratch + 2 * n;
  T* pt = scratch + 3 * n;
  switch (c.div) {
    case Div::kForwardKl:
      return row<T, Div::kForwardKl, kTempered>(zs, zt, n, t, c, rs, rt, ps, pt);
    case Div::kReverseKl:
      return row<T, Div::kReverseKl, kTempered>(zs, zt, n, t, c, rs, rt, ps, pt);
    default:
      return row<T, Div::kJsd, kTempered>(zs, zt, n, t, c, rs, rt, ps, pt);
  }
}

// Rows r0..r1 of the chunk; scratch: [4 n].
template <typename T>
FLCE_INLINE void rows(T* zs, T* zt, T* loss, const int64_t* target, const bool* valid,
                      int64_t r0, int64_t r1, int64_t n, const Cfg<T>& c, T* scratch) {
  for (int64_t r = r0; r < r1; ++r) {
    T* s = zs + r * n;
    T* t = zt + r * n;
    if (!valid[r]) {
      // an ignored row: no loss and no gradient, whatever its logits
      loss[r] = 0;
      if (c.grad_s) std::fill(s, s + n, T(0));
      if (c.grad_t) std::fill(t, t + n, T(0));
      continue;
    }
    loss[r] = c.tempered ? any_row<T, true>(s, t, n, target[r], c, scratch)
                         : any_row<T, false>(s, t, n, target[r], c, scratch);
  }
}

// The fp32 rows compiled per instruction set (as epilogue.cpp's loops), fp64 once. flatten:
// every call inlined, math.h's included, which GCC's growth limits would otherwise leave as
// calls in the vector loops (scalar loops then, 10x slower).
FLCE_CLONES FLCE_FLATTEN void rows_f32(float* zs, float* zt, float* loss, const int64_t* target,
                          const bool* valid, int64_t r0, int64_t r1, int64_t n,
                          const Cfg<float>& c, float* scratch) {
  rows(zs, zt, loss, target, valid, r0, r1, n, c, scratch);
}

void rows_any(float* zs, float* zt, float* loss, const int64_t* target, const bool* valid,
              int64_t r0, int64_t r1, int64_t n, const Cfg<float>& c, float* scratch) {
  rows_f32(zs, zt, loss, target, valid, r0, r1, n, c, scratch);
}

void rows_any(double* zs, double* zt, double* loss, const int64_t* target, const bool* valid,
              int64_t r0, int64_t r1, int64_t n, const Cfg<double>& c, double* scratch) {
  rows(zs, zt, loss, target, valid, r0, r1, n, c, scratch);
}

template <typename T>
void run(at::Tensor& z_s, at::Tensor& z_t, at::Tensor& loss, const at::Tensor& target,
         const at::Tensor& valid, const Cfg<T>& c) {
  const int64_t rows_n = z_s.size(0), n = z_s.size(1);
  T* zs = z_s.data_ptr<T>();
  T* zt = z_t.data_ptr<T>();
  T* lp = loss.data_ptr<T>();
  const int64_t* tp = target.data_ptr<int64_t>();
  const bool* vp = valid.data_ptr<bool>();
  const int64_t workers = num_workers(rows_n);
  run_workers(workers, [&](int64_t w) {
    const Span sp = split(rows_n, workers, w, 1);
    if (sp.size() == 0) return;
    std::vector<T> scratch(4 * static_cast<size_t>(n));
    rows_any(zs, zt, lp, tp, vp, sp.begin, sp.end, n, c, scratch.data());
  });
}

void distill_rows_cpu(at::Tensor& z_s, at::Tensor& z_t, at::Tensor& loss,
                      const at::Tensor& target, const at::Tensor& valid,
                      c10::string_view divergence, double beta, double temperature,
                      double hard_weight, double soft_weight, bool grad_s, bool grad_t) {
  const Div div = static_cast<Div>(
      check_distill_rows_args(z_s, z_t, loss, target, valid, divergence, beta, temperature));
  const int64_t n = z_s.size(1);
  if (hard_weight != 0.0) {
    const at::Tensor t = target.masked_select(valid);
    TORCH_CHECK(t.numel() == 0 || (t.min().item<int64_t>() >= 0 && t.max().item<int64_t>() < n),
                "flce::distill_rows_: a target of a valid row is outside [0, ", n, ")");
  }
  const double logit_beta = div == Div::kJsd ? std::log(beta / (1.0 - beta)) : 0.0;
  auto go = [&](auto zero) {
    using T = decltype(zero);
    const Cfg<T> c{div,
                   static_cast<T>(temperature),
                   static_cast<T>(beta),
                   static_cast<T>(1.0 - beta),
                   static_cast<T>(logit_beta),
                   static_cast<T>(hard_weight),
                   static_cast<T>(soft_weight),
                   static_cast<T>(soft_weight / temperature),
                   temperature != 1.0,
                   grad_s,
                   grad_t};
    run<T>(z_s, z_t, loss, target, valid, c);
  };
  if (z_s.scalar_type() == at::kFloat) {
    go(0.f);
  } else {
    go(0.0);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(flce, CPU, m) { m.impl("distill_rows_", &distill_rows_cpu); }

}  // namespace flce::cpu
