// Every launcher of csrc/cuda/params.h on the host SIMT emulation, against float64.
//
// Each case builds a problem (N, V, D, dtype, options) and runs the kernels of the binding's
// row-chunk driver (csrc/cuda/chunks.cpp) on fp32 logits standing in for cuBLAS's (the exact
// products rounded once): row_stats per vocabulary shard ("rank", column splits merged) ->
// combine of the ranks -> row_coef -> row_grad (the gradient tile, over the logits in place) ->
// target_fix; and the same row kernels on a caller's 16-bit logits (flce::logits_stats /
// logits_backward), scale_grad and the small reductions. It
// compares every stored value with a float64 reference of the collapse-safe formulas (shared
// NUMERICS.md):
//   partials (m, s, z_t, sum_z, u) of every shard, merged rank partials, loss, lse, entropy,
//   stats (m_x, s_x, z_t, u_x), the target flag, coef and bound, the stored gradient tiles (hi,
//   lo), col_partials, target_resid and the target-fixed dE rows. The logits are
//   z = softcap(x . w + b) / T (sampling temperature T); upstream gradients of the loss, the lse
//   and the entropy.
// Every output and workspace starts NaN (unwritten elements fail); padding elements of the
// logits are NaN (read ones poison the result).
//
// Tolerances are bounds, per element, built from the rounding floor: a logit carries at most
// delta = 2 u sum_k |e_k w_k| (+ bias, softcap, / T) with u = 2^-24; row statistics and
// gradients inherit it through their derivatives plus a few u per operation; a stored 16-bit
// tile adds half an ulp of its dtype per entry. No tolerance is a free constant.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdarg>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "flce/math.h"
#include "harness.h"
#include "params.h"

using flce::cuda::DType;
using harness::DeviceBuffer;

namespace {

constexpr double kU = 0x1p-24;
constexpr int64_t kIgnore = -100;
const double kInf = INFINITY;
constexpr int64_t kPartials = flce::cuda::kPartialCols;
constexpr int64_t kStats = flce::cuda::kStatsCols;
static_assert(kPartials == 5 && kStats == 4,
              "the checks index partials (m, s, z_t, sum_z, u) and stats (m_x, s_x, z_t, u_x)");
constexpr int64_t kEntStride = 3;  // grad_entropy's row stride (NaN in between)

enum class Kind { kBf16, kF16, kF32 };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kBf16:
      return "bf16";
    case Kind::kF16:
      return "fp16";
    case Kind::kF32:
      return "fp32";
  }
  return "?";
}

DType dtype_of(Kind k) {
  switch (k) {
    case Kind::kBf16:
      return DType::kBFloat16;
    case Kind::kF16:
      return DType::kFloat16;
    case Kind::kF32:
      return DType::kFloat32;
  }
  return DType::kFloat32;
}

int elt_size(Kind k) { return k == Kind::kBf16 || k == Kind::kF16 ? 2 : 4; }

// Value of an element stored in the kind's dtype.
float quantize(float x, Kind k) {
  if (k == Kind::kBf16) return __bfloat162float(__float2bfloat16_rn(x));
  if (k == Kind::kF16) return __half2float(__float2half_rn(x));
  return x;
}

// The spacing of the dtype at |x| (its rounding is at most half of it).
double ulp(double x, Kind k) {
  int mant = 23, min_exp = -126;
  if (k == Kind::kBf16) mant = 7;
  if (k == Kind::kF16) mant = 10, min_exp = -14;
  const int e = x == 0 || !std::isfinite(x) ? min_exp : std::max(std::ilogb(x), min_exp);
  return std::ldexp(1.0, e - mant);
}

bool near(double got, double ref, double tol) {
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isinf(ref)) return got == ref;
  return std::isfinite(got) && std::fabs(got - ref) <= tol;
}

// A [rows, cols] operand in device storage (element (r, c) at r * row_stride + c * col_stride;
// the other elements are NaN padding) and the values the kernels see.
struct Operand {
  Kind kind;
  int64_t rows = 0, cols = 0, row_stride = 0, col_stride = 1;
  std::vector<float> value;  // [rows * cols] dense: the stored value
  std::unique_ptr<DeviceBuffer<unsigned char>> storage;

  Operand(Kind k, int64_t r, int64_t c, int64_t rs, int64_t cs, float sigma)
      : kind(k), rows(r), cols(c), row_stride(rs), col_stride(cs), value(r * c) {
    const int64_t span = r * c == 0 ? 0 : (r - 1) * rs + (c - 1) * cs + 1;
    storage = std::make_unique<DeviceBuffer<unsigned char>>(span * elt_size(k));
    for (int64_t i = 0; i < span; ++i) store(i, NAN);
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < c; ++j) {
        const float x = quantize(check::normal(sigma), k);
        value[i * c + j] = x;
        store(i * rs + j * cs, x);
      }
    }
  }
  void store(int64_t at, float x) {
    unsigned char* p = storage->data() + at * elt_size(kind);
    if (kind == Kind::kBf16) {
      const __nv_bfloat16 h = __float2bfloat16_rn(x);
      std::memcpy(p, &h, 2);
    } else if (kind == Kind::kF16) {
      const __half h = __float2half_rn(x);
      std::memcpy(p, &h, 2);
    } else {
      std::memcpy(p, &x, 4);
    }
  }
  const void* row_ptr(int64_t r) const {
    return storage->data() + r * row_stride * elt_size(kind);
  }
  float at(int64_t r, int64_t c) const { return value[r * cols + c]; }
};

struct Case {
  Kind kind;
  int64_t n, v, d;
  bool bias = false;
  float softcap = 0.f, eps = 0.f, zloss = 0.f;
  bool ignore_rows = false;   // every 7th row is ignore_index
  bool bad_targets = false;   // two rows with targets outside [0, V)
  bool grad_lse = false;
  bool grad_loss_stride0 = false;
  int ranks = 1;              // vocabulary shards
  bool master = false;        // fp32 grad_weight from 16-bit operands: hi + lo tiles
  bool transposed_w = false;  // the weight (read by target_fix) with unit row stride
  bool collapsed_row = false; // row 0 with a target margin of ~40 (p_t rounds to 1 in fp32)
  float temp = 1.f;           // sampling temperature: z = softcap(x . w + b) / temp
  bool grad_ent = false;      // an upstream gradient of the entropy (row_coef's grad_entropy)
  bool logits16 = false;      // single pass: the row kernels read 16-bit logits of the kind's
                              // dtype and write the gradient over them in that dtype (a
                              // caller's logits: flce::logits_stats / logits_backward)
};

std::string describe(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "%s N=%lld V=%lld D=%lld bias=%d cap=%g eps=%g z=%g ign=%d bad=%d glse=%d "
                "g0=%d ranks=%d master=%d wT=%d coll=%d T=%g gH=%d%s",
                kind_name(c.kind), static_cast<long long>(c.n), static_cast<long long>(c.v),
                static_cast<long long>(c.d), c.bias, c.softcap, c.eps, c.zloss, c.ignore_rows,
                c.bad_targets, c.grad_lse, c.grad_loss_stride0, c.ranks, c.master,
                c.transposed_w, c.collapsed_row, c.temp, c.grad_ent,
                c.logits16 ? " 16-bit-logits" : "");
  return buf;
}

// Reference statistics of one row over a column range [j0, j1) (split, shard or all), with
// the bound of the kernel's error.
struct RangeRef {
  double max_x = -kInf;  // max non-target logit
  double lse_x = -kInf;  // logsumexp of the non-target logits
  double zt = -kInf;     // target logit, if in range
  double sum = 0;        // sum of all logits
  double dmax = 0;       // max delta over the non-target columns
  double dzt = 0;
  double dsum = 0;       // sum of |z| u + delta over the columns
};

struct Problem {
  Case c;
  std::unique_ptr<Operand> E, W;
  std::vector<float> bias;        // [v]
  std::vector<int64_t> target;    // [n * 2] (stride 2)
  std::vector<float> grad_loss;   // [n] or [1]
  std::vector<float> grad_lse;    // [n]
  std::vector<float> grad_ent;    // [n] dL/dH of the rows' entropies
  std::vector<double> z, delta;   // [n, v] reference logits and their kernel error bounds
  std::vector<double> acc;        // [n, v] the dot products alone (no bias)
  std::vector<int64_t> shard_lo;  // [ranks + 1]

  int64_t t(int64_t i) const { return target[2 * i]; }
  bool ignored(int64_t i) const { return t(i) == kIgnore; }
  bool valid_target(int64_t i) const { return !ignored(i) && t(i) >= 0 && t(i) < c.v; }
};

void build(Problem& p) {
  const Case& c = p.c;
  const float w_sigma = c.d > 0 ? 2.5f / std::sqrt(static_cast<float>(c.d)) : 1.f;
  p.E = std::make_unique<Operand>(c.kind, c.n, c.d, c.d, 1, 1.f);
  p.W = c.transposed_w ? std::make_unique<Operand>(c.kind, c.v, c.d, 1, c.v, w_sigma)
                       : std::make_unique<Operand>(c.kind, c.v, c.d, c.d, 1, w_sigma);
  p.bias.assign(c.v, 0.f);
  if (c.bias) {
    for (float& b : p.bias) b = check::normal(1.f);
  }
  p.target.assign(2 * c.n, -1234567);  // odd entries: the stride's gap
  for (int64_t i = 0; i < c.n; ++i) {
    p.target[2 * i] = static_cast<int64_t>(check::uniform(0, static_cast<float>(c.v)));
    if (p.target[2 * i] >= c.v) p.target[2 * i] = c.v - 1;
    if (c.ignore_rows && i % 7 == 3) p.target[2 * i] = kIgnore;
  }
  if (c.bad_targets && c.n > 2) {
    p.target[2 * 1] = c.v + 5;
    p.target[2 * 2] = -7;
  }
  if (c.collapsed_row && c.n > 0 && c.bias) p.bias[p.t(0)] += 40.f * c.temp;
  p.grad_loss.resize(c.grad_loss_stride0 ? 1 : c.n);
  for (float& g : p.grad_loss) g = check::uniform(-2.f, 2.f) / std::max<float>(1, c.n);
  if (c.grad_lse) {
    p.grad_lse.resize(c.n);
    for (float& g : p.grad_lse) g = check::uniform(-1.f, 1.f) / std::max<float>(1, c.n);
  }
  if (c.grad_ent) {
    p.grad_ent.resize(c.n);
    for (float& g : p.grad_ent) g = check::uniform(-1.f, 1.f) / std::max<float>(1, c.n);
  }
  // Reference logits from the operands the tiles multiply, and their error bounds.
  p.z.assign(c.n * c.v, 0);
  p.acc.assign(c.n * c.v, 0);
  p.delta.assign(c.n * c.v, 0);
  for (int64_t i = 0; i < c.n; ++i) {
    for (int64_t j = 0; j < c.v; ++j) {
      double acc = 0, mag = 0;
      for (int64_t k = 0; k < c.d; ++k) {
        const double prod = static_cast<double>(p.E->at(i, k)) * p.W->at(j, k);
        acc += prod;
        mag += std::fabs(prod);
      }
      if (c.logits16) {  // the logit the kernels read is the stored 16-bit one: exact
        acc = quantize(static_cast<float>(acc), c.kind);
        mag = std::fabs(acc);
      }
      const double u = acc + p.bias[j];
      double zz = u, dz = 2 * kU * (mag + std::fabs(p.bias[j]));
      if (c.softcap > 0) {
        zz = c.softcap * std::tanh(u / c.softcap);
        dz += kU * std::fabs(u) + 4 * kU * std::fabs(zz);
      }
      if (c.temp != 1.f) {  // one more rounding, of the quotient
        zz /= c.temp;
        dz = dz / c.temp + kU * std::fabs(zz);
      }
      p.acc[i * c.v + j] = acc;
      p.z[i * c.v + j] = zz;
      p.delta[i * c.v + j] = dz;
    }
  }
  p.shard_lo.clear();
  for (int r = 0; r <= c.ranks; ++r) p.shard_lo.push_back(c.v * r / c.ranks);
}

RangeRef range_ref(const Problem& p, int64_t i, int64_t j0, int64_t j1) {
  RangeRef r;
  const int64_t tt = p.valid_target(i) ? p.t(i) : -1;
  for (int64_t j = j0; j < j1; ++j) {
    const double zz = p.z[i * p.c.v + j], dz = p.delta[i * p.c.v + j];
    r.sum += zz;
    r.dsum += dz + 2 * kU * std::fabs(zz);
    if (j == tt) {
      r.zt = zz;
      r.dzt = dz;
    } else {
      r.max_x = std::max(r.max_x, zz);
      r.dmax = std::max(r.dmax, dz);
    }
  }
  if (r.max_x > -kInf) {
    double s = 0;
    for (int64_t j = j0; j < j1; ++j) {
      if (j != tt) s += std::exp(p.z[i * p.c.v + j] - r.max_x);
    }
    r.lse_x = r.max_x + std::log(s);
  }
  return r;
}

// The kernel's (m, s) against the reference lse of the same columns: |m + log s - lse_x| within
// the logit bound plus the fp32 rounding of the exp, the sums and the merges.
bool lse_near(float m, float s, const RangeRef& r, int merges) {
  if (r.max_x == -kInf) return m == -INFINITY && s == 0.f;
  if (!(s > 0) || !std::isfinite(m)) return false;
  const double got = static_cast<double>(m) + std::log(static_cast<double>(s));
  const double tol = r.dmax + (24 + 4 * merges) * kU + 2 * kU * std::fabs(r.lse_x);
  return std::fabs(got - r.lse_x) <= tol && std::fabs(m - r.max_x) <= r.dmax + kU * std::fabs(r.max_x);
}

// The float64 sums s = sum e_j and u = sum e_j (m - z_j), e_j = exp(z_j - m), over the non-target
// columns of [j0, j1) at a given max m (the kernel's own for its partials: s and u are relative
// to it), and bounds of the kernel's error in them. du: the logit errors, through
// d/dz_j (e_j (m - z_j)) = e_j (m - z_j - 1). rs, ru: the fp32 rounding, relative, since all
// terms are >= 0: per merge or lse_add a few roundings of s, of u's parts (m - z, the rescale
// r (u + s (m' - m))) and of the exp; and the exp's argument z - m, with the shifts m' - m of
// the merges above it (they add up to at most m - z), 2 kU (m - z_j) relative to term j:
// weighted, 2 kU u / s for s and 2 kU w2 for u, w2 = sum e_j (m - z_j)^2 / u. s1: s without the
// term of one column at m (s - 1 when m is the max, without s - 1's cancellation).
struct StateRef {
  double s = 0, s1 = 0, u = 0, du = 0, rs = 0, ru = 0;
};

StateRef state_ref(const Problem& p, int64_t i, int64_t j0, int64_t j1, double m, int merges) {
  StateRef r;
  const int64_t tt = p.valid_target(i) ? p.t(i) : -1;
  double w2 = 0;
  bool at_m = false;
  for (int64_t j = j0; j < j1; ++j) {
    if (j == tt) continue;
    const double zz = p.z[i * p.c.v + j], e = std::exp(zz - m);
    r.s += e;
    if (zz == m && !at_m) {
      at_m = true;
    } else {
      r.s1 += e;
    }
    r.u += e * (m - zz);
    w2 += e * (m - zz) * (m - zz);
    r.du += e * std::fabs(m - zz - 1) * p.delta[i * p.c.v + j];
  }
  r.rs = (24 + 4 * merges) * kU + 2 * kU * (r.s > 0 ? r.u / r.s : 0);
  r.ru = (24 + 8 * merges) * kU + 2 * kU * (r.u > 0 ? w2 / r.u : 0);
  return r;
}

struct Bounded {
  double ref, tol;
};

// The kernel's u of the non-target columns of [j0, j1) at its m; the empty state has u = 0
// exactly.
Bounded u_ref(const Problem& p, int64_t i, int64_t j0, int64_t j1, float m, int merges) {
  if (m == -INFINITY) return Bounded{0, 0};
  const StateRef st = state_ref(p, i, j0, j1, m, merges);
  return Bounded{st.u, st.du + st.ru * st.u};
}

double sigmoid(double x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }
double softplus(double x) { return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }
double logaddexp(double a, double b) {
  const double mx = std::max(a, b), mn = std::min(a, b);
  return mn == -kInf ? mx : mx + std::log1p(std::exp(mn - mx));
}

// The row's true loss statistics and gradient coefficients (float64), with error bounds.
struct RowRef {
  RangeRef all;
  double lse = 0, loss = 0, dlse_x = 0, dloss = 0;
  double A = 0, B = 0, U = 0;  // dz_j = (A p_j - U) sc'_j, dz_t = (A - B) p_t - B q_t - U
  // The entropy H of the row's softmax (0 for an ignored row) and the bound of the kernel's
  // error in it; has_h: the row has one (not a row with an out-of-range target, which the
  // binding rejects). gH: its upstream gradient, k = lse - H: dz_j gains -gH p_j (z_j - k).
  bool has_h = false;
  double H = 0, dH = 0, gH = 0, k = 0;
  double dA = 0, dk = 0;  // bounds of the kernel's A and k
};

// H = -sum_j p_j log p_j in long double, pivoted on the row's largest logit z_M (the target's at
// a collapse): q = sum_{j != M} exp(z_j - z_M), -log p_M = log1p(q), -log p_j = (z_M - z_j) +
// log1p(q), every term of every sum >= 0 (never lse - sum_j p_j z_j, which cancels near
// collapse, nor a pivot below the max, whose z_M - z_j < 0 cancels log1p(q)). Its bound: the
// logit errors through dH/dz_j = -p_j (log p_j + H), and row_entropy's fp32 evaluation from
// (m_x, s_x, u_x, z_t): with x = lse_x - z_t and H_x = log s_x + u_x / s_x (the non-target
// entropy), H = p_t nll + q_t (softplus(-x) + H_x) has dH/dx = p_t q_t (H_x - x) and
// dH/dH_x = q_t, and its own terms add a few roundings each (all >= 0).
void entropy_ref(const Problem& p, int64_t i, int merges, RowRef& r) {
  using LD = long double;
  const int64_t v = p.c.v, t = p.t(i);
  const double* z = p.z.data() + i * v;
  const double zt = z[t];
  const int64_t top = std::max_element(z, z + v) - z;
  LD q = 0;
  for (int64_t j = 0; j < v; ++j) {
    if (j != top) q += std::exp(static_cast<LD>(z[j]) - z[top]);
  }
  const LD l1q = std::log1p(q);
  LD h = 0;
  for (int64_t j = 0; j < v; ++j) {
    const LD d = static_cast<LD>(z[top]) - z[j];  // >= 0
    h += std::exp(-d) / (1 + q) * (d + l1q);
  }
  LD dh = 0;
  for (int64_t j = 0; j < v; ++j) {
    const LD d = static_cast<LD>(z[top]) - z[j];
    dh += std::exp(-d) / (1 + q) * std::fabs(h - d - l1q) * p.delta[i * v + j];
  }
  // H_x = log s + u / s at the row's max: log s's error is rs relative to s, but never more
  // than s - 1 (plus its own rounding): the max's term is exactly 1 and every add's rounding is
  // at most its smaller operand, so the kernel's s lies in [1, 1 + (s - 1)(1 + 2 rs)]. (Where one
  // non-target logit dominates, s - 1 < kU and fp32 s keeps none of it: H_x's relative accuracy
  // is lost there, its absolute error stays below s - 1.)
  const RangeRef& a = r.all;
  if (a.max_x > -kInf) {
    const StateRef st = state_ref(p, i, 0, v, a.max_x, merges);
    const double logs = std::log1p(st.s1), hx = logs + st.u / st.s, x = a.lse_x - zt;
    const double pt = sigmoid(-x), qt = sigmoid(x);
    const double dlogs = std::min(st.rs, (1 + 2 * st.rs) * st.s1) + kU * logs;
    const double dhx = dlogs + kU * hx + st.u / st.s * (st.rs + st.ru + kU);
    const double dx = dlogs + 2 * kU * (std::fabs(a.lse_x) + std::fabs(x) + 1);
    dh += pt * qt * std::fabs(hx - x) * dx + qt * dhx + 8 * kU * static_cast<double>(h);
    // Below fp32's normal range (a nearly collapsed row: q_t and nll ~ e^x, H ~ 1e-43) the
    // roundings are absolute, half of 2^-149 each: q_t's and nll's times their factors
    // softplus(-x) + H_x and p_t, and those of the products and the sum.
    dh += 0x1p-149 * (4 + std::fabs(x) + hx);
  }
  r.has_h = true;
  r.H = static_cast<double>(h);
  r.dH = static_cast<double>(dh);
}

RowRef row_ref(const Problem& p, int64_t i, int merges) {
  const Case& c = p.c;
  RowRef r;
  r.all = range_ref(p, i, 0, c.v);
  r.lse = logaddexp(r.all.lse_x, r.all.zt);
  // No non-target column: lse_x is -inf exactly (the kernel's (m, s) = (-inf, 0)).
  r.dlse_x = r.all.lse_x == -kInf
                 ? 0.0
                 : r.all.dmax + (24 + 4 * merges) * kU + 2 * kU * std::fabs(r.all.lse_x);
  const double x = r.all.lse_x - r.all.zt, sx = sigmoid(x), st = sigmoid(-x);
  if (!p.ignored(i)) {
    r.loss = (1 - c.eps) * softplus(x);
    if (c.eps != 0) r.loss += c.eps * (r.lse - r.all.sum / c.v);
    if (c.zloss != 0) r.loss += c.zloss * r.lse * r.lse;
    const double wl = 2 * c.zloss * std::fabs(r.lse);
    r.dloss = (sx + wl * sx) * r.dlse_x + (sx + c.eps + wl) * r.all.dzt + c.eps * r.all.dsum / c.v +
              16 * kU * ((1 - c.eps) * softplus(x) + c.eps * (std::fabs(r.lse) + std::fabs(r.all.sum) / c.v) +
                         c.zloss * r.lse * r.lse);
  }
  (void)st;
  const double g = p.ignored(i) ? 0.0 : p.grad_loss[c.grad_loss_stride0 ? 0 : i];
  const double gl = c.grad_lse ? p.grad_lse[i] : 0.0;
  r.A = g * (1 + 2 * c.zloss * r.lse) + gl;
  r.B = g * (1 - c.eps);
  r.U = g * c.eps / c.v;
  // a = g (1 + 2 w lse) + g_lse in fp32: four roundings of terms that may cancel, and the error
  // of the row's lse (lse_x and z_t) through w.
  r.dA = 2 * std::fabs(g) * c.zloss * (r.dlse_x + r.all.dzt) +
         4 * kU * (std::fabs(g * (1 + 2 * c.zloss * r.lse)) + std::fabs(gl) + std::fabs(r.A));
  r.has_h = p.ignored(i);  // H = 0 exactly
  if (p.valid_target(i)) {
    entropy_ref(p, i, merges, r);
    if (c.grad_ent) r.gH = p.grad_ent[i];
    r.k = r.lse - r.H;
    // k = lse - H: the errors of lse (lse_x and z_t) and H, and two roundings.
    r.dk = r.dlse_x + r.all.dzt + r.dH + 2 * kU * (std::fabs(r.lse) + std::fabs(r.k));
  }
  return r;
}

// The true gradient of logit (i, j) (softcap and temperature chain rule included) and the bound
// of the fp32 kernel's error in it.
struct GradRef {
  double dz, tol;
};

// dloss/dz_j of the row, before the chain rule (what math.h logit_grad and RowGrad::dz_t give).
GradRef logit_grad_ref(const Problem& p, const RowRef& r, int64_t i, int64_t j) {
  const Case& c = p.c;
  const double zz = p.z[i * c.v + j], dj = p.delta[i * c.v + j];
  double g, tol;
  if (p.valid_target(i) && j == p.t(i)) {
    const double x = zz - r.all.lse_x, pt = sigmoid(x), qt = sigmoid(-x);
    g = (r.A - r.B) * pt - r.B * qt - r.U;
    tol = std::fabs(r.A) * pt * qt * (dj + r.dlse_x) + r.dA * pt +
          8 * kU * (std::fabs(r.A - r.B) * pt + std::fabs(r.B) * qt + std::fabs(r.U));
    if (r.gH != 0) {
      // dH/dz_t = -p_t (H - nll): p_t and nll = softplus(-x) through x, H through its bound.
      const double nll = softplus(-x), dx = dj + r.dlse_x;
      g -= r.gH * pt * (r.H - nll);
      tol += std::fabs(r.gH) * (pt * qt * dx * std::fabs(r.H - nll) +
                                pt * (r.dH + qt * dx + 2 * kU * nll) +
                                4 * kU * pt * (r.H + nll) + kU * std::fabs(g));
    }
  } else {
    const double pj = std::exp(zz - r.lse);
    g = r.A * pj - r.U;
    // p_j = exp(z_j - lse) inherits the errors of z_j and of the row's lse (lse_x and z_t).
    const double dp = dj + r.dlse_x + r.all.dzt + 8 * kU;
    tol = std::fabs(r.A) * pj * dp + r.dA * pj + 4 * kU * std::fabs(r.U);
    if (r.gH != 0) {
      // p_j (A - gH (z_j - k)) - U: k = lse - H carries the errors of lse and H, z_j - k and the
      // bracket (which may cancel) their roundings.
      g -= r.gH * pj * (zz - r.k);
      tol += std::fabs(r.gH) * pj *
                 (std::fabs(zz - r.k) * (dp + 2 * kU) + dj + r.dk + 2 * kU * (std::fabs(zz) + std::fabs(r.k))) +
             2 * kU * pj * std::fabs(r.A);
    }
  }
  return GradRef{g, tol};
}

GradRef grad_ref(const Problem& p, const RowRef& r, int64_t i, int64_t j) {
  const Case& c = p.c;
  const double zz = p.z[i * c.v + j], dj = p.delta[i * c.v + j];
  // dz/du = softcap'(c) / T at the capped c = z T (math.h logit_transform_grad; at T = 1 no
  // product or quotient).
  const double T = c.temp, rT = T != 1 ? kU : 0;
  double sc = 1 / T, dsc = rT * sc;
  if (c.softcap > 0) {
    const double cz = zz * T, q = cz / c.softcap;
    sc = (1 - q * q) / T;
    dsc = (2 * std::fabs(q) / c.softcap * (T * dj + rT * std::fabs(cz)) + 4 * kU) / T + rT * sc;
  }
  const GradRef g = logit_grad_ref(p, r, i, j);
  return GradRef{g.dz * sc, g.tol * sc + std::fabs(g.dz) * dsc + kU * std::fabs(g.dz * sc)};
}


// Counts the elements of one quantity that miss their bound; reports the first few.
class Tally {
 public:
  Tally(std::string what, const Case& c) : what_(std::move(what)), case_(describe(c)) {}
  ~Tally() {
    EXPECT(bad_ == 0, "%s: %ld of %ld elements out of bounds [%s]%s", what_.c_str(), bad_, n_,
           case_.c_str(), first_.c_str());
    // FLCE_TEST_RATIOS=1: how much of its bound the largest error uses (tightness of the bounds).
    static const bool show = std::getenv("FLCE_TEST_RATIOS") != nullptr;
    if (show) std::printf("    %-40s max |error| / bound = %.3f\n", what_.c_str(), max_ratio_);
  }
  // near(), recording |got - ref| / tol for the tightness report.
  bool near(double got, double ref, double tol) {
    if (std::isfinite(ref) && std::isfinite(got) && tol > 0) {
      max_ratio_ = std::max(max_ratio_, std::fabs(got - ref) / tol);
    }
    return ::near(got, ref, tol);
  }
  void check(bool ok, const char* fmt, ...) __attribute__((format(printf, 3, 4))) {
    ++n_;
    if (ok) return;
    if (bad_++ < 3) {
      char buf[256];
      va_list ap;
      va_start(ap, fmt);
      std::vsnprintf(buf, sizeof(buf), fmt, ap);
      va_end(ap);
      first_ += "\n    ";
      first_ += buf;
    }
  }

 private:
  std::string what_, case_, first_;
  long bad_ = 0, n_ = 0;
  double max_ratio_ = 0;
};

template <typename T>
double load(const void* p, int64_t i) {
  const T* q = static_cast<const T*>(p);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(q[i]);
  if constexpr (std::is_same_v<T, __half>) return __half2float(q[i]);
  if constexpr (std::is_same_v<T, float>) return q[i];
}

double tile_value(Kind k, const void* p, int64_t i) {
  if (k == Kind::kBf16) return load<__nv_bfloat16>(p, i);
  if (k == Kind::kF16) return load<__half>(p, i);
  return load<float>(p, i);
}

template <typename T>
DeviceBuffer<T> poisoned(std::size_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return DeviceBuffer<T>(n, harness::qnan());
  } else {
    return DeviceBuffer<T>(n, T{});
  }
}

cudaError_t ok_or_report(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(e));
  }
  return e;
}

// ---------------------------------------------------------------------------------------------
// combine (finalize) of `ranks` partial blocks -> loss, lse, stats, flag, checked; returns the
// rows' references.
std::vector<RowRef> combine_and_check(const Problem& p, DeviceBuffer<int64_t>& target,
                                      const float* partials, int64_t ranks, int merges,
                                      DeviceBuffer<float>& stats) {
  const Case& c = p.c;
  const int64_t n = c.n;
  DeviceBuffer<float> loss(n, harness::qnan()), lse(n, harness::qnan()),
      entropy(n, harness::qnan());
  DeviceBuffer<int> flag(1, 0);
  flce::cuda::CombineParams cp{};
  cp.partials = partials;
  cp.ranks = ranks;
  cp.n = n;
  cp.target = target.data();
  cp.target_stride = 2;
  cp.vocab_size = c.v;
  cp.ignore_index = kIgnore;
  cp.label_smoothing = c.eps;
  cp.z_loss = c.zloss;
  cp.loss = loss.data();
  cp.lse = lse.data();
  cp.entropy = entropy.data();
  cp.stats = stats.data();
  cp.error_flag = flag.data();
  EXPECT(ok_or_report(flce::cuda::launch_combine(cp, true, nullptr), "combine") == cudaSuccess,
         "combine");
  std::vector<RowRef> rows(n);
  {
    Tally t("loss, lse, stats (m_x, s_x, z_t, u_x)", c);
    for (int64_t i = 0; i < n; ++i) {
      const RowRef& rr = rows[i] = row_ref(p, i, merges);
      const double x = rr.all.lse_x - rr.all.zt;
      const double dlse = sigmoid(x) * rr.dlse_x + sigmoid(-x) * rr.all.dzt + 2 * kU * std::fabs(rr.lse);
      t.check(t.near(loss[i], p.ignored(i) ? 0.0 : rr.loss, rr.dloss), "row %lld loss %.9g vs %.9g (tol %.3g)",
              static_cast<long long>(i), loss[i], rr.loss, rr.dloss);
      t.check(t.near(lse[i], rr.lse, dlse), "row %lld lse %.9g vs %.9g", static_cast<long long>(i), lse[i], rr.lse);
      const float* st = stats.data() + i * kStats;
      t.check(lse_near(st[0], st[1], rr.all, merges), "row %lld stats (m_x, s_x)", static_cast<long long>(i));
      t.check(t.near(st[2], rr.all.zt, rr.all.dzt), "row %lld stats z_t", static_cast<long long>(i));
      const Bounded u = u_ref(p, i, 0, c.v, st[0], merges);
      t.check(t.near(st[3], u.ref, u.tol), "row %lld stats u_x %.9g vs %.9g", static_cast<long long>(i),
              st[3], u.ref);
    }
  }
  {
    Tally t("entropy", c);
    for (int64_t i = 0; i < n; ++i) {
      if (!rows[i].has_h) continue;
      t.check(t.near(entropy[i], rows[i].H, rows[i].dH), "row %lld entropy %.9g vs %.9g (tol %.3g)",
              static_cast<long long>(i), entropy[i], rows[i].H, rows[i].dH);
    }
  }
  EXPECT(flag[0] == (c.bad_targets && n > 2 ? 1 : 0), "target flag %d [%s]", flag[0], describe(c).c_str());

  return rows;
}

// The upstream gradients as the kernels read them: grad_loss [n] (or [1], read with stride 0),
// grad_lse [n], grad_entropy [n] with row stride kEntStride (NaN in between).
struct Upstream {
  DeviceBuffer<float> loss, lse, ent;
  explicit Upstream(const Problem& p)
      : loss(p.grad_loss), lse(p.grad_lse), ent(p.grad_ent.size() * kEntStride, harness::qnan()) {
    for (std::size_t i = 0; i < p.grad_ent.size(); ++i) ent[i * kEntStride] = p.grad_ent[i];
  }
};

// row_coef from the kernel's stats -> coef, bound; coef checked here, the bound by gradients().
void row_coef_and_check(const Problem& p, DeviceBuffer<int64_t>& target, Upstream& up,
                        const std::vector<RowRef>& rows, DeviceBuffer<float>& stats,
                        DeviceBuffer<float>& coef, DeviceBuffer<float>& bound) {
  const Case& c = p.c;
  const int64_t n = c.n;
  // Backward: row coefficients from the kernel's stats, read through strides (col stride 2).
  DeviceBuffer<float> stats2(n * 2 * kStats, harness::qnan());
  for (int64_t i = 0; i < kStats * n; ++i) stats2[(i / kStats) * 2 * kStats + (i % kStats) * 2] = stats[i];
  flce::cuda::RowCoefParams rp{};
  rp.n = n;
  rp.target = target.data();
  rp.target_stride = 2;
  rp.stats = stats2.data();
  rp.stats_row_stride = 2 * kStats;
  rp.stats_col_stride = 2;
  rp.grad_loss = up.loss.data();
  rp.grad_loss_stride = c.grad_loss_stride0 ? 0 : 1;
  rp.grad_lse = c.grad_lse ? up.lse.data() : nullptr;
  rp.grad_lse_stride = c.grad_lse ? 1 : 0;
  rp.grad_entropy = c.grad_ent ? up.ent.data() : nullptr;
  rp.grad_entropy_stride = c.grad_ent ? kEntStride : 0;
  rp.ignore_index = kIgnore;
  rp.label_smoothing = c.eps;
  rp.z_loss = c.zloss;
  rp.softcap = c.softcap;
  rp.temperature = c.temp;
  rp.vocab_size = c.v;
  rp.coef = coef.data();
  rp.bound = bound.data();
  EXPECT(ok_or_report(flce::cuda::launch_row_coef(rp, nullptr), "row_coef") == cudaSuccess, "row_coef");
  {
    // The kernel evaluates math.h's row_grad: the same function on the host, from the same
    // stats and upstream gradients, gives the same bits.
    Tally t("coef (math.h row_grad's bits)", c);
    const flce::LossOptions opt{c.eps, c.zloss, c.softcap, c.v};
    for (int64_t i = 0; i < n; ++i) {
      const float g = p.grad_loss[c.grad_loss_stride0 ? 0 : i];
      const float gl = c.grad_lse ? p.grad_lse[i] : 0.f;
      const float gh = c.grad_ent ? p.grad_ent[i] : 0.f;
      const float* st = stats.data() + i * kStats;
      const flce::RowGrad rg =
          flce::row_grad(flce::OnlineLse{st[0], st[1], st[3]}, st[2], p.ignored(i), g, gl, opt, gh);
      const float want[8] = {rg.ref, rg.a, rg.u, rg.dz_t, rg.div, rg.h, rg.k, rg.rdiv};
      for (int k = 0; k < 8; ++k) {
        t.check(std::memcmp(&coef[8 * i + k], &want[k], 4) == 0, "row %lld coef[%d] %g vs %g",
                static_cast<long long>(i), k, coef[8 * i + k], want[k]);
      }
    }
  }
  // Against float64: A, U, the target's dz_t (before the chain rule) and the entropy's h (the
  // upstream gradient itself, 0 for an ignored row) and k = (lse - ref) - H, relative to the
  // row's reference (coef[0], the largest logit: exact), so that z_j - k is not rounded at the
  // logits' scale (math.h RowGrad).
  Tally t("coef (a, u, dz_t, h, k) vs float64", c);
  for (int64_t i = 0; i < n; ++i) {
    const RowRef& r = rows[i];
    const float* cf = coef.data() + 8 * i;
    t.check(t.near(cf[1], r.A, r.dA), "row %lld a %.9g vs %.9g", static_cast<long long>(i), cf[1], r.A);
    t.check(t.near(cf[2], r.U, 2 * kU * std::fabs(r.U)), "row %lld u %.9g vs %.9g",
            static_cast<long long>(i), cf[2], r.U);
    if (!r.has_h) continue;  // an out-of-range target: the binding raises before any backward
    if (p.valid_target(i)) {
      const GradRef g = logit_grad_ref(p, r, i, p.t(i));
      t.check(t.near(cf[3], g.dz, g.tol), "row %lld dz_t %.9g vs %.9g", static_cast<long long>(i), cf[3], g.dz);
    }
    const float h = static_cast<float>(r.gH);
    t.check(std::memcmp(&cf[5], &h, 4) == 0, "row %lld h %g vs %g", static_cast<long long>(i), cf[5], h);
    // (lse - ref = log div carries the errors of lse_x and z_t, not lse's rounding at its scale)
    const double k = r.k - cf[0];
    const double dk =
        r.dlse_x + r.all.dzt + r.dH + 2 * kU * (std::fabs(r.lse - cf[0]) + std::fabs(k));
    t.check(r.gH != 0 ? t.near(cf[6], k, dk) : cf[6] == 0.f, "row %lld k %.9g vs %.9g",
            static_cast<long long>(i), cf[6], k);
  }
}

// The true gradients [n, v] and their fp32-kernel bounds. row_coef's bound is checked against
// them (params.h: >= max_j |dz_j| of the row, the stored dz, chain rule included), less their
// bounds: the fp16 tile's power-of-two scale comes from it (max |scale * bound| <= 2^14), so a
// bound below the gradient costs fp16 its headroom and, 4x below, overflows it.
std::vector<GradRef> gradients(const Problem& p, const std::vector<RowRef>& rows,
                               const DeviceBuffer<float>& bound) {
  const int64_t n = p.c.n, v = p.c.v;
  std::vector<GradRef> gr(n * v);
  Tally t("bound >= max_j |dz_j|", p.c);
  for (int64_t i = 0; i < n; ++i) {
    double mx = 0;
    for (int64_t j = 0; j < v; ++j) {
      const GradRef& g = gr[i * v + j] = grad_ref(p, rows[i], i, j);
      mx = std::max(mx, std::fabs(g.dz) - g.tol);
    }
    t.check(bound[i] >= mx, "row %lld bound %.9g < max_j |dz_j| %.9g", static_cast<long long>(i),
            bound[i], mx);
  }
  return gr;
}

// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// The single pass (flce_rows.cu): fp32 logits from a GEMM (here the exact products rounded once)
// -> row_stats per shard -> combine -> row_coef -> row_grad in place over the logits ->
// target_fix without compensation.
// ---------------------------------------------------------------------------------------------

template <typename T>
double grad_at(const void* logits_row0, int64_t grad_ld, int64_t i, int64_t j) {
  return load<T>(static_cast<const T*>(logits_row0) + i * grad_ld, j);
}

// A stored element of the kind's dtype (bit-exact: the value is representable).
void store_kind(void* base, int64_t i, double x, Kind k) {
  if (k == Kind::kBf16) {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(static_cast<float>(x));
  } else if (k == Kind::kF16) {
    static_cast<__half*>(base)[i] = __float2half_rn(static_cast<float>(x));
  } else {
    static_cast<float*>(base)[i] = static_cast<float>(x);
  }
}

void run_single_pass(const Case& c) {
  Problem p;
  p.c = c;
  build(p);
  const int64_t n = c.n, v = c.v, d = c.d;
  // Padded rows, the gap NaN; a multiple of 4 floats, so that an unsharded case takes the
  // kernels' 16-byte accesses and shards starting off a multiple of 4 columns the scalar ones.
  const int64_t ld = (v + 3 + 3) / 4 * 4;
  DeviceBuffer<int64_t> target(p.target);
  DeviceBuffer<float> bias(p.bias);
  Upstream up(p);
  // fp32 logits, or (logits16) the kind's 16-bit ones with the same row stride in elements,
  // in the first half of the buffer; the gaps NaN.
  DeviceBuffer<float> logits(n * ld, harness::qnan());
  const Kind in_kind = c.logits16 ? c.kind : Kind::kF32;
  const int in_size = elt_size(in_kind);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < ld; ++j) {
      store_kind(logits.data(), i * ld + j, j < v ? p.acc[i * v + j] : harness::qnan(), in_kind);
    }
  }
  auto logits_at = [&](int64_t col) {
    return static_cast<void*>(reinterpret_cast<char*>(logits.data()) + col * in_size);
  };
  // Forward: per-row statistics of each shard's columns, combined over the shards.
  DeviceBuffer<float> stacked(static_cast<std::size_t>(c.ranks) * n * kPartials, harness::qnan());
  int merges = 0;
  for (int r = 0; r < c.ranks; ++r) {
    const int64_t lo = p.shard_lo[r], vr = p.shard_lo[r + 1] - lo;
    flce::cuda::RowStatsParams sp{};
    sp.logits = logits_at(lo);
    sp.logits_dtype = dtype_of(in_kind);
    sp.splits = c.logits16 && vr > flce::cuda::kRowTileCols ? 2 : 1;
    sp.n = n;
    sp.v = vr;
    sp.ld = ld;
    sp.bias = c.bias ? bias.data() + lo : nullptr;
    sp.softcap = c.softcap;
    sp.temperature = c.temp;
    sp.target = target.data();
    sp.target_stride = 2;
    sp.col_offset = lo;
    sp.ignore_index = kIgnore;
    sp.partials = stacked.data() + r * n * kPartials;
    if (sp.splits > 1) {
      // Column splits: their partials [splits, n, 5], merged in order (launch_combine) into
      // this shard's, which the checks below read.
      DeviceBuffer<float> parts(static_cast<std::size_t>(sp.splits) * n * kPartials,
                                harness::qnan());
      float* shard = sp.partials;
      sp.partials = parts.data();
      EXPECT(ok_or_report(flce::cuda::launch_row_stats(sp, nullptr), "row_stats") == cudaSuccess,
             "row_stats [%s]", describe(c).c_str());
      flce::cuda::CombineParams mp{};
      mp.partials = parts.data();
      mp.ranks = sp.splits;
      mp.n = n;
      mp.merged = shard;
      EXPECT(flce::cuda::launch_combine(mp, false, nullptr) == cudaSuccess, "merge of splits");
    } else {
      EXPECT(ok_or_report(flce::cuda::launch_row_stats(sp, nullptr), "row_stats") == cudaSuccess,
             "row_stats [%s]", describe(c).c_str());
    }
    // lse_add per column (a rescale each time the max grows), then 5 butterfly and 8 warp merges.
    const int shard_merges = static_cast<int>(2 * ((vr + 255) / 256) + 13);
    merges = std::max(merges, shard_merges) + 1;
    Tally t("row_stats partials (m, s, z_t, sum_z, u)", c);
    for (int64_t i = 0; i < n; ++i) {
      const float* q = stacked.data() + (r * n + i) * kPartials;
      const RangeRef rr = range_ref(p, i, lo, lo + vr);
      double mag = 0;
      for (int64_t j = lo; j < lo + vr; ++j) mag += std::fabs(p.z[i * v + j]);
      t.check(lse_near(q[0], q[1], rr, shard_merges), "rank %d row %lld (m, s)", r,
              static_cast<long long>(i));
      t.check(t.near(q[2], rr.zt, rr.dzt), "rank %d row %lld z_t", r, static_cast<long long>(i));
      // Compensated per thread, a plain 5-level butterfly across the warp, compensated over warps.
      t.check(t.near(q[3], rr.sum, rr.dsum + 8 * kU * mag), "rank %d row %lld sum %.9g vs %.9g", r,
              static_cast<long long>(i), q[3], rr.sum);
      const Bounded u = u_ref(p, i, lo, lo + vr, q[0], shard_merges);
      t.check(t.near(q[4], u.ref, u.tol), "rank %d row %lld u %.9g vs %.9g", r,
              static_cast<long long>(i), q[4], u.ref);
    }
  }
  DeviceBuffer<float> stats(n * kStats, harness::qnan()), coef(n * 8, harness::qnan()),
      bound(n, harness::qnan());
  const std::vector<RowRef> rows = combine_and_check(p, target, stacked.data(), c.ranks, merges, stats);
  row_coef_and_check(p, target, up, rows, stats, coef, bound);

  // Backward: the gradient tile over the logits, in place (the binding's layout).
  const std::vector<GradRef> gr = gradients(p, rows, bound);
  const bool sixteen = elt_size(c.kind) == 2;
  const int64_t grad_ld = ld * in_size / elt_size(c.kind);
  const int rows_per_cta = c.bias ? 16 : 1;
  for (int r = 0; r < c.ranks; ++r) {
    const int64_t lo = p.shard_lo[r], vr = p.shard_lo[r + 1] - lo;
    const int64_t blocks = (n + rows_per_cta - 1) / rows_per_cta;
    DeviceBuffer<unsigned char> glo(c.master ? n * vr * elt_size(c.kind) : 0, 0xff);
    DeviceBuffer<float> resid(n, harness::qnan()), colp(c.bias ? blocks * vr : 0, harness::qnan());
    flce::cuda::RowGradParams gp{};
    gp.logits = logits_at(lo);
    gp.logits_dtype = dtype_of(in_kind);
    gp.n = n;
    gp.v = vr;
    gp.ld = ld;
    gp.bias = c.bias ? bias.data() + lo : nullptr;
    gp.softcap = c.softcap;
    gp.temperature = c.temp;
    gp.target = target.data();
    gp.target_stride = 2;
    gp.col_offset = lo;
    gp.ignore_index = kIgnore;
    gp.coef = coef.data();
    gp.grad = logits_at(lo);
    gp.grad_ld = grad_ld;
    gp.grad_lo = c.master ? glo.data() : nullptr;
    gp.grad_lo_ld = vr;
    // (the binding gives no residual for a caller's logits: the lean kernel instance)
    const bool with_resid = sixteen && !c.logits16;
    gp.target_resid = with_resid ? resid.data() : nullptr;
    gp.entropy = c.grad_ent;
    gp.col_partials = c.bias ? colp.data() : nullptr;
    gp.rows_per_cta = rows_per_cta;
    // Same-width logits may be split over columns in place (each thread rewrites what it read).
    gp.col_splits = c.logits16 && vr > flce::cuda::kRowTileCols ? 2 : 1;
    EXPECT(ok_or_report(flce::cuda::launch_row_grad(gp, dtype_of(c.kind), nullptr), "row_grad") ==
               cudaSuccess,
           "row_grad [%s]", describe(c).c_str());
    // Each shard's tile lies over its own columns' logits (16-bit rows take half the bytes).
    Tally t("row_grad tile (hi, lo, target_resid, col_partials)", c);
    const void* row0 = logits_at(lo);
    auto hi_at = [&](int64_t i, int64_t j) {
      if (c.kind == Kind::kBf16) return grad_at<__nv_bfloat16>(row0, grad_ld, i, j);
      if (c.kind == Kind::kF16) return grad_at<__half>(row0, grad_ld, i, j);
      return grad_at<float>(row0, grad_ld, i, j);
    };
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < vr; ++j) {
        const GradRef& g = gr[i * v + lo + j];
        const double h = hi_at(i, j), sd = std::fabs(g.dz) + g.tol;
        t.check(t.near(h, g.dz, g.tol + 0.5 * ulp(sd, c.kind)), "row %lld col %lld: hi %.9g vs %.9g",
                static_cast<long long>(i), static_cast<long long>(lo + j), h, g.dz);
        if (c.master) {
          const double l = tile_value(c.kind, glo.data(), i * vr + j);
          t.check(t.near(h + l, g.dz, g.tol + kU * sd + 0.5 * ulp(0.5 * ulp(sd, c.kind), c.kind)),
                  "row %lld col %lld: hi + lo", static_cast<long long>(i), static_cast<long long>(lo + j));
        }
      }
      if (!with_resid) continue;
      const bool here = p.valid_target(i) && p.t(i) >= lo && p.t(i) < lo + vr;
      if (!here) {
        t.check(resid[i] == 0.f, "row %lld: target_resid %g without the target", static_cast<long long>(i), resid[i]);
        continue;
      }
      const GradRef& g = gr[i * v + p.t(i)];
      t.check(t.near(hi_at(i, p.t(i) - lo) + resid[i], g.dz, g.tol + kU * (std::fabs(g.dz) + g.tol)),
              "row %lld: hi + target_resid", static_cast<long long>(i));
    }
    for (int64_t b = 0; b < (c.bias ? blocks : 0); ++b) {
      for (int64_t j = 0; j < vr; ++j) {
        double ref = 0, tol = 0, mag = 0;
        for (int64_t i = b * rows_per_cta; i < std::min(n, (b + 1) * rows_per_cta); ++i) {
          ref += gr[i * v + lo + j].dz;
          tol += gr[i * v + lo + j].tol;
          mag += std::fabs(gr[i * v + lo + j].dz);
        }
        tol += rows_per_cta * kU * mag;  // plain fp32 adds, row by row
        t.check(t.near(colp[b * vr + j], ref, tol), "col_partials[%lld, %lld] %.9g vs %.9g",
                static_cast<long long>(b), static_cast<long long>(lo + j), colp[b * vr + j], ref);
      }
    }
    if (!with_resid) continue;
    // target_fix without compensation: sum += resid * W[t] in fp32, once, for the shard's rows.
    std::vector<float> before(n * d);
    for (float& x : before) x = check::normal();
    DeviceBuffer<float> sum(before);
    flce::cuda::TargetFixParams fp{};
    fp.weight = p.W->row_ptr(lo);
    fp.weight_row_stride = p.W->row_stride;
    fp.weight_col_stride = p.W->col_stride;
    fp.n = n;
    fp.v = vr;
    fp.d = d;
    fp.target = target.data();
    fp.target_stride = 2;
    fp.col_offset = lo;
    fp.ignore_index = kIgnore;
    fp.target_resid = resid.data();
    fp.sum = sum.data();
    EXPECT(ok_or_report(flce::cuda::launch_target_fix(fp, dtype_of(c.kind), nullptr), "target_fix") ==
               cudaSuccess,
           "target_fix");
    Tally tf("target_fix", c);
    for (int64_t i = 0; i < n; ++i) {
      const bool here = p.valid_target(i) && p.t(i) >= lo && p.t(i) < lo + vr;
      for (int64_t k = 0; k < d; ++k) {
        const float want = here ? before[i * d + k] + resid[i] * p.W->at(p.t(i), k) : before[i * d + k];
        tf.check(std::memcmp(&sum[i * d + k], &want, 4) == 0, "row %lld [%lld]: %.9g vs %.9g",
                 static_cast<long long>(i), static_cast<long long>(k), sum[i * d + k], want);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------

Case make(Kind k, int64_t n, int64_t v, int64_t d) {
  Case c;
  c.kind = k;
  c.n = n;
  c.v = v;
  c.d = d;
  return c;
}

void run_all(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    const int before = check::failures;
    run_single_pass(c);
    std::printf("  %s %s\n", check::failures == before ? "ok  " : "FAIL", describe(c).c_str());
  }
}

// Rows longer than one 1024-column step of a CTA (V = 1300) and shorter, shards, options.
std::vector<Case> single_pass_cases(Kind k) {
  std::vector<Case> cs;
  {
    Case c = make(k, 37, 1300, 24);
    c.bias = true;
    c.ignore_rows = true;
    c.eps = 0.1f;
    c.master = k != Kind::kF32;
    c.collapsed_row = true;
    c.temp = 1.25f;
    c.grad_ent = true;  // the binding has none here, but row_grad reads the whole RowGrad
    cs.push_back(c);
  }
  {
    Case c = make(k, 20, 517, 8);
    c.softcap = 15.f;
    c.temp = 1.6f;
    c.zloss = 1e-3f;
    c.grad_lse = true;
    c.ranks = 2;
    c.bad_targets = true;
    c.grad_loss_stride0 = true;
    cs.push_back(c);
  }
  {
    Case c = make(k, 3, 1, 8);
    c.temp = 2.f;
    cs.push_back(c);
  }
  {
    // The recompute backward's upstream gradients (lse, entropy) on two shards with everything
    // else: row_coef's every coefficient reaches row_grad.
    Case c = make(k, 130, 300, 72);
    c.bias = true;
    c.ignore_rows = true;
    c.eps = 0.1f;
    c.master = k != Kind::kF32;
    c.collapsed_row = true;
    c.grad_lse = true;
    c.grad_ent = true;
    c.ranks = 2;
    c.softcap = 15.f;
    c.temp = 1.7f;
    c.zloss = 1e-3f;
    c.transposed_w = true;
    cs.push_back(c);
  }
  {
    // A softcap the logits reach (std ~2 at D = 24): |u| / cap on both sides of the row kernels'
    // switch between tanh's two forms at 1, saturation included; bias and entropy.
    Case c = make(k, 29, 700, 24);
    c.softcap = 2.f;
    c.bias = true;
    c.grad_ent = true;
    c.ranks = 2;
    cs.push_back(c);
  }
  {
    // Gemma's softcap with a collapsed row: margin cap tanh((40 T + ...) / cap) / T ~ 26 > ln V
    // + 16.6 (p_t rounds to 1 in fp32) through the exp form of tanh.
    Case c = make(k, 19, 300, 24);
    c.softcap = 30.f;
    c.temp = 0.9f;
    c.bias = true;
    c.collapsed_row = true;
    c.zloss = 1e-3f;
    cs.push_back(c);
  }
  {
    // Rows of more than two 4096-column tiles: a 16-bit tile written in place lands on the next
    // tile's logits only here (every column of a later tile that a thread has not read yet).
    Case c = make(k, 5, 9000, 8);
    cs.push_back(c);
  }
  {
    // Whole tiles with a bias (its 16-byte loads beside the logits') and a softcap, then a bias
    // and a temperature alone.
    Case c = make(k, 4, 9000, 8);
    c.bias = true;
    c.softcap = 3.f;
    c.temp = 1.3f;
    cs.push_back(c);
    c.softcap = 0.f;
    cs.push_back(c);
  }
  return cs;
}

TEST(single_pass_rows) {
  for (Kind k : {Kind::kBf16, Kind::kF16, Kind::kF32}) run_all(single_pass_cases(k));
}

// The same row kernels on a caller's 16-bit logits (flce::logits_stats / logits_backward): read
// in bf16 / fp16, the gradient written over them in that dtype, column splits in place.
TEST(logits16_rows) {
  for (Kind k : {Kind::kBf16, Kind::kF16}) {
    std::vector<Case> cs = single_pass_cases(k);
    for (Case& c : cs) {
      c.logits16 = true;
      c.master = false;
    }
    run_all(cs);
  }
}

// The row kernels' logit transform alone (flce_rows.cu xform_logit / xform_grad), element by
// element against float64 over the whole range of y = (u + b) / cap, both sides of its two
// forms' switch at |y| = 1, y -> 0 and tanh's saturation: row_stats gives each row's target
// logit z_t (one target per row, every column a target of some row), and row_grad with the
// coefficients (a, U, dz_t, h) = (0, -1, 1, 0) gives dz_j = 1 * dz/du for every column, the
// chain rule's factor. Bounds (flce_rows.cu's analysis): a softcap's z within 6 2^-24 |z| and
// its (1 - t^2) / T within (16 t^2 + 3 (1 - t^2)) 2^-24 / T; without a softcap z is the float
// quotient (u + b) / T itself (the corrected product) and dz/du = fl(1 / T).
TEST(row_transform) {
  struct XCase {
    float cap, temp;
    bool bias;
  };
  for (const XCase xc : {XCase{15.f, 1.f, false}, XCase{2.5f, 1.6f, true}, XCase{1.f, 0.3f, false},
                         XCase{0.f, 0.7f, true}, XCase{0.f, 1.f, true}, XCase{0.f, 3.f, false}}) {
    const int64_t v = 128, n = 256;
    std::vector<float> u(n * v), b(v, 0.f);
    std::vector<int64_t> tgt(n);
    const double scale = xc.cap > 0 ? xc.cap : 8.0;
    for (int64_t i = 0; i < n; ++i) {
      tgt[i] = i % v;
      for (int64_t j = 0; j < v; ++j) {
        // |y| log-uniform over [1e-7, 30], a tenth of them near the switch at |y| = 1; signs mixed
        const double r = check::uniform(0.f, 1.f);
        double y = (i * v + j) % 10 == 0 ? check::uniform(0.9f, 1.1f)
                                         : std::pow(10.0, -7.0 + 8.5 * r);
        if ((i + j) % 2) y = -y;
        u[i * v + j] = static_cast<float>(y * scale);
      }
    }
    u[0] = 0.f;
    u[1] = xc.cap > 0 ? xc.cap : 1.f;  // |y| = 1 exactly
    if (xc.bias) {
      for (float& x : b) x = check::normal(0.5f);
    }
    DeviceBuffer<float> logits(u), bias(b), partials(n * kPartials, harness::qnan());
    DeviceBuffer<int64_t> target(tgt);
    flce::cuda::RowStatsParams sp{};
    sp.logits = logits.data();
    sp.n = n;
    sp.v = v;
    sp.ld = v;
    sp.bias = xc.bias ? bias.data() : nullptr;
    sp.softcap = xc.cap;
    sp.temperature = xc.temp;
    sp.target = target.data();
    sp.target_stride = 1;
    sp.col_offset = 0;
    sp.ignore_index = kIgnore;
    sp.partials = partials.data();
    sp.need_sum = false;
    sp.need_u = false;
    EXPECT(ok_or_report(flce::cuda::launch_row_stats(sp, nullptr), "row_stats") == cudaSuccess,
           "row_stats");
    // RowGrad (ref, a, u, dz_t), (div, h, k, rdiv): p_j = exp(z_j - 1e30) = 0, dz_j = 0 p_j + 1.
    std::vector<float> cf(n * 8);
    for (int64_t i = 0; i < n; ++i) {
      const float row[8] = {1e30f, 0.f, -1.f, 1.f, 1.f, 0.f, 0.f, 1.f};
      std::copy(row, row + 8, cf.begin() + i * 8);
    }
    DeviceBuffer<float> coef(cf), grad(n * v, harness::qnan());
    flce::cuda::RowGradParams gp{};
    static_cast<flce::cuda::RowOperands&>(gp) = sp;
    gp.coef = coef.data();
    gp.entropy = false;
    gp.grad = grad.data();
    gp.grad_ld = v;
    gp.grad_lo = nullptr;
    gp.target_resid = nullptr;
    gp.col_partials = nullptr;
    gp.rows_per_cta = 1;
    EXPECT(ok_or_report(flce::cuda::launch_row_grad(gp, DType::kFloat32, nullptr), "row_grad") ==
               cudaSuccess,
           "row_grad");
    char what[96];
    std::snprintf(what, sizeof(what), "row transform cap=%g T=%g bias=%d", xc.cap, xc.temp, xc.bias);
    Case desc = make(Kind::kF32, n, v, 1);
    desc.softcap = xc.cap;
    desc.temp = xc.temp;
    desc.bias = xc.bias;
    Tally tz(std::string(what) + ": z_t", desc), tg(std::string(what) + ": dz/du", desc);
    const float inv_t = 1.f / xc.temp;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < v; ++j) {
        const float uj = u[i * v + j] + b[j];  // the kernel's u + b, one fp32 rounding
        const double g = grad.data()[i * v + j];
        if (xc.cap > 0) {
          const double t = std::tanh(static_cast<double>(uj) / xc.cap);
          const double chain = (1 - t * t) / xc.temp;
          tg.check(tg.near(g, chain, (16 * t * t + 3 * (1 - t * t)) * kU / xc.temp),
                   "u %.9g: %.9g vs %.9g", uj, g, chain);
          if (j == tgt[i]) {
            const double z = xc.cap * t / xc.temp, got = partials.data()[i * kPartials + 2];
            tz.check(tz.near(got, z, 6 * kU * std::fabs(z)), "u %.9g: %.9g vs %.9g", uj, got, z);
          }
        } else {
          tg.check(g == inv_t, "u %.9g: %.9g vs %.9g", uj, g, inv_t);
          if (j == tgt[i]) {
            const float z = uj / xc.temp, got = partials.data()[i * kPartials + 2];
            tz.check(got == z, "u %.9g: %.9g vs %.9g", uj, got, z);
          }
        }
      }
    }
  }
}

// launch_scale_grad: out = dtype((sum of the slices) * scale) for every (out, x) dtype pair,
// against float64 (one rounding to fp32 and one to the output dtype) and every element written.
TEST(scale_grad) {
  const int slices = 3;
  const int64_t count = 1000;
  DeviceBuffer<double> k(1, 0.3);
  for (Kind xk : {Kind::kF32, Kind::kBf16, Kind::kF16}) {
    std::vector<float> xs(slices * count);
    DeviceBuffer<unsigned char> x(slices * count * elt_size(xk));
    for (int64_t i = 0; i < slices * count; ++i) {
      xs[i] = quantize(check::normal(), xk);
      unsigned char* at = x.data() + i * elt_size(xk);
      if (xk == Kind::kBf16) {
        const __nv_bfloat16 h = __float2bfloat16_rn(xs[i]);
        std::memcpy(at, &h, 2);
      } else if (xk == Kind::kF16) {
        const __half h = __float2half_rn(xs[i]);
        std::memcpy(at, &h, 2);
      } else {
        std::memcpy(at, &xs[i], 4);
      }
    }
    for (Kind ok_ : {Kind::kF32, Kind::kBf16, Kind::kF16}) {
      DeviceBuffer<unsigned char> out(count * elt_size(ok_), 0xff);
      EXPECT(flce::cuda::launch_scale_grad(out.data(), dtype_of(ok_), x.data(), dtype_of(xk), slices,
                                           count, k.data(), nullptr) == cudaSuccess,
             "scale_grad %s <- %s", kind_name(ok_), kind_name(xk));
      Case c = make(ok_, 0, 0, 0);
      Tally t(std::string("scale_grad ") + kind_name(ok_) + " <- " + kind_name(xk), c);
      for (int64_t i = 0; i < count; ++i) {
        long double ref = 0;
        for (int s2 = 0; s2 < slices; ++s2) ref += xs[s2 * count + i];
        ref *= static_cast<long double>(0.3);  // the double the kernel multiplies by
        const double got = tile_value(ok_, out.data(), i);
        t.check(t.near(got, static_cast<double>(ref),
                       kU * std::fabs(static_cast<double>(ref)) * 1.01 + 0.5 * ulp(std::fabs(static_cast<double>(ref)) * 1.01, ok_)),
                "[%lld] %.9g vs %.9Lg", static_cast<long long>(i), got, ref);
      }
    }
  }
}

// Temperatures below 1 (RL samplers use 0.6 - 1, near-greedy decoding less): the logits grow by
// 1/T and so does the chain rule's dz/du = softcap' / T, with and without softcap. Fails while row_coef's bound leaves out the 1/T (RowCoefParams
// has no temperature): below max |dz| for T < 1, and at T = 0.05 the fp16 tile, scaled by it,
// overflows to inf.
TEST(low_temperature) {
  std::vector<Case> cs;
  {
    Case c = make(Kind::kBf16, 130, 300, 72);
    c.bias = true;
    c.softcap = 15.f;
    c.temp = 0.6f;
    c.grad_lse = true;
    c.grad_ent = true;
    cs.push_back(c);
  }
  {
    Case c = make(Kind::kF16, 64, 300, 24);  // the fp16 tile's scale comes from the bound
    c.temp = 0.05f;
    c.grad_ent = true;
    cs.push_back(c);
  }
  {
    Case c = make(Kind::kF32, 37, 129, 24);
    c.temp = 0.5f;
    c.eps = 0.1f;
    cs.push_back(c);
  }
  {
    Case c = make(Kind::kBf16, 20, 517, 8);
    c.softcap = 15.f;
    c.temp = 0.5f;
    c.grad_ent = true;
    cs.push_back(c);
  }
  run_all(cs);
}

// Empty extents: the launchers return success without launching and leave the outputs alone;
// a column sum over zero rows is zero.
// return_predicted_tokens' argmax pass (launch_row_argmax) on fp32 and bf16 logits (row stride
// padded with NaN: a padding element read poisons the row), with and without a bias, a softcap
// and a temperature (increasing maps of u + b: the argmax of u + b, whose small integers every
// path keeps exact and apart), against the first maximum of the non-target u + b in float64:
// ties within a thread's columns, across threads, across 4096-column tiles and the row's last
// partial tile; a target that is the row's maximum (excluded), rows of -inf (the first
// non-target column), +inf, a NaN (-2), a NaN target (not counted), an ignored row, and a
// column offset (a vocabulary shard's global columns). Output starts at a sentinel.
TEST(row_argmax) {
  struct ACase {
    int64_t n, v;
    Kind kind;
    bool bias;
    float cap, temp;
  };
  const ACase cases[] = {{24, 9001, Kind::kF32, false, 0.f, 1.f},
                         {24, 9001, Kind::kF32, true, 0.f, 0.5f},
                         {24, 9001, Kind::kF32, true, 30.f, 0.7f},
                         {12, 4099, Kind::kBf16, false, 20.f, 1.f},
                         {6, 1, Kind::kF32, false, 0.f, 1.f}};
  const int64_t offset = 1000;
  for (const ACase& c : cases) {
    const int64_t ld = c.v + 3;
    std::vector<double> u(c.n * ld, kInf);
    for (double& x : u) x = std::floor(check::uniform(-8.f, 8.f));
    std::vector<float> b(c.v, 0.f);
    if (c.bias) {
      for (float& x : b) x = std::floor(check::uniform(-2.f, 3.f));
    }
    std::vector<int64_t> t(c.n);
    for (int64_t i = 0; i < c.n; ++i) {
      t[i] = offset + std::min<int64_t>(
                          static_cast<int64_t>(check::uniform(0, static_cast<float>(c.v))), c.v - 1);
    }
    double* r = u.data();
    if (c.v > 8200) {
      // rows 0-3: the maximum 20 (with its bias) tied at two columns: in different tiles (the
      // later in the last partial one), of one thread in two tiles, of one thread in one tile,
      // of neighbouring threads; row 4: the target the only 30; rows 5-6: -inf
      // but a 25 in the last partial tile / -inf everywhere (the target's too); row 7: +inf
      // twice; row 8: a NaN after the max; row 9: a NaN target; row 10: ignored.
      const int64_t pairs[4][2] = {{5000, 9000}, {300, 8492}, {40, 1064}, {8, 12}};
      for (int i = 0; i < 4; ++i) {
        for (int64_t j : pairs[i]) r[i * ld + j] = 20.0 - b[j];
      }
      r[4 * ld + 77] = 30.0;
      t[4] = offset + 77;
      for (int64_t j = 0; j < c.v; ++j) r[5 * ld + j] = r[6 * ld + j] = -kInf;
      r[5 * ld + 8999] = 25.0;
      r[7 * ld + 6000] = r[7 * ld + 100] = kInf;
      r[8 * ld + 20] = 40.0;
      r[8 * ld + 7000] = NAN;
      r[9 * ld + (t[9] - offset)] = NAN;
      t[10] = kIgnore;
    }
    // the padding: NaN
    for (int64_t i = 0; i < c.n; ++i) {
      for (int64_t j = c.v; j < ld; ++j) r[i * ld + j] = NAN;
    }
    std::vector<int64_t> want(c.n);
    for (int64_t i = 0; i < c.n; ++i) {
      int64_t best = -1;
      double m = -kInf;
      for (int64_t j = 0; j < c.v; ++j) {
        if (offset + j == t[i]) continue;
        const double z = r[i * ld + j] + b[j];
        if (std::isnan(z)) {
          best = -2;
          break;
        }
        if (best < 0 || z > m) {
          best = offset + j;
          m = z;
        }
      }
      want[i] = best;
    }
    DeviceBuffer<float> l32(c.n * ld);
    DeviceBuffer<__nv_bfloat16> l16(c.n * ld);
    for (int64_t k = 0; k < c.n * ld; ++k) {
      l32[k] = static_cast<float>(u[k]);
      l16[k] = __float2bfloat16_rn(static_cast<float>(u[k]));
    }
    DeviceBuffer<float> bias(b);
    DeviceBuffer<int64_t> target(t);
    DeviceBuffer<int64_t> out(c.n, -7);
    flce::cuda::RowArgmaxParams p{};
    p.logits = c.kind == Kind::kF32 ? static_cast<const void*>(l32.data()) : l16.data();
    p.logits_dtype = dtype_of(c.kind);
    p.n = c.n;
    p.v = c.v;
    p.ld = ld;
    p.bias = c.bias ? bias.data() : nullptr;
    p.softcap = c.cap;
    p.temperature = c.temp;
    p.target = target.data();
    p.target_stride = 1;
    p.col_offset = offset;
    p.ignore_index = kIgnore;
    p.argmax = out.data();
    EXPECT(flce::cuda::launch_row_argmax(p, nullptr) == cudaSuccess, "row_argmax launch");
    for (int64_t i = 0; i < c.n; ++i) {
      EXPECT(out[i] == want[i], "row_argmax %s v = %ld cap %g T %g bias %d: row %ld column %ld, "
             "want %ld", kind_name(c.kind), static_cast<long>(c.v), c.cap, c.temp, c.bias,
             static_cast<long>(i), static_cast<long>(out[i]), static_cast<long>(want[i]));
    }
  }
}

// flce::distill_rows_'s kernel (launch_distill_rows, csrc/cuda/flce_distill.cu) on fp32 and fp64
// logits against a long double reference of the collapse-safe distillation (docs/numerics.md
// "Distillation": every distribution from its dominant class, log M of the JSD's mixture as a
// logaddexp, P_S - P_T at a shared dominant class as e_T - e_S): every divergence, a temperature,
// a hard term, rows of random logits, a row collapsed on one class shared by both models (margin
// 30: e ~ 1e-11, far below fp32's 1 - P_a) and one on different classes, an ignored row, a row
// with a NaN; widths narrower than the CTA's 256 threads and with a tail past them. The loss
// buffer starts NaN; the gradients are written over the logits.
struct DistRow {
  int64_t a;
  long double l, e;
  std::vector<long double> logp, p;
};

DistRow dist_row(const std::vector<long double>& u) {
  DistRow d{0, 0, 0, std::vector<long double>(u.size()), std::vector<long double>(u.size())};
  for (size_t j = 0; j < u.size(); ++j) d.a = u[j] > u[d.a] ? static_cast<int64_t>(j) : d.a;
  long double s = 0;
  for (size_t j = 0; j < u.size(); ++j) s += static_cast<int64_t>(j) == d.a ? 0 : expl(u[j] - u[d.a]);
  d.l = log1pl(s);
  d.e = s / (1 + s);
  for (size_t j = 0; j < u.size(); ++j) {
    d.logp[j] = (u[j] - u[d.a]) - d.l;
    d.p[j] = expl(d.logp[j]);
  }
  return d;
}

// KL(X || Y) and its gradient in X's logits with Y fixed, X_j (r_j - KL), r_j = log(X_j / Y_j),
// from log Y; both relative to X's dominant class a (KL = r_a + c, r_j - KL = (r_j - r_a) - c,
// c = sum_{j != a} X_j (r_j - r_a)): where X has collapsed, r_a - KL is far below r_a's
// rounding in long double.
long double kl_and_grad(const DistRow& x, const std::vector<long double>& log_y,
                        std::vector<long double>& g) {
  const size_t a = static_cast<size_t>(x.a);
  const long double r_a = x.logp[a] - log_y[a];
  std::vector<long double> rel(g.size());
  long double c = 0;
  for (size_t j = 0; j < g.size(); ++j) {
    rel[j] = j == a ? 0 : (x.logp[j] - log_y[j]) - r_a;
    c += x.p[j] * rel[j];
  }
  for (size_t j = 0; j < g.size(); ++j) g[j] = x.p[j] * (rel[j] - c);
  return r_a + c;
}

struct DistCase {
  flce::cuda::DistillDiv div;
  double beta, temp, hw, sw;
};

// One row's loss, its gradients in both logits, the size of the loss's terms and each
// gradient's scale (its soft and hard terms' largest entries, added).
struct DistRef {
  long double loss, terms, scale_s, scale_t;
  std::vector<long double> gs, gt;
};

DistRef distill_ref(const std::vector<double>& zs, const std::vector<double>& zt, int64_t t,
                    const DistCase& c) {
  const size_t v = zs.size();
  std::vector<long double> us(v), ut(v), zh(v);
  for (size_t j = 0; j < v; ++j) {
    us[j] = zs[j] / static_cast<long double>(c.temp);
    ut[j] = zt[j] / static_cast<long double>(c.temp);
    zh[j] = zs[j];
  }
  const DistRow S = dist_row(us), P = dist_row(ut);
  DistRef r{0, 0, 0, 0, std::vector<long double>(v), std::vector<long double>(v)};
  std::vector<long double> hs(v), ht(v);
  long double soft = 0;
  using D = flce::cuda::DistillDiv;
  if (c.div == D::kJsd) {
    std::vector<long double> log_m(v);
    const long double lb = logl(c.beta), l1b = log1pl(-c.beta);
    for (size_t j = 0; j < v; ++j) {
      const long double x = lb + P.logp[j], y = l1b + S.logp[j];
      const long double hi = std::max(x, y), lo = std::min(x, y);
      log_m[j] = hi + log1pl(expl(lo - hi));
    }
    const long double kl_s = kl_and_grad(S, log_m, hs), kl_t = kl_and_grad(P, log_m, ht);
    soft = c.beta * kl_t + (1 - c.beta) * kl_s;
    for (size_t j = 0; j < v; ++j) {
      hs[j] *= 1 - c.beta;
      ht[j] *= c.beta;
    }
  } else {
    const bool fwd = c.div == D::kForwardKl;
    // forward: KL(T || S), the teacher's gradient by kl_and_grad, the student's S - T; reverse:
    // the other way round
    soft = fwd ? kl_and_grad(P, S.logp, ht) : kl_and_grad(S, P.logp, hs);
    std::vector<long double>& diff = fwd ? hs : ht;
    for (size_t j = 0; j < v; ++j) {
      const bool shared = S.a == P.a && static_cast<int64_t>(j) == S.a;
      const long double d = shared ? P.e - S.e : S.p[j] - P.p[j];
      diff[j] = fwd ? d : -d;
    }
  }
  const long double k = c.sw / c.temp;
  r.loss = c.sw * soft;
  for (size_t j = 0; j < v; ++j) {
    r.gs[j] = hs[j] * k;
    r.gt[j] = ht[j] * k;
    r.scale_s = std::max(r.scale_s, fabsl(r.gs[j]));
    r.scale_t = std::max(r.scale_t, fabsl(r.gt[j]));
    r.terms += fabsl(c.sw) * (S.p[j] + P.p[j]) *
               (fabsl(S.logp[j]) + fabsl(P.logp[j]) + fabsl(us[j]) + fabsl(ut[j]));
  }
  if (c.hw != 0) {
    const DistRow H = dist_row(zh);
    r.loss -= c.hw * H.logp[t];
    r.terms += fabsl(c.hw * H.logp[t]);
    long double hmax = 0;
    for (size_t j = 0; j < v; ++j) {
      const bool is_t = static_cast<int64_t>(j) == t;
      const long double g = is_t ? (t == H.a ? -H.e : H.p[j] - 1) : H.p[j];
      r.gs[j] += c.hw * g;
      hmax = std::max(hmax, fabsl(c.hw * g));
    }
    r.scale_s += hmax;
  }
  return r;
}

template <typename T>
void distill_rows_case(const DistCase& c, int64_t v) {
  constexpr int64_t n = 9;
  const double u = std::is_same_v<T, float> ? kU : 0x1p-53;
  // (fp64: the reference's log mixtures are formed otherwise than the kernel's, ~200 roundings
  // apart at some rows, as in tests/cpu/test_distill_rows.py; still 1e-13 of the scale)
  const double roundings = std::is_same_v<T, float> ? 16 : 512;
  std::vector<double> zs(n * v), zt(n * v);
  for (auto& x : zs) x = static_cast<T>(check::normal(3.f));
  for (auto& x : zt) x = static_cast<T>(check::normal(3.f) + 0.5f);
  std::vector<int64_t> t(n);
  for (auto& x : t) {
    x = std::min<int64_t>(static_cast<int64_t>(check::uniform(0, static_cast<float>(v))), v - 1);
  }
  std::vector<bool> valid(n, true);
  if (v > 2) {
    // row 5: both collapsed on class a (the target); row 6: on different classes
    const int64_t a = v / 3, b = v - 2;
    for (int64_t j = 0; j < v; ++j) {
      zs[5 * v + j] = static_cast<T>(check::normal(1.f));
      zt[5 * v + j] = static_cast<T>(check::normal(1.f));
      zs[6 * v + j] = static_cast<T>(check::normal(1.f));
      zt[6 * v + j] = static_cast<T>(check::normal(1.f));
    }
    zs[5 * v + a] = 30;
    zt[5 * v + a] = 28;
    t[5] = a;
    zs[6 * v + a] = 30;
    zt[6 * v + b] = 30;
  }
  valid[7] = false;  // ignored: 0, whatever its logits
  // a NaN logit (V = 1: a row of one NaN has the shared class's e_T - e_S = 0 as its gradient,
  // as torch's row math, and is checked as a NaN loss alone)
  zs[8 * v + v / 2] = NAN;
  DeviceBuffer<T> ds(n * v), dt(n * v), loss(n, static_cast<T>(NAN));
  for (int64_t k = 0; k < n * v; ++k) {
    ds[k] = static_cast<T>(zs[k]);
    dt[k] = static_cast<T>(zt[k]);
  }
  DeviceBuffer<int64_t> target(t);
  std::unique_ptr<bool[]> vb(new bool[n]);
  for (int64_t i = 0; i < n; ++i) vb[i] = valid[i];
  flce::cuda::DistillRowsParams p{};
  p.z_s = ds.data();
  p.z_t = dt.data();
  p.loss = loss.data();
  p.target = target.data();
  p.valid = vb.get();
  p.n = n;
  p.v = v;
  p.div = c.div;
  p.fp64 = std::is_same_v<T, double>;
  p.grad_s = p.grad_t = true;
  p.beta = c.beta;
  p.logit_beta = std::log(c.beta / (1 - c.beta));
  p.temperature = c.temp;
  p.hard_weight = c.hw;
  p.soft_weight = c.sw;
  EXPECT(flce::cuda::launch_distill_rows(p, nullptr) == cudaSuccess, "distill_rows launch");
  char what[160];
  std::snprintf(what, sizeof(what), "distill_rows %s div %d beta %g T %g hw %g v %ld",
                std::is_same_v<T, float> ? "fp32" : "fp64", static_cast<int>(c.div), c.beta,
                c.temp, c.hw, static_cast<long>(v));
  long bad = 0, checked = 0;
  std::string first;
  auto expect = [&](bool ok, const char* item, int64_t i, int64_t j, double got, double want) {
    ++checked;
    if (ok || bad++ >= 3) return;
    char buf[160];
    std::snprintf(buf, sizeof(buf), "\n    %s row %ld col %ld: %.9g, want %.9g", item,
                  static_cast<long>(i), static_cast<long>(j), got, want);
    first += buf;
  };
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<double> rs(zs.begin() + i * v, zs.begin() + (i + 1) * v);
    const std::vector<double> rt(zt.begin() + i * v, zt.begin() + (i + 1) * v);
    if (!valid[i] || i == 8) {
      // ignored: exactly 0; a NaN logit: every output of the row NaN
      const bool nan_row = valid[i];
      expect(nan_row ? std::isnan(loss[i]) : loss[i] == 0, "loss", i, -1, loss[i], 0);
      for (int64_t j = 0; j < (nan_row && v == 1 ? 0 : v); ++j) {
        expect(nan_row ? std::isnan(ds[i * v + j]) : ds[i * v + j] == 0, "grad_s", i, j,
               ds[i * v + j], 0);
        expect(nan_row ? std::isnan(dt[i * v + j]) : dt[i * v + j] == 0, "grad_t", i, j,
               dt[i * v + j], 0);
      }
      continue;
    }
    const DistRef r = distill_ref(rs, rt, t[i], c);
    const double want = static_cast<double>(r.loss);
    const double ltol = (std::is_same_v<T, float> ? 1e-5 : 1e-13) * std::fabs(want) +
                        roundings * u * static_cast<double>(r.terms) + 1e-300;
    expect(std::fabs(loss[i] - want) <= ltol, "loss", i, -1, loss[i], want);
    double zmax = 0;
    for (int64_t j = 0; j < v; ++j) zmax = std::max({zmax, std::fabs(rs[j]), std::fabs(rt[j])});
    const double floor = roundings * u * (1 + zmax / std::min(c.temp, 1.0));
    for (int64_t j = 0; j < v; ++j) {
      const double ws = static_cast<double>(r.gs[j]), wt = static_cast<double>(r.gt[j]);
      expect(std::fabs(ds[i * v + j] - ws) <= floor * static_cast<double>(r.scale_s), "grad_s",
             i, j, ds[i * v + j], ws);
      expect(std::fabs(dt[i * v + j] - wt) <= floor * static_cast<double>(r.scale_t), "grad_t",
             i, j, dt[i * v + j], wt);
    }
  }
  EXPECT(bad == 0, "%s: %ld of %ld elements out of bounds [%s]%s", what, bad, checked, what,
         first.c_str());
}

TEST(distill_rows) {
  using D = flce::cuda::DistillDiv;
  const DistCase cases[] = {{D::kForwardKl, 0.5, 1.0, 0.0, 1.0}, {D::kReverseKl, 0.5, 1.0, 0.0, 1.0},
                            {D::kJsd, 0.5, 1.0, 0.0, 1.0},       {D::kJsd, 0.1, 0.7, 0.4, 0.6},
                            {D::kForwardKl, 0.5, 2.3, 0.4, 0.6}, {D::kReverseKl, 0.5, 1.0, 0.5, 1.0},
                            {D::kJsd, 0.9, 1.0, 0.5, 1.0}};
  for (const DistCase& c : cases) {
    for (int64_t v : {1, 9, 300, 1000}) {
      distill_rows_case<float>(c, v);
      distill_rows_case<double>(c, v);
    }
  }
}

TEST(empty_shapes) {
  DeviceBuffer<float> sentinel(64, 7.f);
  DeviceBuffer<int64_t> target(4, 0);
  flce::cuda::RowStatsParams sp{};
  sp.logits = sentinel.data();
  sp.v = 100;
  sp.ld = 100;
  sp.target = target.data();
  sp.target_stride = 1;
  sp.ignore_index = kIgnore;
  sp.partials = sentinel.data();
  EXPECT(flce::cuda::launch_row_stats(sp, nullptr) == cudaSuccess, "row_stats n = 0");
  flce::cuda::RowGradParams gp{};
  static_cast<flce::cuda::RowOperands&>(gp) = sp;
  gp.coef = sentinel.data();
  gp.grad = sentinel.data();
  gp.grad_ld = 100;
  gp.rows_per_cta = 1;
  for (Kind k : {Kind::kBf16, Kind::kF16, Kind::kF32}) {
    EXPECT(flce::cuda::launch_row_grad(gp, dtype_of(k), nullptr) == cudaSuccess, "row_grad n = 0 %s",
           kind_name(k));
  }
  flce::cuda::CombineParams cp{};
  cp.loss = sentinel.data();
  EXPECT(flce::cuda::launch_combine(cp, true, nullptr) == cudaSuccess, "combine n = 0");
  flce::cuda::RowCoefParams rp{};
  rp.coef = sentinel.data();
  EXPECT(flce::cuda::launch_row_coef(rp, nullptr) == cudaSuccess, "row_coef n = 0");
  flce::cuda::TargetFixParams fp{};
  fp.sum = sentinel.data();
  EXPECT(flce::cuda::launch_target_fix(fp, DType::kBFloat16, nullptr) == cudaSuccess, "target_fix n = 0");
  EXPECT(flce::cuda::launch_kahan_accumulate(sentinel.data(), sentinel.data(), sentinel.data(), 0,
                                             nullptr, nullptr) == cudaSuccess,
         "kahan count = 0");
  EXPECT(flce::cuda::launch_scale_store(sentinel.data(), DType::kFloat32, sentinel.data(), 0, nullptr,
                                        nullptr) == cudaSuccess,
         "scale_store count = 0");
  EXPECT(flce::cuda::launch_column_sum(sentinel.data(), 3, 0, sentinel.data(), nullptr) == cudaSuccess,
         "column_sum cols = 0");
  for (int i = 0; i < 64; ++i) EXPECT(sentinel[i] == 7.f, "element %d touched: %g", i, sentinel[i]);
  DeviceBuffer<float> out(5, harness::qnan());
  EXPECT(flce::cuda::launch_column_sum(sentinel.data(), 0, 5, out.data(), nullptr) == cudaSuccess,
         "column_sum rows = 0");
  for (int i = 0; i < 5; ++i) EXPECT(out[i] == 0.f, "sum over no rows [%d] = %g", i, out[i]);
  // Out-of-range fp16 stores saturate to infinity, NaN stays NaN (scale_store<__half>).
  DeviceBuffer<float> x(std::vector<float>{7e4f, -7e4f, harness::qnan(), 1.5f});
  DeviceBuffer<__half> h(4);
  EXPECT(flce::cuda::launch_scale_store(h.data(), DType::kFloat16, x.data(), 4, nullptr, nullptr) ==
             cudaSuccess,
         "scale_store fp16");
  EXPECT(std::isinf(__half2float(h[0])) && __half2float(h[0]) > 0 && std::isinf(__half2float(h[1])) &&
             std::isnan(__half2float(h[2])) && __half2float(h[3]) == 1.5f,
         "fp16 saturation");
}

}  // namespace

int main(int argc, char** argv) { return check::run_all(argc, argv); }
