// flce/math.h: the numerics of flce, once, for every backend.
//
// Torch-free and header-only: the CPU backend (csrc/cpu), the CUDA kernels (csrc/cuda) and the
// host unit tests (tests/cpp) include this file and nothing else defines these formulas.
// See shared NUMERICS.md / docs/numerics.md for the derivations.
//
// Do not compile users of this header with -ffast-math / --use_fast_math: Kahan compensation
// and the NaN-propagating comparisons below rely on IEEE semantics.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FLCE_HD __host__ __device__ __forceinline__
#define FLCE_HD_ALWAYS __host__ __device__ __forceinline__
#else
#define FLCE_HD inline
// Inlined even into a large vectorized loop (GCC's growth limits otherwise leave a call there,
// which makes the loop scalar): the per-element functions of the distillation row math.
#if defined(__GNUC__)
#define FLCE_HD_ALWAYS inline __attribute__((always_inline))
#else
#define FLCE_HD_ALWAYS inline
#endif
#endif

namespace flce {

FLCE_HD float neg_inf() { return -INFINITY; }

namespace detail {
// vexp's and vexpm1's reduction of a finite or NaN x (clamped by the caller): x = k ln2 + r
// (Cody-Waite, k = round(x / ln2); k = 0 for NaN, so that the callers' float -> int conversion
// of k stays defined) and e^r - 1 from Cephes' degree-6 polynomial, p r^2 + r.
FLCE_HD_ALWAYS float exp_reduced(float xc, float& k) {
  k = floorf(xc * 1.44269504088896341f + 0.5f);
  k = k == k ? k : 0.f;
  float r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r;
}

// y 2^k, k in [-150, 127], as 2^k1 2^k2 with both halves normal: the second product rounds once
// into the subnormal range.
FLCE_HD_ALWAYS float exp_scale(float y, int32_t k) {
  const int32_t k1 = k / 2, k2 = k - k / 2;
  const uint32_t b1 = static_cast<uint32_t>(k1 + 127) << 23;
  const uint32_t b2 = static_cast<uint32_t>(k2 + 127) << 23;
  float s1, s2;
  __builtin_memcpy(&s1, &b1, sizeof(s1));
  __builtin_memcpy(&s2, &b2, sizeof(s2));
  return (y * s1) * s2;
}
}  // namespace detail

// exp(x) in fp32 for the CPU backend's epilogue loops, written so that compilers vectorize it
// (std::exp is a library call they cannot). Cody-Waite reduction x = k ln2 + r and Cephes'
// degree-6 polynomial: within 2 ulp of expf for x in [-87.3, 88], subnormal results down to
// x = -103.9 (2^k applied in two halves), 0 below. Above 88 it returns +inf (the epilogue only
// evaluates x = z - max <= 0). NaN in, NaN out. On the GPU it is expf.
FLCE_HD float vexp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  const float xc = x < -104.f ? -104.f : (x > 88.f ? 88.f : x);  // NaN stays NaN
  float k;
  const float y = detail::exp_reduced(xc, k) + 1.f;
  const float e = detail::exp_scale(y, static_cast<int32_t>(k));
  return x < -104.f ? 0.f : (x > 88.f ? INFINITY : e);
#endif
}

// expm1(x) in fp32, vectorizable as vexp (the same reduction x = k ln2 + r and polynomial, whose
// p r^2 + r is e^r - 1 to a few ulp): expm1(x) = 2^k (e^r - 1) + (2^k - 1), exact-signed near 0
// (k = 0: e^r - 1 itself) and without cancellation elsewhere (|2^k - 1| >= 1/2 there). -1 below
// -80, +inf above 88, NaN in NaN out. On the GPU it is expm1f.
FLCE_HD_ALWAYS float vexpm1(float x) {
#if defined(__CUDA_ARCH__)
  return expm1f(x);
#else
  const float xc = x < -80.f ? -80.f : (x > 88.f ? 88.f : x);  // NaN stays NaN
  float k;
  const float em1 = detail::exp_reduced(xc, k);
  const uint32_t b = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;
  float s;
  __builtin_memcpy(&s, &b, sizeof(s));
  const float e = s * em1 + (s - 1.f);
  return x < -80.f ? -1.f : (x > 88.f ? INFINITY : e);
#endif
}

// m1 ? vexpm1(x) : vexp(x), each lane's value exactly the function's, from one reduction and
// polynomial (the lanes of a loop that needs exp in some and expm1 in others: mix). On the GPU
// expm1f or expf.
FLCE_HD_ALWAYS float vexp_or_expm1(float x, bool m1_arg) {
#if defined(__CUDA_ARCH__)
  return m1_arg ? expm1f(x) : expf(x);
#else
  // (the selector made a float comparison: with the bool itself GCC's vectorizer finds no vector
  // type for the calling loop, which then runs scalar, 7x slower)
  const float m1f = m1_arg ? 1.f : 0.f;
  const bool m1 = m1f != 0.f;
  const float lo = m1 ? -80.f : -104.f;
  const float xc = x < lo ? lo : (x > 88.f ? 88.f : x);  // NaN stays NaN
  float k;
  const float em1 = detail::exp_reduced(xc, k);
  const int32_t ki = static_cast<int32_t>(k);
  // expm1: 2^k (e^r - 1) + (2^k - 1), one scale (k >= -116 above -80; the exp lanes' k may be
  // below: their em is not selected, and the unsigned shift is defined for any k)
  const uint32_t b = static_cast<uint32_t>(ki + 127) << 23;
  float s;
  __builtin_memcpy(&s, &b, sizeof(s));
  const float em = s * em1 + (s - 1.f);
  const float e = detail::exp_scale(em1 + 1.f, ki);  // exp, as vexp
  return x < lo ? (m1 ? -1.f : 0.f) : (x > 88.f ? INFINITY : (m1 ? em : e));
#endif
}

// log1p(x) in fp32, vectorizable: log(u) of u = 1 + x (Cephes' logf: u = 2^e m with m in
// [sqrt(1/2), sqrt(2)), log m = f - f^2/2 + f^3 P(f), f = m - 1) plus the rounding of 1 + x,
// (x - (u - 1)) / u, as a first-order correction: within 2 ulp of log1p. -inf at -1, NaN below
// -1 and for NaN, +inf at +inf. On the GPU it is log1pf.
FLCE_HD_ALWAYS float vlog1p(float x) {
#if defined(__CUDA_ARCH__)
  return log1pf(x);
#else
  const float u = 1.f + x;
  const float uc = u > 0.f && u < INFINITY ? u : 1.f;  // the bit split below for finite u > 0
  uint32_t b;
  __builtin_memcpy(&b, &uc, sizeof(b));
  int32_t e = static_cast<int32_t>((b >> 23) & 0xffu) - 126;
  const uint32_t mb = (b & 0x7fffffu) | 0x3f000000u;  // m in [1/2, 1)
  float m;
  __builtin_memcpy(&m, &mb, sizeof(m));
  const bool low = m < 0.707106781186547524f;
  e = low ? e - 1 : e;
  const float f = low ? m + m - 1.f : m - 1.f;
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  const float ef = static_cast<float>(e);
  y = f * z * y + ef * -2.12194440e-4f;
  y = y - 0.5f * z;
  const float lg = (f + y) + ef * 0.693359375f;
  const float r = lg + (x - (uc - 1.f)) / uc;
  return u == uc ? r : (u == 0.f ? -INFINITY : (u == INFINITY ? INFINITY : NAN));
#endif
}

// The transcendental functions of the templated row math in fp32 (vectorizable, the
// above) and fp64 (the library's: the fp64 path serves gradcheck, not speed).
FLCE_HD_ALWAYS float exp_t(float x) { return vexp(x); }
FLCE_HD double exp_t(double x) { return exp(x); }
FLCE_HD_ALWAYS float expm1_t(float x) { return vexpm1(x); }
FLCE_HD double expm1_t(double x) { return expm1(x); }
FLCE_HD_ALWAYS float exp_or_expm1_t(float x, bool m1) { return vexp_or_expm1(x, m1); }
FLCE_HD double exp_or_expm1_t(double x, bool m1) { return m1 ? expm1(x) : exp(x); }
FLCE_HD_ALWAYS float log1p_t(float x) { return vlog1p(x); }
FLCE_HD double log1p_t(double x) { return log1p(x); }

// ---------------------------------------------------------------------------------------------
// Online logsumexp over the non-target logits of a row, with the entropy's running sum.
//
// State (m, s, u): m is the running max, s = sum exp(z - m), u = sum exp(z - m) (m - z) >= 0
// (NUMERICS.md "Entropy without cancellation": the non-target distribution's entropy is
// log s + u / s, every term non-negative). The empty state is (-inf, 0, 0).
// NaN logits poison s and u (never silently dropped: fmaxf would ignore them).
// ---------------------------------------------------------------------------------------------
struct OnlineLse {
  float m;
  float s;
  float u = 0.f;
};

FLCE_HD OnlineLse lse_empty() { return OnlineLse{neg_inf(), 0.f, 0.f}; }

// Add one logit z.
FLCE_HD void lse_add(OnlineLse& st, float z) {
  if (z > st.m) {
    // A new max m' = z: u <- exp(m - m') (u + s (m' - m)), s <- exp(m - m') s + 1 (the new
    // term adds exp(0) to s and 0 to u). st.m may be -inf: exp(-inf) = 0 rescales an empty sum
    // to 0 (and u stays 0 rather than 0 * inf).
    const float r = expf(st.m - z);
    st.u = st.s == 0.f ? 0.f : r * (st.u + st.s * (z - st.m));
    st.s = st.s * r + 1.f;
    st.m = z;
  } else if (z != neg_inf()) {
    // z <= m, or z is NaN (then s becomes NaN). A -inf logit (a masked column) adds exp(-inf)
    // = 0; skipping it keeps -inf - -inf = NaN out of a state that is still empty.
    const float e = expf(z - st.m);
    st.s += e;
    st.u += e * (st.m - z);
  }
}

// Merge two partial states (different vocab tiles, threads or ranks). Order-independent up to
// rounding; callers that need bitwise determinism merge in a fixed order.
FLCE_HD OnlineLse lse_merge(OnlineLse a, OnlineLse b) {
  if (b.m == neg_inf() && b.s == 0.f) return a;  // b empty
  if (a.m == neg_inf() && a.s == 0.f) return b;  // a empty
  const float m = a.m > b.m ? a.m : b.m;         // a NaN -> m = b.m, but a.s*exp(NaN) -> NaN
  const float ra = expf(a.m - m), rb = expf(b.m - m);
  return OnlineLse{m, a.s * ra + b.s * rb,
                   ra * (a.u + a.s * (m - a.m)) + rb * (b.u + b.s * (m - b.m))};
}

// Merge a tile whose max, shifted sum and entropy sum were computed in two passes (max first,
// then sum exp(z - tile_max) and sum exp(z - tile_max) (tile_max - z)).
FLCE_HD void lse_add_tile(OnlineLse& st, float tile_max, float tile_sum, float tile_u) {
  st = lse_merge(st, OnlineLse{tile_max, tile_sum, tile_u});
}

// log(sum exp) of the state; -inf for the empty state.
FLCE_HD float lse_value(OnlineLse st) {
  if (st.s == 0.f) return neg_inf();
  return st.m + logf(st.s);
}

// lse_value(st) - z, as (m - z) + log s: the logsumexp itself is rounded at the logits' scale
// (|m| 2^-24), which a common offset of the row's logits (their softmax does not change) makes
// far larger than the gap's own ulp: 1.5e-5 in a loss of logits near 1e3, and log 2 for log 10 at
// 1e8. m - z is exact where m and z are within a factor of 2 (Sterbenz). As lse_value(st) - z at
// the empty state, the infinities and NaN.
FLCE_HD float lse_gap(OnlineLse st, float z) {
  if (st.s == 0.f) return neg_inf() - z;
  return (st.m - z) + logf(st.s);
}

// ---------------------------------------------------------------------------------------------
// Scalar helpers, stable at every argument.
// ---------------------------------------------------------------------------------------------

// log(1 + exp(x)); exact 0 at -inf, x at +inf, NaN in NaN out.
FLCE_HD float softplus(float x) {
  if (x > 0.f) return x + log1pf(expf(-x));
  return log1pf(expf(x));
}

// 1 / (1 + exp(-x)), without overflow for either sign.
FLCE_HD float sigmoid(float x) {
  if (x >= 0.f) return 1.f / (1.f + expf(-x));
  const float e = expf(x);
  return e / (1.f + e);
}

// log(exp(a) + exp(b)).
FLCE_HD float logaddexp(float a, float b) {
  const float mx = a > b ? a : b;
  const float mn = a > b ? b : a;
  if (mn == neg_inf()) return mx;  // also covers a = b = -inf
  return mx + log1pf(expf(mn - mx));
}

// ---------------------------------------------------------------------------------------------
// Softcap (Gemma 2): z = cap * tanh(u / cap) on the raw logit u; cap <= 0 disables it.
// ---------------------------------------------------------------------------------------------
FLCE_HD float softcap_apply(float u, float cap) { return cap > 0.f ? cap * tanhf(u / cap) : u; }

// dz/du given the capped logit z.
FLCE_HD float softcap_grad(float z, float cap) {
  if (!(cap > 0.f)) return 1.f;
  const float r = z / cap;
  return 1.f - r * r;
}

// The logit of a raw dot product u (bias included): softcap, then the sampling temperature
// (RL trainers divide the model's logits by T): z = softcap(u) / T; T = 1 is the identity.
FLCE_HD float logit_transform(float u, float cap, float temp) {
  const float c = softcap_apply(u, cap);
  return temp == 1.f ? c : c / temp;
}

// dz/du given z = logit_transform(u, cap, temp).
FLCE_HD float logit_transform_grad(float z, float cap, float temp) {
  return temp == 1.f ? softcap_grad(z, cap) : softcap_grad(z * temp, cap) / temp;
}

// ---------------------------------------------------------------------------------------------
// Per-row loss and gradient coefficients.
//
// Row statistics (fp32): x = the online state of the logits j != t (lse_x = lse_value(x)), z_t =
// target logit, sum_z = sum over all j of z_j (label smoothing only). An ignored row has no
// target: z_t = -inf, lse_x = lse.
//
//   nll   = softplus(lse_x - z_t)                         (collapse-safe lse - z_t; lse_x - z_t
//                                                          is lse_gap(x, z_t))
//   lse   = logaddexp(lse_x, z_t)
//   loss  = (1 - eps) nll + eps (lse - sum_z / V) + w lse^2
// ---------------------------------------------------------------------------------------------
struct LossOptions {
  float label_smoothing;  // eps
  float z_loss;           // w
  float softcap;          // <= 0: none
  int64_t vocab_size;     // global V (the smoothing mean)
  float temperature = 1.f;  // z = softcap(u) / temperature (logit_transform)
};

struct RowLoss {
  float loss;
  float lse;
};

FLCE_HD RowLoss row_loss(OnlineLse x, float z_t, float sum_z, bool ignored, const LossOptions& o) {
  const float lse = logaddexp(lse_value(x), z_t);
  if (ignored) return RowLoss{0.f, lse};
  // A +inf target logit: NaN, as torch's lse - z_t = inf - inf, where softplus(-inf) = 0 would
  // give a finite loss beside the NaN gradients (p_j = exp(z_j - inf) / NaN) and get past a
  // training loop's check of the loss.
  float loss = z_t == INFINITY ? NAN : softplus(lse_gap(x, z_t));
  if (o.label_smoothing != 0.f) {
    const float eps = o.label_smoothing;
    loss = (1.f - eps) * loss + eps * (lse - sum_z / static_cast<float>(o.vocab_size));
  }
  if (o.z_loss != 0.f) loss += o.z_loss * lse * lse;
  return RowLoss{loss, lse};
}

// The gradient of one row with respect to its (capped) logits, from upstream g = dL/dloss_row
// and g_lse = dL/dlse_row:
//   dz_j = A p_j - U                  (j != t)
//   dz_t = (A - B) p_t - B q_t - U    with q_t = 1 - p_t = sigmoid(lse_x - z_t), exact when fp32
//                                     would round p_t to 1 (the collapse-safe target term)
//   A = g (1 + 2 w lse) + g_lse,  B = g (1 - eps),  U = g eps / V,  p_j = exp(z_j - lse).
//
// With an upstream g_H = dL/dH_row of the row's entropy H (return_entropy), each column also gets
// dH/dz_j = -p_j (log p_j + H) times g_H: for j != t, log p_j = z_j - lse, so
//   dz_j = p_j (A - h (z_j - k)) - U     with h = g_H, k = lse - H,
// and the target's log p_t = -nll goes into dz_t. k is kept relative to RowGrad::ref, k = (lse -
// ref) - H with lse - ref = log div, and z_j - k as (z_j - ref) - k: z_j - lse itself is rounded
// at the logits' scale, which a common offset of the logits makes far larger than log p_j + H.
struct RowGrad {
  // p_j = exp(z_j - ref) / div, evaluated as exp(z_j - ref) * rdiv with rdiv = 1 / div rounded
  // once per row: a multiply per element where a division would cost the element loops (CPU
  // and GPU) several times more, for one more rounding (p_j within 2.5 ulp of exact instead of
  // 1.5; tests/cpp/test_math.cpp holds it to 3). From the row's (max, sum exp) statistics, ref
  // is the max of its logits and z_j - ref is exact for the columns that matter; from an fp32
  // lse (ref = lse, div = 1), p_j inherits lse's rounding, |lse| 2^-24, as a relative error
  // shared by the row.
  float ref;
  float a;
  float u;
  float dz_t;  // the whole target-column gradient (before softcap)
  float div = 1.f;
  float h = 0.f;  // the entropy's upstream gradient (0: no entropy term)
  float k = 0.f;  // (lse - ref) - H
  float rdiv = 1.f;  // 1 / div
};

namespace detail {
// gap = lse_x - z_t (lse_gap).
FLCE_HD RowGrad row_grad_coef(float ref, float div, float lse, float gap, bool ignored, float g,
                              float g_lse, const LossOptions& o) {
  RowGrad r;
  r.ref = ref;
  r.div = div;
  r.rdiv = 1.f / div;
  if (ignored) g = 0.f;
  const float eps = o.label_smoothing;
  r.a = g * (1.f + 2.f * o.z_loss * lse) + g_lse;
  const float b = g * (1.f - eps);
  r.u = g * eps / static_cast<float>(o.vocab_size);
  const float p_t = sigmoid(-gap);
  const float q_t = sigmoid(gap);
  // A - B formed as such, not from the rounded A: that would leave ulp(g) in dz_t of a collapsed
  // row, where dz_t ~ (2 w lse g + g_lse) and the z-loss keeps lse small.
  const float a_minus_b = g * (2.f * o.z_loss * lse + eps) + g_lse;
  r.dz_t = a_minus_b * p_t - b * q_t - r.u;
  return r;
}
}  // namespace detail

// From a row's lse_x and z_t alone (p_j = exp(z_j - lse), the lse form of RowGrad::ref).
FLCE_HD RowGrad row_grad(float lse_x, float z_t, bool ignored, float g, float g_lse,
                         const LossOptions& o) {
  const float lse = logaddexp(lse_x, z_t);
  return detail::row_grad_coef(lse, 1.f, lse, lse_x - z_t, ignored, g, g_lse, o);
}

// The entropy H = -sum_j p_j log p_j of the row's softmax, from the non-target state (m_x, s_x,
// u_x) and z_t, in NUMERICS.md's cancellation-free form: with lse_x = lse_value(x),
//   H = p_t nll + q (softplus(z_t - lse_x) + H_x),   H_x = log s_x + u_x / s_x,
// p_t = sigmoid(z_t - lse_x), q = 1 - p_t = sigmoid(lse_x - z_t), nll = softplus(lse_x - z_t):
// every term >= 0, so H keeps its relative accuracy near collapse (H ~ (1 + m) e^-m (V - 1) at
// margin m). 0 for an ignored row.
FLCE_HD float row_entropy(OnlineLse x, float z_t, bool ignored) {
  if (ignored) return 0.f;
  const float gap = lse_gap(x, z_t);
  const float nll = softplus(gap);
  const float p_t = sigmoid(-gap);
  // (p_t nll -> 0 as p_t -> 0, a -inf target logit, where the product is 0 * inf)
  const float t_term = p_t == 0.f ? 0.f : p_t * nll;
  if (x.s == 0.f) return t_term;  // only the target (V = 1): H = 0
  const float q = sigmoid(gap);
  const float h_x = logf(x.s) + x.u / x.s;
  return t_term + q * (softplus(-gap) + h_x);
}

namespace detail {
// The row's reference and divisor for p_j = exp(z_j - ref) / div from the online state (m_x, s_x)
// of the non-target logits and z_t: ref = M = max(m_x, z_t), div = s_x exp(m_x - M) +
// exp(z_t - M); the lse form (ref = lse, div = 1) where the row has only the target, nothing,
// or NaN (exact enough, and it keeps NaN).
FLCE_HD void row_ref(OnlineLse x, float z_t, float lse, float& ref, float& div) {
  const float m = x.m > z_t ? x.m : z_t;
  if (!(x.s > 0.f) || m == neg_inf() || !(m == m)) {
    ref = lse;
    div = 1.f;
  } else {
    ref = m;
    div = x.s * expf(x.m - m) + expf(z_t - m);
  }
}

// The entropy's terms of a row's gradient (upstream g_ent), pivoted on column t.
FLCE_HD void row_grad_entropy(RowGrad& r, OnlineLse x, float z_t, float gap, float g_ent) {
  const float ent = row_entropy(x, z_t, false);
  r.h = g_ent;
  r.k = logf(r.div) - ent;  // lse - ref = log div (row_ref); the lse form: div = 1
  // dH/dz_t = -p_t (log p_t + H) with log p_t = -nll; 0 where p_t = 0 (a -inf target logit).
  const float p_t = sigmoid(-gap);
  if (p_t != 0.f) r.dz_t -= g_ent * p_t * (ent - softplus(gap));
}
}  // namespace detail

// From the online state (m_x, s_x, u_x) of the non-target logits and z_t, where a pass still has
// them (the fused CPU forward+backward): p_j = exp(z_j - M) / S with M = max(m_x, z_t). g_ent:
// the upstream gradient of the row's entropy.
FLCE_HD RowGrad row_grad(OnlineLse x, float z_t, bool ignored, float g, float g_lse,
                         const LossOptions& o, float g_ent = 0.f) {
  const float lse = logaddexp(lse_value(x), z_t);
  const float gap = lse_gap(x, z_t);
  float ref, div;
  detail::row_ref(x, z_t, lse, ref, div);
  RowGrad r = detail::row_grad_coef(ref, div, lse, gap, ignored, g, g_lse, o);
  if (g_ent != 0.f && !ignored) detail::row_grad_entropy(r, x, z_t, gap, g_ent);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Target distributions: probability (soft) targets, and class targets with per-class weights
// and label smoothing. A row's target weights y_c (torch's semantics: y_c = w_c ((1 - eps) q_c
// + eps / V), q the probabilities or the one-hot class, w the class weights or 1) give
//   loss = sum_c y_c (lse - z_c) + z_loss lse^2 zw       (zw: the z-loss's row weight)
// Every term is taken from the row's pivot, its largest logit P = z_a (docs/numerics.md
// "Target distributions"):
//   lse - z_c = (lse - P) + (P - z_c),   lse - P = softplus(lse_x - P) = nll_a,
//   loss = Y nll_a + G + z_loss lse^2 zw,   Y = sum_c y_c,   G = sum_{c != a} y_c (P - z_c),
// lse_x the logsumexp of the logits other than the pivot: nll_a is class a's collapse-safe loss,
// and every term of G is >= 0 (for y >= 0), so the loss keeps its relative accuracy where a
// target concentrated on the dominant class makes it tiny (lse - sum_c y_c z_c rounds to 0
// there). The pivot is found online: a later, larger logit takes it over, and the old pivot
// joins the others.
//
// State: the pivot's logit p, its class a (-1: empty), its target weight y_a; the other logits'
// OnlineLse x; y_rest = sum_{c != a} y_c; g = G relative to p.
// ---------------------------------------------------------------------------------------------
struct SoftRow {
  float p;
  int64_t a;
  float y_a;
  OnlineLse x;
  float y_rest;
  float g;
};

FLCE_HD SoftRow soft_empty() { return SoftRow{neg_inf(), -1, 0.f, lse_empty(), 0.f, 0.f}; }

// The state as the ops exchange it (flce/layout.h): a row of kSoftCols = 7 floats (m_x, s_x, p,
// u_x, y_a, y_rest, g) and the pivot a apart.
FLCE_HD void soft_store(const SoftRow& r, float* q) {
  q[0] = r.x.m;
  q[1] = r.x.s;
  q[2] = r.p;
  q[3] = r.x.u;
  q[4] = r.y_a;
  q[5] = r.y_rest;
  q[6] = r.g;
}

FLCE_HD SoftRow soft_load(const float* q, int64_t a) {
  return SoftRow{q[2], a, q[4], OnlineLse{q[0], q[1], q[3]}, q[5], q[6]};
}

// One term y (p - z) of G: 0 where y = 0 (a column without target weight, e.g. masked by a -inf
// bias, adds nothing rather than 0 * inf = NaN), and 0 against a -inf pivot p (then z = -inf
// too: a set of masked columns, such as a GPU thread's columns of a tile, whose weights go with
// its pivot into the gap that a finite pivot takes in soft_merge, +inf, rather than NaN).
FLCE_HD float soft_gap_term(float y, float p, float z) {
  return y == 0.f || p == neg_inf() ? 0.f : y * (p - z);
}

// Merge the states of two disjoint sets of columns. The larger pivot stays (a's on ties, so that
// a fixed merge order gives a fixed pivot); the other pivot joins its set's logits.
FLCE_HD SoftRow soft_merge(SoftRow a, SoftRow b) {
  if (b.a < 0) return a;
  if (a.a < 0) return b;
  const bool keep_a = !(b.p > a.p);
  SoftRow hi = keep_a ? a : b;
  const SoftRow lo = keep_a ? b : a;
  hi.x = lse_merge(hi.x, lo.x);
  // (a -inf pivot: every logit of its set is -inf, and adds exp(-inf) = 0)
  if (lo.p != neg_inf()) hi.x = lse_merge(hi.x, OnlineLse{lo.p, 1.f, 0.f});
  const float y_lo = lo.y_rest + lo.y_a;
  hi.y_rest += y_lo;
  hi.g += lo.g + soft_gap_term(y_lo, hi.p, lo.p);
  return hi;
}

struct SoftLoss {
  float loss;
  float lse;
};

// The row's loss from its merged state. A +inf pivot gives NaN, as a +inf target logit does
// (row_loss).
FLCE_HD SoftLoss soft_row_loss(const SoftRow& r, float zw, float z_loss) {
  const float lse = logaddexp(lse_value(r.x), r.p);
  if (r.p == INFINITY) return SoftLoss{NAN, lse};
  float loss = (r.y_a + r.y_rest) * softplus(lse_gap(r.x, r.p)) + r.g;
  if (z_loss != 0.f) loss += z_loss * lse * lse * zw;
  return SoftLoss{loss, lse};
}

// The gradient coefficients of a row with respect to its (capped) logits, from upstream g, g_lse
// and g_ent (the entropy's), with the row's state (x, p, y_a, y_rest):
//   dz_c = A p_c - g y_c                               (every column: soft_logit_grad, u = g)
//   A = g (Y + 2 z_loss zw lse) + g_lse,  Y = y_a + y_rest.
// The pivot column takes that form while p_a <= 1/2. Beyond, where fp32 rounds p_a towards 1 and
// A p_a - g y_a would lose what a pivot that is also the target has left (both terms ~ g Y), it
// takes the collapse-safe form
//   dz_a = (A - g Y) p_a - g Y q_a + g y_rest          (q_a = 1 - p_a = sigmoid(lse_x - P)),
// whose terms are then no larger than the first form's. (With p_a small, q_a ~ 1: its -g Y q_a
// + g y_rest cancels from terms of g Y to g (Y p_a - y_a), 1e-4 relative off at V = 32000 for a
// largest logit that is not the target, under class weights with label smoothing.)
// A row without target weight and z-loss weight (an ignored class target) has the loss 0 whatever
// its logits: g is taken as 0 there, as row_grad does for ignored rows (a mean over no tokens
// has g = 1/0, which would otherwise make its gradients 0 * inf = NaN).
FLCE_HD RowGrad soft_row_grad(OnlineLse x, float p, float y_a, float y_rest, float zw, float g,
                              float g_lse, float z_loss, float g_ent = 0.f) {
  const float lse = logaddexp(lse_value(x), p);
  const float gap = lse_gap(x, p);
  RowGrad r;
  detail::row_ref(x, p, lse, r.ref, r.div);
  r.rdiv = 1.f / r.div;
  const float y = y_a + y_rest;
  if (y == 0.f && zw == 0.f) g = 0.f;
  r.a = g * (y + 2.f * z_loss * zw * lse) + g_lse;
  r.u = g;
  const float b = g * y;
  if (gap >= 0.f) {  // p_a <= 1/2 (its p_a = exp(P - ref) / div as every column's)
    r.dz_t = r.a * (vexp(p - r.ref) * r.rdiv) - g * y_a;
  } else {  // (and NaN)
    const float a_minus_b = g * (2.f * z_loss * zw * lse) + g_lse;  // (row_grad_coef's)
    r.dz_t = a_minus_b * sigmoid(-gap) - b * sigmoid(gap) + g * y_rest;
  }
  if (g_ent != 0.f) detail::row_grad_entropy(r, x, p, gap, g_ent);
  return r;
}

// Gradient of a non-target logit z (capped), before the softcap chain rule, for a row without
// an entropy term (h = 0): the element loops that know it at compile time call this.
FLCE_HD float logit_grad_plain(const RowGrad& r, float z) {
  return r.a * (vexp(z - r.ref) * r.rdiv) - r.u;
}

// Gradient of a non-target logit z (capped), before the softcap chain rule.
FLCE_HD float logit_grad(const RowGrad& r, float z) {
  const float d = z - r.ref;
  const float p = vexp(d) * r.rdiv;
  // h = 0 keeps the plain form; p = 0 (z = -inf, a masked column, or an underflow) too, since
  // 0 * h (d - k) would be NaN there.
  if (r.h == 0.f || p == 0.f) return r.a * p - r.u;
  return p * (r.a - r.h * (d - r.k)) - r.u;
}

// Gradient of a non-pivot logit z (capped) with target weight y, before the softcap chain rule,
// from soft_row_grad's coefficients: logit_grad with the row's u times the column's y.
FLCE_HD float soft_logit_grad(const RowGrad& r, float z, float y) {
  const float d = z - r.ref;
  const float p = vexp(d) * r.rdiv;
  if (r.h == 0.f || p == 0.f) return r.a * p - r.u * y;
  return p * (r.a - r.h * (d - r.k)) - r.u * y;
}

// ---------------------------------------------------------------------------------------------
// Compensated summation in fp32.
//
// Kahan: y = x - c; t = s + y; c = (t - s) - y; s = t.
// Neumaier's variant (used here) also stays exact when |x| > |s|, which happens when a large
// target-column contribution lands on a small running sum.
// The compensation c collects the low-order parts that s lost; kahan_result() folds it in once,
// at the end. Branch-free so that loops over tiles vectorize.
// ---------------------------------------------------------------------------------------------
// The rounding error of t = fl(a + b): a + b = t + add_error(a, b, t) exactly (Fast2Sum with
// the larger operand first).
FLCE_HD float add_error(float a, float b, float t) {
  return fabsf(a) >= fabsf(b) ? (a - t) + b : (b - t) + a;
}

FLCE_HD void kahan_add(float& s, float& c, float x) {
  const float t = s + x;
  c += add_error(s, x, t);
  s = t;
}

// An infinite sum is the sum: its compensation is NaN there ((x - inf) + s = inf - inf), which
// would turn a masked (-inf) logit's place in the logits' sum into a NaN loss. (s - s is 0 for
// a finite s, NaN for an infinite or NaN one.)
FLCE_HD float kahan_result(float s, float c) { return s - s == 0.f ? s + c : s; }

// bfloat16 bit patterns, round to nearest even; NaN stays NaN (the rounding carry could turn
// its payload into an infinity).
FLCE_HD uint16_t bf16_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>((u >> 16) | 0x40u) : static_cast<uint16_t>(rounded);
}

FLCE_HD float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  __builtin_memcpy(&x, &u, sizeof(x));
  return x;
}

// ---------------------------------------------------------------------------------------------
// The compensated add with the compensation stored in bfloat16 (the CPU backend's large
// gradient accumulators: half the memory of an fp32 compensation).
//
// s + x = t + e exactly (TwoSum, as kahan_add); then the pair is renormalized, s + (c + e) =
// s' + c' with |c'| <= ulp(s') / 2, before c' is rounded to bf16 (8 significant bits). Each add
// therefore loses at most 2^-8 |c'| <= 2^-9 ulp(s') (plus the fp32 rounding of c + e, 2^-24 of
// that): after T adds the pair is within T * 2^-9 ulp of the exact sum in the worst case (every
// rounding at its maximum, in one direction) and ~sqrt(T / 3) * 2^-9 ulp typically, where a
// plain fp32 sum drifts by up to T/2 ulp. Without the renormalization c could grow to T ulp and
// its bf16 rounding would cost T^2 * 2^-8.
// ---------------------------------------------------------------------------------------------
FLCE_HD void kahan_add_bf16c(float& s, uint16_t& c16, float x) {
  const float t = s + x;
  const float c = bf16_value(c16) + add_error(s, x, t);
  const float s2 = t + c;
  const float c2 = add_error(t, c, s2);
  s = s2;
  c16 = bf16_bits(c2);
}


// ---------------------------------------------------------------------------------------------
// Distillation (docs/numerics.md "Distillation"): per row, each distribution P = softmax(u)
// from its dominant class a = argmax u, d_j = u_j - u_a, s = sum_{j != a} exp(d_j):
//   log P_j = d_j - log1p(s),   e = 1 - P_a = s / (1 + s).
// Templated on the computation dtype (float: the CPU backend's vector loops; double: the fp64
// path that serves gradcheck); python/flce/distill.py's _rows is the same math in torch ops.
// ---------------------------------------------------------------------------------------------
template <typename T>
struct Dominant {
  T l;  // log1p(s): log P_a = -l
  T e;  // s / (1 + s)
};

template <typename T>
FLCE_HD Dominant<T> dominant(T s) {
  return Dominant<T>{log1p_t(s), s / (T(1) + s)};
}

// log P_j from the logit u_j, the dominant logit u_a and l = log1p(s).
template <typename T>
FLCE_HD_ALWAYS T dominant_log_p(T u, T u_a, T l) {
  return (u - u_a) - l;
}

// log(1 + exp(x)) as clamp(x, 0) + log1p(exp(-|x|)) (distill.py's _softplus), and 1 / (1 +
// exp(-x)), in the row math's dtype (per-row constants: the library's exp and log1p).
template <typename T>
FLCE_HD T softplus_t(T x) {
  return (x > T(0) ? x : T(0)) + log1p(exp(-fabs(x)));
}

template <typename T>
FLCE_HD T sigmoid_t(T x) {
  if (x >= T(0)) return T(1) / (T(1) + exp(-x));
  const T e = exp(x);
  return e / (T(1) + e);
}

// mix(x, w) = log((1 - w) + w exp(x)) with w = sigmoid(y), from the row's constants of y:
// w, log(1 - w) = -softplus(y) and log(w) = -softplus(-y) (neither 1 - w nor w is formed from the
// other, so a w near 0 or 1 loses nothing).
template <typename T>
struct MixRow {
  T w;
  T log_1mw;
  T log_w;
};

template <typename T>
FLCE_HD MixRow<T> mix_row(T y) {
  return MixRow<T>{sigmoid_t(y), -softplus_t(y), -softplus_t(-y)};
}

// log1p(w expm1(x)) for |x| <= 1, where the result may be near 0 and the argument stays above
// -0.64; beyond, logaddexp(log(1 - w), log(w) + x) = hi + log1p(exp(lo - hi)). Both are a log1p
// of an exponential: one exp_or_expm1 and one log1p per lane, the branch selected lane by lane,
// so that loops over x vectorize; NaN in, NaN out.
template <typename T>
FLCE_HD_ALWAYS T mix(T x, const MixRow<T>& c) {
  const bool near = fabs(x) <= T(1);
  const T xf = near ? T(0) : x;
  const T a = c.log_1mw, b = xf + c.log_w;
  const T hi = a > b ? a : b, lo = a > b ? b : a;
  // (lo = -inf: exp(-inf) adds 0; hi = +inf: +inf; NaN stays NaN)
  const T e = exp_or_expm1_t(near ? x : (lo == -INFINITY ? lo : lo - hi), near);
  const T n = log1p_t(near ? c.w * e : e);
  return near ? n : hi + n;
}

// kl_grad's c, held as hi + lo (lo = 0 in fp64): c = sum_{j != a} p_j rrel_j / sum_j p_j
// from a row's sums over its computed probabilities p_j, each accumulated in double. The p_j =
// exp(d_j - l) sum to 1 only within a few roundings (l's own rounding scales them all), and
// with c = sum_{j != a} p_j rrel_j the gradient's row would sum to c (1 - sum_j p_j) instead of
// 0; c rounded once to fp32 would leave c's rounding there. Neither is a small error: c = KL -
// r_a is of r_a's size (order 1 where the two distributions differ at the dominant class) while
// the entries rrel_j - c = r_j - KL are of the divergence's, and the input gradient
// sum_j g_j W_j takes a row-sum error times W's mean row, where the exact sum is
// sum_j g_j (W_j - mean W) (Liger's uniform weights: the undivided c put the student's input
// gradient at 3.5x the error of exact math on the same fp32 logits,
// tests/peers/test_liger_distillation.py). So the row sums to 0 but for its entries' own
// roundings.
template <typename T>
struct KlCenter {
  T hi, lo;
};

template <typename T>
FLCE_HD KlCenter<T> kl_center(double c, double p_sum) {
  const double q = c / p_sum;
  const T hi = static_cast<T>(q);
  return KlCenter<T>{hi, static_cast<T>(q - static_cast<double>(hi))};
}

// One column's term of KL(P || R) in P's logits: P_j (r_j - KL) = P_j (rrel_j - c), where
// rrel_j = log(P_j / R_j) - log(P_a / R_a) and c (kl_center) = sum_{j != a} P_j rrel_j, KL =
// r_a + c. rrel_j - c.hi is exact where the two are within a factor 2 (Sterbenz), as they are
// where the entry is small against c.
template <typename T>
FLCE_HD_ALWAYS T kl_grad(T p, T rrel, const KlCenter<T>& c) {
  return p * ((rrel - c.hi) - c.lo);
}

// flce.linear_distillation's divergences, in the ops' order (flce::distill_rows_'s argument
// check returns it): KL(T || S), KL(S || T), and the generalized JSD beta KL(T || M) +
// (1 - beta) KL(S || M) with M = beta T + (1 - beta) S.
enum class Divergence : int { kForwardKl = 0, kReverseKl = 1, kJsd = 2 };

// One column's soft-term gradients in the student's and the teacher's tempered logits, before
// the factor soft_weight / temperature: forward KL's student P_S - P_T (`diff`: e_T - e_S at a
// shared dominant class) and teacher kl_grad(P_T); reverse KL the mirror; JSD (1 - beta)
// kl_grad(P_S) and beta kl_grad(P_T) of the mixture's log ratios r_s, r_t (a ratio the
// divergence does not use is not read).
template <Divergence kDiv, typename T>
FLCE_HD_ALWAYS void distill_grads(T ps, T pt, T diff, T r_s, T r_t, const KlCenter<T>& c_s,
                                  const KlCenter<T>& c_t, T beta, T omb, T& gs, T& gt) {
  if constexpr (kDiv == Divergence::kForwardKl) {
    gs = diff;
    gt = kl_grad(pt, r_t, c_t);
  } else if constexpr (kDiv == Divergence::kReverseKl) {
    gs = kl_grad(ps, r_s, c_s);
    gt = -diff;
  } else {
    gs = omb * kl_grad(ps, r_s, c_s);
    gt = beta * kl_grad(pt, r_t, c_t);
  }
}

// A row's soft term from its parts: each KL = r_a + c at its distribution's dominant class a
// (c from kl_center, added hi then lo), where rho = log(S / T): forward KL's r_a = -rho(a_T),
// reverse KL's rho(a_S); JSD's KL(S || M) has r_a = -mix(-rho(a_S), w = beta) and KL(T || M)
// -mix(rho(a_T), w = 1 - beta) (logit_beta = log(beta / (1 - beta)), omb = 1 - beta).
template <Divergence kDiv, typename T>
FLCE_HD T distill_soft(T rho_as, T rho_at, const KlCenter<T>& c_s, const KlCenter<T>& c_t,
                       T logit_beta, T beta, T omb) {
  if constexpr (kDiv == Divergence::kForwardKl) {
    return (-rho_at + c_t.hi) + c_t.lo;
  } else if constexpr (kDiv == Divergence::kReverseKl) {
    return (rho_as + c_s.hi) + c_s.lo;
  } else {
    const T kl_s = (-mix(-rho_as, mix_row<T>(logit_beta)) + c_s.hi) + c_s.lo;
    const T kl_t = (-mix(rho_at, mix_row<T>(-logit_beta)) + c_t.hi) + c_t.lo;
    return beta * kl_t + omb * kl_s;
  }
}

// The hard term's gradient in the student's (un-tempered) logit j of a row whose target is t:
// p_j, and p_t - 1 as -e where t is the dominant class (1 - e rounds to 1 there).
template <typename T>
FLCE_HD_ALWAYS T hard_grad(T p, bool is_target, bool target_dominant, T e) {
  return is_target ? (target_dominant ? -e : p - T(1)) : p;
}

}  // namespace flce
