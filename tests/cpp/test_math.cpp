// Host unit tests of csrc/include/flce/math.h against long double formulas.
//
// Each fp32 function is fed fp32 inputs and compared with the long double value of the exact
// formula at those same inputs, so the tolerance measures the header's own rounding (a few fp32
// ulps), not the conditioning of the inputs. Where a test claims a property the usual formulas
// lack (collapse safety, Neumaier over Kahan, -inf/NaN guards), it also shows that the naive
// variant fails the same check, so the check cannot pass vacuously.
#include <flce/math.h>

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <cmath>
#include <numeric>
#include <vector>

#include "check.h"

using check::kU;
using check::near_abs;
using check::near_ulps;
using LD = long double;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

LD softplus_ld(LD x) { return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }
LD sigmoid_ld(LD x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }
LD logaddexp_ld(LD a, LD b) {
  const LD mx = std::max(a, b), mn = std::min(a, b);
  if (std::isinf(mn) && mn < 0) return mx;
  return mx + std::log1p(std::exp(mn - mx));
}

LD logsumexp_ld(const std::vector<float>& z) {
  LD m = -INFINITY;
  for (float v : z) m = std::max<LD>(m, v);
  if (std::isinf(m) && m < 0) return m;
  LD s = 0;
  for (float v : z) s += std::exp(static_cast<LD>(v) - m);
  return m + std::log(s);
}

// A state whose lse_value is lse_x exactly (m = lse_x, s = 1), for the row formulas' tests of
// given statistics.
flce::OnlineLse lse_state(float lse_x) { return flce::OnlineLse{lse_x, 1.f, 0.f}; }

float lse_sequential(const std::vector<float>& z) {
  flce::OnlineLse st = flce::lse_empty();
  for (float v : z) flce::lse_add(st, v);
  return flce::lse_value(st);
}

// The two-pass tile form the backends use: the tile's max, then sum exp(z - max), then a merge.
flce::OnlineLse tile_state(const float* z, size_t n) {
  float mx = -kInf;
  bool nan = false;
  for (size_t j = 0; j < n; ++j) {
    mx = std::max(mx, z[j]);
    nan |= std::isnan(z[j]);
  }
  float s = 0.f, u = 0.f;
  if (mx != -kInf)
    for (size_t j = 0; j < n; ++j) {
      if (z[j] == -kInf) continue;
      const float e = std::exp(z[j] - mx);
      s += e;
      u += e * (mx - z[j]);
    }
  return flce::OnlineLse{mx, nan ? kNaN : s, nan ? kNaN : u};
}

float lse_tiles(const std::vector<float>& z, size_t tile, bool reverse) {
  std::vector<flce::OnlineLse> parts;
  for (size_t j0 = 0; j0 < z.size(); j0 += tile)
    parts.push_back(tile_state(z.data() + j0, std::min(tile, z.size() - j0)));
  if (reverse) std::reverse(parts.begin(), parts.end());
  flce::OnlineLse st = flce::lse_empty();
  for (const auto& p : parts) flce::lse_add_tile(st, p.m, p.s, p.u);
  return flce::lse_value(st);
}

// A pairwise merge tree, as a reduction across threads or ranks does it.
float lse_tree(const std::vector<float>& z, size_t tile) {
  std::vector<flce::OnlineLse> parts;
  for (size_t j0 = 0; j0 < z.size(); j0 += tile)
    parts.push_back(tile_state(z.data() + j0, std::min(tile, z.size() - j0)));
  while (parts.size() > 1) {
    std::vector<flce::OnlineLse> next;
    for (size_t i = 0; i + 1 < parts.size(); i += 2)
      next.push_back(flce::lse_merge(parts[i], parts[i + 1]));
    if (parts.size() % 2) next.push_back(parts.back());
    parts.swap(next);
  }
  return flce::lse_value(parts.empty() ? flce::lse_empty() : parts[0]);
}

std::vector<float> random_row(size_t n, float sigma) {
  std::vector<float> z(n);
  for (auto& v : z) v = check::normal(sigma);
  return z;
}

bool same_bits(flce::OnlineLse a, flce::OnlineLse b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Online logsumexp and its merge.
// ------------------------------------------------------------------------------------------------
TEST(lse_matches_long_double) {
  long double worst = 0;
  for (size_t n : {1, 2, 3, 17, 1000, 32771}) {
    for (float sigma : {0.01f, 1.f, 10.f, 1000.f, 1e30f}) {
      const auto z = random_row(n, sigma);
      const LD ref = logsumexp_ld(z);
      // A sum of n positive fp32 terms: relative error grows like sqrt(n) u for random data
      // (n u worst case); plus the final m + log(s) rounding.
      const LD tol = (4 * std::sqrt(static_cast<LD>(n)) + 4) * kU + 2 * check::ulp_at(ref);
      const float got[] = {lse_sequential(z), lse_tiles(z, 1, false), lse_tiles(z, 7, false),
                           lse_tiles(z, 64, true), lse_tree(z, 5), lse_tree(z, 256)};
      for (float g : got) {
        EXPECT(near_abs(g, ref, tol), "n=%zu sigma=%g: got %.9g, long double %.12Lg (tol %.3Lg)",
               n, sigma, g, ref, tol);
        worst = std::max(worst, std::fabs(static_cast<LD>(g) - ref) / tol);
      }
    }
  }
  std::printf("  worst lse error: %.3Lg of the tolerance\n", worst);
}

TEST(lse_merge_empty_is_identity) {
  const flce::OnlineLse e = flce::lse_empty();
  EXPECT(flce::lse_value(e) == -kInf, "lse of nothing is -inf, got %g", flce::lse_value(e));
  for (int i = 0; i < 100; ++i) {
    const flce::OnlineLse x{check::normal(50.f), check::uniform(1.f, 1000.f)};
    EXPECT(same_bits(flce::lse_merge(e, x), x), "merge(empty, x) must be x bit for bit");
    EXPECT(same_bits(flce::lse_merge(x, e), x), "merge(x, empty) must be x bit for bit");
  }
  EXPECT(same_bits(flce::lse_merge(e, e), e), "merge(empty, empty) must stay empty");
}

TEST(lse_merge_is_order_independent) {
  for (int trial = 0; trial < 50; ++trial) {
    const auto z = random_row(1 + check::rng()() % 3000, check::uniform(0.1f, 30.f));
    const LD ref = logsumexp_ld(z);
    const LD tol = (4 * std::sqrt(static_cast<LD>(z.size())) + 4) * kU + 2 * check::ulp_at(ref);
    const float fwd = lse_tiles(z, 32, false), rev = lse_tiles(z, 32, true);
    EXPECT(near_abs(fwd, ref, tol) && near_abs(rev, ref, tol),
           "forward %.9g, reversed %.9g, long double %.12Lg", fwd, rev, ref);
  }
}

TEST(lse_minus_inf_logits_are_zero_probability) {
  // -inf logits (a masked, padded vocabulary column) contribute exp(-inf) = 0, anywhere in the
  // row, including first, in every accumulation form.
  for (int trial = 0; trial < 20; ++trial) {
    auto z = random_row(200, 3.f);
    for (auto& v : z)
      if (check::uniform(0.f, 1.f) < 0.3f) v = -kInf;
    z[0] = -kInf;
    for (size_t j = 64; j < 128; ++j) z[j] = -kInf;  // one whole tile of them
    const LD ref = logsumexp_ld(z);
    const LD tol = 64 * kU + 2 * check::ulp_at(ref);
    EXPECT(near_abs(lse_sequential(z), ref, tol), "lse_add: got %.9g, want %.12Lg",
           lse_sequential(z), ref);
    EXPECT(near_abs(lse_tiles(z, 64, false), ref, tol), "tiles: got %.9g, want %.12Lg",
           lse_tiles(z, 64, false), ref);
    EXPECT(near_abs(lse_tree(z, 64), ref, tol), "tree: got %.9g, want %.12Lg", lse_tree(z, 64),
           ref);
  }
  const std::vector<float> all(100, -kInf);
  EXPECT(lse_sequential(all) == -kInf, "all -inf via lse_add: got %g", lse_sequential(all));
  EXPECT(lse_tiles(all, 16, false) == -kInf, "all -inf via tiles: got %g",
         lse_tiles(all, 16, false));
  EXPECT(lse_tree(all, 16) == -kInf, "all -inf via tree: got %g", lse_tree(all, 16));
}

TEST(lse_nan_is_never_dropped) {
  // fmax-style maxima ignore NaN; the state must not.
  for (size_t pos : {size_t(0), size_t(1), size_t(150), size_t(299)}) {
    auto z = random_row(300, 2.f);
    z[pos] = kNaN;
    EXPECT(std::isnan(lse_sequential(z)), "NaN at %zu dropped by lse_add: %g", pos,
           lse_sequential(z));
    EXPECT(std::isnan(lse_tiles(z, 64, false)), "NaN at %zu dropped by tiles", pos);
    EXPECT(std::isnan(lse_tiles(z, 64, true)), "NaN at %zu dropped by reversed tiles", pos);
    EXPECT(std::isnan(lse_tree(z, 16)), "NaN at %zu dropped by the tree", pos);
  }
  const flce::OnlineLse x{3.f, 2.f};
  for (const flce::OnlineLse bad : {flce::OnlineLse{kNaN, 1.f}, flce::OnlineLse{1.f, kNaN},
                                    flce::OnlineLse{-kInf, kNaN}}) {
    EXPECT(std::isnan(flce::lse_value(flce::lse_merge(bad, x))), "merge(NaN state, x) not NaN");
    EXPECT(std::isnan(flce::lse_value(flce::lse_merge(x, bad))), "merge(x, NaN state) not NaN");
  }
}

TEST(lse_plus_inf_is_never_finite) {
  auto z = random_row(100, 1.f);
  z[37] = kInf;
  EXPECT(!std::isfinite(lse_sequential(z)), "+inf logit gave a finite lse %g", lse_sequential(z));
  EXPECT(!std::isfinite(lse_tiles(z, 16, false)), "+inf logit gave a finite lse (tiles)");
}

// ------------------------------------------------------------------------------------------------
// Scalar helpers at extreme arguments.
// ------------------------------------------------------------------------------------------------
namespace {
std::vector<float> extreme_args() {
  std::vector<float> xs = {0.f, -0.f, 1e-30f, -1e-30f, FLT_TRUE_MIN, -FLT_TRUE_MIN, FLT_MIN,
                           1e-8f, -1e-8f, 0.5f, -0.5f, 16.6f, -16.6f, 30.f, -30.f, 87.3f, -87.3f,
                           88.7f, -88.7f, 89.f, -89.f, 103.9f, -103.9f, 104.f, -104.f, 150.f,
                           -150.f, 1e6f, -1e6f, FLT_MAX, -FLT_MAX};
  for (float x = -200.f; x <= 200.f; x += 0.37f) xs.push_back(x);
  for (int i = 0; i < 2000; ++i) xs.push_back(check::uniform(-120.f, 120.f));
  return xs;
}
}  // namespace

// The bounds below follow from the libm calls these helpers make (glibc: expf within 0.502 ulp,
// log1pf within 1 ulp) and their own roundings; a relative error r is r 2^24 ulp at most.
//   softplus, x <= 0: log1pf(e) with e = expf(x) (1 + d), |d| <= 1.004 u, which log1p damps
//     (e / ((1 + e) log1p(e)) <= 1): 1.004 + 1 ulp. x > 0 adds x exactly beside a smaller term.
//   sigmoid, x < 0: e / (1 + e): e's 1.004 u (damped by 1 / (1 + e)), the add's u, the
//     division's u: 3.004 u, so 3.004 ulp; x >= 0: 1 / (1 + expf(-x)), 2.5 ulp.
TEST(softplus_matches_long_double) {
  long double worst = 0;
  for (float x : extreme_args()) {
    const float got = flce::softplus(x);
    const LD ref = softplus_ld(x);
    EXPECT(near_ulps(got, ref, 2.01L), "softplus(%.9g) = %.9g, long double %.12Lg", x, got, ref);
    worst = std::max(worst, check::ulps_off(got, ref));
  }
  EXPECT(flce::softplus(-kInf) == 0.f, "softplus(-inf) must be exactly 0");
  EXPECT(flce::softplus(kInf) == kInf, "softplus(inf) must be inf");
  EXPECT(std::isnan(flce::softplus(kNaN)), "softplus(NaN) must be NaN");
  std::printf("  worst softplus error: %.2Lg ulp\n", worst);
}

TEST(sigmoid_matches_long_double) {
  long double worst = 0;
  for (float x : extreme_args()) {
    const float got = flce::sigmoid(x);
    const LD ref = sigmoid_ld(x);
    EXPECT(near_ulps(got, ref, 3.01L), "sigmoid(%.9g) = %.9g, long double %.12Lg", x, got, ref);
    worst = std::max(worst, check::ulps_off(got, ref));
  }
  EXPECT(flce::sigmoid(-kInf) == 0.f, "sigmoid(-inf) must be 0");
  EXPECT(flce::sigmoid(kInf) == 1.f, "sigmoid(inf) must be 1");
  EXPECT(std::isnan(flce::sigmoid(kNaN)), "sigmoid(NaN) must be NaN");
  std::printf("  worst sigmoid error: %.2Lg ulp\n", worst);
}

TEST(logaddexp_matches_long_double) {
  long double worst = 0;
  const auto xs = extreme_args();
  for (size_t i = 0; i < xs.size(); i += 3) {
    for (size_t j = 0; j < xs.size(); j += 7) {
      const float a = xs[i], b = xs[j];
      const float got = flce::logaddexp(a, b);
      const LD ref = logaddexp_ld(a, b);
      // max + log1p(exp(min - max)): the rounding of each term, which may cancel (a result
      // near 0 from a negative max), plus the final rounding.
      const LD mx = std::max<LD>(a, b), term = ref - mx;
      const LD tol = 2 * kU * (std::fabs(mx) + std::fabs(term)) + check::ulp_at(ref);
      EXPECT(near_abs(got, ref, tol), "logaddexp(%.9g, %.9g) = %.9g, long double %.12Lg", a, b,
             got, ref);
      if (std::isfinite(ref)) worst = std::max(worst, std::fabs(got - ref) / tol);
    }
  }
  EXPECT(flce::logaddexp(-kInf, -kInf) == -kInf, "logaddexp(-inf, -inf) must be -inf");
  EXPECT(flce::logaddexp(-kInf, 3.f) == 3.f && flce::logaddexp(3.f, -kInf) == 3.f,
         "logaddexp(-inf, x) must be x exactly");
  EXPECT(std::isnan(flce::logaddexp(kNaN, 1.f)) && std::isnan(flce::logaddexp(1.f, kNaN)),
         "logaddexp must propagate NaN from either side");
  EXPECT(flce::logaddexp(kInf, 1.f) == kInf, "logaddexp(inf, 1) must be inf");
  std::printf("  worst logaddexp error: %.2Lg of the tolerance\n", worst);
}

TEST(vexp_matches_long_double) {
  // The CPU epilogue's vectorizable exp: 2 ulp of exp over [-87.3, 88], subnormals down to -104,
  // 0 below, inf above.
  long double worst = 0;
  std::vector<float> xs = {-87.3f, -87.29f, -50.f, -1e-7f, 0.f, -0.f, 1e-7f, 0.5f, 1.f, 10.f,
                           87.9f, 88.f, std::nextafter(-87.3f, 0.f)};
  for (float x = -87.3f; x <= 88.f; x += 0.0173f) xs.push_back(x);
  for (int i = 0; i < 20000; ++i) xs.push_back(check::uniform(-87.3f, 0.f));
  for (float x : xs) {
    const float got = flce::vexp(x);
    const LD ref = std::exp(static_cast<LD>(x));
    EXPECT(near_ulps(got, ref, 2), "vexp(%.9g) = %.9g, long double %.12Lg (%.2Lg ulp)", x, got,
           ref, check::ulps_off(got, ref));
    worst = std::max(worst, check::ulps_off(got, ref));
  }
  // Subnormal results: within one subnormal step (2^-149) plus 2 ulp-relative of the exact value.
  for (float x = -103.9f; x < -87.3f; x += 0.0371f) {
    const float got = flce::vexp(x);
    const LD ref = std::exp(static_cast<LD>(x));
    EXPECT(near_abs(got, ref, std::numeric_limits<float>::denorm_min() + 2 * kU * ref),
           "vexp(%.9g) = %.9g (subnormal), long double %.12Lg", x, got, ref);
  }
  for (float x : {-104.01f, -120.f, -1e30f, -kInf}) {
    EXPECT(flce::vexp(x) == 0.f, "vexp(%g) = %g, want 0", x, flce::vexp(x));
  }
  for (float x : {88.01f, 100.f, kInf}) {
    EXPECT(flce::vexp(x) == kInf, "vexp(%g) = %g, want inf", x, flce::vexp(x));
  }
  EXPECT(std::isnan(flce::vexp(kNaN)), "vexp(NaN) must be NaN");
  std::printf("  worst vexp error: %.2Lg ulp\n", worst);
}

TEST(softcap_matches_long_double) {
  for (float cap : {1.f, 15.f, 30.f, 50.f}) {
    for (float u : extreme_args()) {
      const float z = flce::softcap_apply(u, cap);
      const LD ref = cap * std::tanh(static_cast<LD>(u) / cap);
      // Three roundings (u / cap, tanh, cap *); u / cap underflows to subnormals (fewer bits) for |u| < cap * FLT_MIN.
      EXPECT(near_abs(z, ref, 4 * check::ulp_at(ref) + cap * FLT_TRUE_MIN), "softcap(%.9g, cap %g) = %.9g, long double %.12Lg", u, cap,
             z, ref);
      const LD r = static_cast<LD>(z) / cap;
      EXPECT(near_abs(flce::softcap_grad(z, cap), 1 - r * r, 4 * kU),
             "softcap_grad(%.9g, %g) = %.9g, want %.12Lg", z, cap, flce::softcap_grad(z, cap),
             1 - r * r);
    }
  }
  EXPECT(flce::softcap_apply(123.f, 0.f) == 123.f && flce::softcap_grad(5.f, 0.f) == 1.f,
         "cap <= 0 disables the softcap");
}

// ------------------------------------------------------------------------------------------------
// Row loss and gradient at margins 0..200.
// ------------------------------------------------------------------------------------------------
namespace {

struct Row {
  float lse_x, z_t, sum_z;
  std::vector<float> others;  // non-target logits
};

// A row whose target beats the best other logit by `margin`; its statistics computed exactly,
// then rounded to fp32 as a backend hands them over.
Row make_row(float margin, size_t v) {
  Row r;
  r.others = random_row(v - 1, 3.f);
  const float best = *std::max_element(r.others.begin(), r.others.end());
  r.z_t = best + margin;
  r.lse_x = static_cast<float>(logsumexp_ld(r.others));
  LD sum = r.z_t;
  for (float z : r.others) sum += z;
  r.sum_z = static_cast<float>(sum);
  return r;
}

const float kMargins[] = {0.f, 0.5f, 1.f, 2.f, 5.f, 10.f, 16.6f, 20.f, 25.f, 30.f, 40.f, 50.f,
                          70.f, 88.f, 100.f, 104.f, 120.f, 150.f, 200.f};

// Collapse-safe loss of the same fp32 statistics, in long double; ref and a tolerance that
// scales with the terms of the sum (label smoothing subtracts two similar numbers).
struct LossRef {
  LD loss, lse, tol;
};

LossRef loss_ref(const Row& r, const flce::LossOptions& o) {
  const LD lse_x = r.lse_x, z_t = r.z_t;
  const LD nll = softplus_ld(lse_x - z_t);
  const LD lse = logaddexp_ld(lse_x, z_t);
  const LD eps = o.label_smoothing, w = o.z_loss;
  const LD mean = static_cast<LD>(r.sum_z) / static_cast<float>(o.vocab_size);
  LD loss = nll, scale = std::fabs(nll);
  if (eps != 0) {
    loss = (1 - eps) * nll + eps * (lse - mean);
    scale = std::fabs((1 - eps) * nll) + eps * (std::fabs(lse) + std::fabs(mean));
  }
  if (w != 0) {
    loss += w * lse * lse;
    scale += w * lse * lse;
  }
  // The argument lse_x - z_t is rounded once in fp32 (absolute error ulp(lse_x - z_t)), which
  // moves softplus by |softplus'| times that: relative error ulp(d) * sigmoid(d) / softplus(d).
  const LD d = lse_x - z_t;
  const LD arg_err = check::ulp_at(d) * sigmoid_ld(d) * (1 - eps);
  return {loss, lse, 8 * kU * scale + arg_err + 2 * std::numeric_limits<float>::denorm_min()};
}

}  // namespace

TEST(row_loss_matches_long_double_at_all_margins) {
  const flce::LossOptions variants[] = {{0.f, 0.f, 0.f, 4099}, {0.1f, 0.f, 0.f, 4099},
                                        {0.f, 1e-4f, 0.f, 4099}, {0.2f, 1e-3f, 0.f, 4099}};
  int naive_rejected = 0, naive_tried = 0;
  for (const auto& o : variants) {
    for (float margin : kMargins) {
      const Row r = make_row(margin, 4099);
      const flce::RowLoss got = flce::row_loss(lse_state(r.lse_x), r.z_t, r.sum_z, false, o);
      const LossRef ref = loss_ref(r, o);
      EXPECT(near_abs(got.loss, ref.loss, ref.tol),
             "margin %g eps %g w %g: loss %.9g, long double %.12Lg (tol %.3Lg)", margin,
             o.label_smoothing, o.z_loss, got.loss, ref.loss, ref.tol);
      EXPECT(near_ulps(got.lse, ref.lse, 2), "margin %g: lse %.9g, long double %.12Lg", margin,
             got.lse, ref.lse);
      // The same check rejects the usual nll = lse - z_t once fp32 rounds p_t to 1: the test can
      // tell collapse-safe from collapsing math.
      if (o.label_smoothing == 0.f && o.z_loss == 0.f && margin >= 30.f && margin <= 100.f) {
        ++naive_tried;
        const float naive = flce::logaddexp(r.lse_x, r.z_t) - r.z_t;
        naive_rejected += !near_abs(naive, ref.loss, ref.tol);
      }
    }
  }
  EXPECT(naive_tried > 0 && naive_rejected == naive_tried,
         "the loss check must reject lse - z_t at margins 30..100 (rejected %d of %d)",
         naive_rejected, naive_tried);
  // Zero only where the exact value is below fp32's range (margins past ~104 for this row).
  const Row far = make_row(80.f, 4099);
  EXPECT(flce::row_loss(lse_state(far.lse_x), far.z_t, far.sum_z, false, variants[0]).loss > 0.f,
         "the loss at margin 80 must not collapse to 0");
}

// A common offset of a row's logits leaves its softmax, loss and gradients as they are. Logits on
// a grid of 2^-10 in [-8, 56) are exact in fp32 with and without an offset of 10240 (whose ulp is
// 2^-10): every difference of two of them is exact at both, so the row formulas must give the
// same bits at both. lse_x itself (m + log s, rounded at |m| 2^-24 = 6e-4 at 10240) may not
// enter as a value: softplus(lse_x - z_t) misses the float64 loss by ~1e-4 there.
TEST(row_formulas_do_not_depend_on_a_common_offset) {
  const float kOffset = 10240.f;
  const flce::LossOptions o{0.f, 0.f, 0.f, 1000};
  int naive_rejected = 0;
  for (float margin : {-3.f, 0.f, 2.f, 10.f, 20.f, 40.f}) {
    std::vector<float> others(999);
    for (float& z : others) z = std::round(check::uniform(-8.f, 8.f) * 1024.f) / 1024.f;
    const float best = *std::max_element(others.begin(), others.end());
    const float z_t = best + margin;
    const LD want = softplus_ld(logsumexp_ld(others) - z_t);
    flce::OnlineLse x0 = flce::lse_empty(), x1 = flce::lse_empty();
    for (float z : others) {
      flce::lse_add(x0, z);
      flce::lse_add(x1, z + kOffset);
    }
    const float l0 = flce::row_loss(x0, z_t, 0.f, false, o).loss;
    const float l1 = flce::row_loss(x1, z_t + kOffset, 0.f, false, o).loss;
    EXPECT(l0 == l1, "margin %g: loss %.9g at offset 0, %.9g at %g", margin, l0, l1, kOffset);
    EXPECT(near_abs(l0, want, 64 * kU * static_cast<float>(want)),
           "margin %g: loss %.9g, long double %.12Lg", margin, l0, want);
    const flce::RowGrad g0 = flce::row_grad(x0, z_t, false, 1.f, 0.f, o, 0.5f);
    const flce::RowGrad g1 = flce::row_grad(x1, z_t + kOffset, false, 1.f, 0.f, o, 0.5f);
    EXPECT(g0.dz_t == g1.dz_t && g0.rdiv == g1.rdiv && g0.ref + kOffset == g1.ref &&
               g0.k == g1.k,
           "margin %g: dz_t %.9g / %.9g, rdiv %.9g / %.9g", margin, g0.dz_t, g1.dz_t, g0.rdiv,
           g1.rdiv);
    for (size_t j = 0; j < 16; ++j) {
      const float a = flce::logit_grad(g0, others[j]), b = flce::logit_grad(g1, others[j] + kOffset);
      EXPECT(a == b, "margin %g: dz of logit %g: %.9g at offset 0, %.9g (entropy term)", margin,
             others[j], a, b);
    }
    const float h0 = flce::row_entropy(x0, z_t, false), h1 = flce::row_entropy(x1, z_t + kOffset,
                                                                              false);
    EXPECT(h0 == h1, "margin %g: entropy %.9g at offset 0, %.9g at %g", margin, h0, h1, kOffset);
    const float naive = flce::softplus(flce::lse_value(x1) - (z_t + kOffset));
    naive_rejected += !near_abs(naive, want, 64 * kU * static_cast<float>(want));
  }
  EXPECT(naive_rejected >= 4, "softplus(lse_value(x) - z_t) must miss at an offset of %g (%d of 6)",
         kOffset, naive_rejected);
}

TEST(row_loss_of_an_infinite_target_logit_is_nan) {
  const Row r = make_row(3.f, 4099);
  for (const flce::LossOptions& o : {flce::LossOptions{0.f, 0.f, 0.f, 4099},
                                     flce::LossOptions{0.1f, 1e-4f, 0.f, 4099}}) {
    const float got = flce::row_loss(lse_state(r.lse_x), kInf, r.sum_z, false, o).loss;
    EXPECT(std::isnan(got), "a +inf target logit must give NaN (torch's inf - inf), got %g", got);
    EXPECT(std::isinf(flce::row_loss(lse_state(r.lse_x), -kInf, r.sum_z, false, o).loss),
           "a -inf target logit gives +inf, as torch");
  }
}

TEST(row_loss_ignored_rows) {
  const Row r = make_row(3.f, 4099);
  const flce::LossOptions o{0.1f, 1e-4f, 0.f, 4099};
  const flce::RowLoss got = flce::row_loss(lse_state(r.lse_x), r.z_t, r.sum_z, true, o);
  EXPECT(got.loss == 0.f, "an ignored row's loss must be exactly 0, got %g", got.loss);
  EXPECT(near_ulps(got.lse, logaddexp_ld(r.lse_x, r.z_t), 2), "an ignored row still has an lse");
  // An ignored row has no target: the backends pass z_t = -inf and lse_x = the row's lse.
  const flce::RowLoss none = flce::row_loss(lse_state(r.lse_x), -kInf, r.sum_z, true, o);
  EXPECT(none.loss == 0.f && none.lse == r.lse_x, "ignored row with z_t = -inf: loss %g lse %g",
         none.loss, none.lse);
}

TEST(row_grad_matches_long_double_at_all_margins) {
  const flce::LossOptions variants[] = {{0.f, 0.f, 0.f, 4099}, {0.1f, 0.f, 0.f, 4099},
                                        {0.f, 1e-4f, 0.f, 4099}, {0.2f, 1e-3f, 0.f, 4099}};
  int naive_rejected = 0, naive_tried = 0;
  long double worst_sum = 0;
  for (const auto& o : variants) {
    for (float margin : kMargins) {
      const Row r = make_row(margin, 4099);
      const float g = check::uniform(0.1f, 2.f);
      const float g_lse = o.z_loss != 0.f ? check::uniform(-1.f, 1.f) : 0.f;
      const flce::RowGrad got = flce::row_grad(r.lse_x, r.z_t, false, g, g_lse, o);

      const LD lse_x = r.lse_x, z_t = r.z_t, eps = o.label_smoothing, w = o.z_loss;
      const LD lse = logaddexp_ld(lse_x, z_t);
      const LD A = g * (1 + 2 * w * lse) + g_lse, B = g * (1 - eps), U = g * eps / 4099.L;
      const LD p_t = sigmoid_ld(z_t - lse_x), q_t = sigmoid_ld(lse_x - z_t);
      const LD dz_t = (A - B) * p_t - B * q_t - U;
      // Rounding of lse_x - z_t inside the sigmoid moves q_t by q_t (1 - q_t) ulp(d).
      const LD d = lse_x - z_t;
      const LD arg_err = (std::fabs(A - B) + B) * q_t * (1 - q_t) * check::ulp_at(d);
      // A - B cancels when eps and w are small, exposing the roundings of A (observed: got.a)
      // and of B = g (1 - eps) (exact for eps = 0).
      const LD ab_err = std::fabs(got.a - A) + (eps != 0 ? 2 * kU * B : 0);
      const LD tol = ab_err * p_t + 8 * kU * (std::fabs(A - B) * p_t + B * q_t + U) + arg_err +
                     2 * std::numeric_limits<float>::denorm_min();
      EXPECT(near_ulps(got.ref, lse, 2), "margin %g: lse %.9g want %.12Lg", margin, got.ref, lse);
      EXPECT(near_abs(got.a, A, 4 * kU * (std::fabs(A) + std::fabs(g_lse)) + 4 * kU * g),
             "margin %g: A %.9g want %.12Lg", margin, got.a, A);
      EXPECT(near_abs(got.u, U, 2 * check::ulp_at(U)), "margin %g: U %.9g want %.12Lg", margin,
             got.u, U);
      EXPECT(near_abs(got.dz_t, dz_t, tol), "margin %g eps %g w %g: dz_t %.9g, want %.12Lg (tol %.3Lg)",
             margin, o.label_smoothing, o.z_loss, got.dz_t, dz_t, tol);
      // The usual p_t - 1 target gradient fails this check once fp32 rounds p_t to 1.
      if (o.label_smoothing == 0.f && o.z_loss == 0.f && margin >= 30.f && margin <= 100.f) {
        ++naive_tried;
        const float naive = g * (std::exp(r.z_t - flce::logaddexp(r.lse_x, r.z_t)) - 1.f);
        naive_rejected += !near_abs(naive, dz_t, tol);
      }
      // Non-target gradients, and the row's gradient summing to zero (no smoothing/z-loss:
      // sum_j dz_j = g p_x - g q_t with p_x = sum_{j != t} p_j = q_t).
      LD row_sum = got.dz_t, non_target = 0;
      for (size_t j = 0; j < r.others.size(); j += 97) {
        const float z = r.others[j];
        // Given this RowGrad (A, U and lse were checked above).
        const LD want = static_cast<LD>(got.a) * std::exp(static_cast<LD>(z) - got.ref) - got.u;
        const float have = flce::logit_grad(got, z);
        // exp's argument z - lse is rounded to fp32 first: relative error ulp(z - lse).
        const LD arg = static_cast<LD>(z) - static_cast<LD>(got.ref);
        // An absolute floor for results near the subnormal range.
        const LD tol_j = (8 * kU + check::ulp_at(arg)) * (std::fabs(want + got.u) + got.u) +
                         std::fabs(got.a) * FLT_MIN + 2 * FLT_TRUE_MIN;
        EXPECT(near_abs(have, want, tol_j),
               "margin %g: dz_j(%g) = %.9g want %.12Lg", margin, z, have, want);
      }
      if (o.label_smoothing == 0.f && o.z_loss == 0.f) {
        for (float z : r.others) non_target += flce::logit_grad(got, z);
        row_sum += non_target;
        // Relative to the non-target mass g q_t: the collapse-safe pair cancels to fp32 accuracy
        // (the sum itself carries ~sqrt(V) u of the non-target mass).
        const LD mass = g * q_t;
        const LD rel = mass > 0 ? std::fabs(row_sum) / mass : 0;
        if (mass > 1e-30L) {
          EXPECT(rel < 200 * kU * std::sqrt(4099.L),
                 "margin %g: the row gradient sums to %.3Lg, %.3Lg of its non-target mass",
                 margin, row_sum, rel);
          worst_sum = std::max(worst_sum, rel);
        }
      }
    }
  }
  EXPECT(naive_tried > 0 && naive_rejected == naive_tried,
         "the dz_t check must reject p_t - 1 at margins 30..100 (rejected %d of %d)",
         naive_rejected, naive_tried);
  std::printf("  worst |row gradient sum| / non-target mass: %.3Lg\n", worst_sum);
}

TEST(row_grad_from_max_and_sum_is_exact_relative_to_the_row) {
  // The (m, s) form: p_j = exp(z_j - M) / S with M the row's max logit (so z_j - M is exact for
  // the columns that matter) and S its fp32 sum, whose rounding any fp32 softmax shares. The lse
  // form adds lse's own rounding, |lse| 2^-24, to every p_j of the row.
  const flce::LossOptions o{0.f, 0.f, 0.f, 4099};
  LD worst_s = 0;
  for (float margin : {-3.f, 0.f, 2.f, 10.f}) {
    const Row r = make_row(margin, 4099);
    flce::OnlineLse st = flce::lse_empty();
    for (float z : r.others) flce::lse_add(st, z);
    const flce::RowGrad got = flce::row_grad(st, r.z_t, false, 1.f, 0.f, o);
    const float best = *std::max_element(r.others.begin(), r.others.end());
    EXPECT(got.ref == std::max(best, r.z_t), "margin %g: ref %.9g is not the row max", margin,
           got.ref);
    // S is the online fp32 sum lse_add runs, and its rounding is not a random walk one can put
    // sigmas on: terms below half an ulp of the partial sum are dropped, a bias (about -20 u
    // here, spread about 20 u, tails past 200 u; a 128 u tolerance failed about once in 500
    // runs, FLCE_TEST_SEED=1796278048113044940). So the tolerance is the running error bound of
    // that recursion, to first order, in units of the final max M: each add rounds within
    // u of its partial sum; each term's expf is within 1.01 u (glibc: 0.502 ulp) and its
    // argument z - m was rounded to fp32, u |z - m| relative; each rescale multiplies the
    // partial sum by an expf of a rounded argument, (1.01 + |dm|) u. The last add (the target,
    // after rescaling the others to M) gets the same.
    const LD M = got.ref;
    LD sum = 0, bound = 0, m = -INFINITY;
    auto add_term = [&](float z) {
      if (z > m) {
        if (std::isfinite(m)) bound += (1.01L + (z - m)) * kU * sum;
        m = z;
      }
      const LD t = std::exp(static_cast<LD>(z) - M);
      sum += t;
      bound += (1.01L + std::fabs(static_cast<LD>(z) - m)) * kU * t + kU * sum;
    };
    for (float z : r.others) add_term(z);
    add_term(r.z_t);
    // A mistake in what is summed (a term missing, another reference) is >= exp(-3) / S, 4%.
    EXPECT(bound < 1e-3L * sum, "margin %g: the bound %.3Lg of S %.6Lg cannot tell", margin,
           bound, sum);
    EXPECT(near_abs(got.div, sum, bound), "margin %g: S %.9g want %.12Lg (%.3Lg u, bound %.3Lg u)",
           margin, got.div, sum, std::fabs(got.div - sum) / (kU * sum), bound / (kU * sum));
    worst_s = std::max(worst_s, std::fabs(got.div - sum) / bound);
    for (size_t j = 0; j < r.others.size(); j += 41) {
      const LD want = std::exp(static_cast<LD>(r.others[j]) - got.ref) / got.div;
      const float have = flce::logit_grad(got, r.others[j]);
      // z_j - M rounds to fp32 unless it is small (then it is exact): ulp(z_j - M) relative.
      const LD arg = static_cast<LD>(r.others[j]) - static_cast<LD>(got.ref);
      EXPECT(near_abs(have, want, (3 * kU + check::ulp_at(arg)) * want + 2 * FLT_TRUE_MIN),
             "margin %g: p_j %.9g want %.12Lg (%.2Lg ulp)", margin, have, want,
             check::ulps_off(have, want));
    }
  }
  std::printf("  worst online-sum error: %.3Lg of its running bound\n", worst_s);
}

TEST(row_grad_ignored_rows) {
  const Row r = make_row(2.f, 4099);
  const flce::LossOptions o{0.1f, 1e-4f, 0.f, 4099};
  const flce::RowGrad got = flce::row_grad(r.lse_x, r.z_t, true, 0.7f, 0.f, o);
  EXPECT(got.a == 0.f && got.u == 0.f && got.dz_t == 0.f,
         "an ignored row (g_lse = 0) must have zero gradient: a %g u %g dz_t %g", got.a, got.u,
         got.dz_t);
  // g_lse (return_lse's upstream gradient) still flows through an ignored row: d lse / dz = p.
  const flce::RowGrad with_lse = flce::row_grad(r.lse_x, r.z_t, true, 0.7f, 0.25f, o);
  const LD p_t = sigmoid_ld(static_cast<LD>(r.z_t) - r.lse_x);
  EXPECT(with_lse.a == 0.25f && with_lse.u == 0.f && near_abs(with_lse.dz_t, 0.25L * p_t, 4 * kU),
         "ignored row with g_lse: a %g u %g dz_t %g (want %.9Lg)", with_lse.a, with_lse.u,
         with_lse.dz_t, 0.25L * p_t);
}

// ------------------------------------------------------------------------------------------------
// Compensated summation.
// ------------------------------------------------------------------------------------------------
namespace {
// Textbook Kahan (no |x| > |s| branch), to show the series below separates it from Neumaier.
float classic_kahan(const std::vector<float>& xs) {
  float s = 0.f, c = 0.f;
  for (float x : xs) {
    const float y = x - c;
    const float t = s + y;
    c = (t - s) - y;
    s = t;
  }
  return s;
}

float naive_sum(const std::vector<float>& xs) {
  float s = 0.f;
  for (float x : xs) s += x;
  return s;
}

float neumaier_sum(const std::vector<float>& xs) {
  float s = 0.f, c = 0.f;
  for (float x : xs) flce::kahan_add(s, c, x);
  return flce::kahan_result(s, c);
}

LD exact_sum(const std::vector<float>& xs) {
  // long double has 64 mantissa bits; every partial sum below fits, so this is exact.
  LD s = 0;
  for (float x : xs) s += x;
  return s;
}
}  // namespace

TEST(kahan_recovers_terms_below_half_an_ulp) {
  // 1 followed by 2^20 terms of 2^-25 (a quarter ulp of 1): a plain fp32 sum never moves.
  std::vector<float> xs(1 + (1u << 20), 0x1p-25f);
  xs[0] = 1.f;
  const LD exact = exact_sum(xs);  // 1 + 2^-5, representable
  const float naive = naive_sum(xs), kahan = neumaier_sum(xs);
  EXPECT(static_cast<LD>(kahan) == exact, "compensated sum %.9g, exact %.12Lg", kahan, exact);
  EXPECT(check::ulps_off(naive, exact) > 1000, "the series must defeat the naive sum (%.9g)",
         naive);
}

TEST(neumaier_survives_a_term_larger_than_the_sum) {
  const std::vector<float> xs = {1.f, 1e20f, 1.f, -1e20f};
  EXPECT(neumaier_sum(xs) == 2.f, "Neumaier sum %g, want exactly 2", neumaier_sum(xs));
  EXPECT(classic_kahan(xs) != 2.f && naive_sum(xs) != 2.f,
         "the series must defeat classic Kahan (%g) and the naive sum (%g)", classic_kahan(xs),
         naive_sum(xs));
}

TEST(kahan_on_random_ill_conditioned_series) {
  int naive_worse = 0, trials = 0;
  long double worst = 0;
  for (int trial = 0; trial < 10; ++trial) {
    // Large terms that cancel at the end, small ones in between: the running sum is ~1e10
    // (ulp 1024) while the answer is the sum of the O(1) terms.
    std::vector<float> xs, bigs;
    for (int i = 0; i < 20000; ++i) {
      bigs.push_back(check::uniform(1e6f, 2e6f));
      xs.push_back(bigs.back());
      xs.push_back(check::normal(1.f));
    }
    for (float b : bigs) xs.push_back(-b);
    LD abs_sum = 0;
    for (float x : xs) abs_sum += std::fabs(static_cast<LD>(x));
    const LD exact = exact_sum(xs);
    const float kahan = neumaier_sum(xs), naive = naive_sum(xs);
    // Neumaier: |err| <= 2u |S| + O(n u^2) sum |x|.
    const LD bound = 2 * kU * std::fabs(exact) + 4 * xs.size() * kU * kU * abs_sum +
                     check::ulp_at(exact);
    EXPECT(near_abs(kahan, exact, bound), "compensated %.9g, exact %.12Lg, bound %.3Lg", kahan,
           exact, bound);
    worst = std::max(worst, std::fabs(kahan - exact) / bound);
    ++trials;
    naive_worse += std::fabs(naive - exact) >
                   100 * std::max<LD>(std::fabs(kahan - exact), check::ulp_at(exact));
  }
  // The naive sum's error is a random walk of about 7e4 here, so it lands within 100x of the
  // compensated error (~0.05) about once in 2e4 trials (FLCE_TEST_SEED=1796279087349579284:
  // 4.8 against 0.056). Three such trials of ten: about 2e-11.
  EXPECT(naive_worse >= trials - 2, "the series must defeat the naive sum (%d of %d trials)",
         naive_worse, trials);
  std::printf("  worst compensated-sum error: %.3Lg of the bound\n", worst);
}

// ------------------------------------------------------------------------------------------------
// bf16 bit patterns and the compensated add with a bf16 compensation (the CPU accumulators).
// ------------------------------------------------------------------------------------------------
TEST(bf16_bits_round_to_nearest_even) {
  using flce::bf16_bits;
  using flce::bf16_value;
  // Ties: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 (odd): to 1. 1 + 3 * 2^-8 lies halfway
  // between 1 + 2^-7 (odd) and 1 + 2^-6 (even): to 1 + 2^-6.
  EXPECT(bf16_value(bf16_bits(1.f + 0x1p-8f)) == 1.f, "tie below");
  EXPECT(bf16_value(bf16_bits(1.f + 3 * 0x1p-8f)) == 1.f + 0x1p-6f, "tie above");
  EXPECT(bf16_value(bf16_bits(1.f + 0x1p-8f + 0x1p-20f)) == 1.f + 0x1p-7f, "past the tie");
  EXPECT(std::isnan(bf16_value(bf16_bits(NAN))), "NaN must stay NaN");
  EXPECT(bf16_value(bf16_bits(INFINITY)) == INFINITY, "inf");
  EXPECT(bf16_value(bf16_bits(-0.f)) == 0.f && std::signbit(bf16_value(bf16_bits(-0.f))), "-0");
  EXPECT(bf16_value(bf16_bits(FLT_MAX)) == INFINITY, "FLT_MAX rounds up to inf, as RNE does");
  EXPECT(bf16_bits(0.f) == 0 && bf16_bits(-0.f) == 0x8000u, "+-0 keep their bit patterns");
  for (int i = 0; i < 100000; ++i) {
    const float x = check::normal(1.f) * std::ldexp(1.f, static_cast<int>(check::uniform(-100, 100)));
    // The nearest of the bf16 numbers around x (its neighbours are a bit pattern away), the
    // even one on a tie. x can be exactly 0 (the polar method draws 0 about once in 2^24), and
    // a bit pattern below +-0 wraps to a NaN, not a neighbour: 0 is nearer than any
    // other-signed number, so the wrap is skipped.
    const uint16_t h = bf16_bits(x);
    const LD err = std::fabs(static_cast<LD>(bf16_value(h)) - x);
    for (uint16_t nb : {static_cast<uint16_t>(h - 1), static_cast<uint16_t>(h + 1)}) {
      if (std::isnan(bf16_value(nb))) continue;
      const LD other = std::fabs(static_cast<LD>(bf16_value(nb)) - x);
      EXPECT(err < other || (err == other && h % 2 == 0),
             "bf16(%.9g) = %.9g, but %.9g is nearer (or the even one of a tie)", x,
             bf16_value(h), bf16_value(nb));
    }
  }
}

namespace {
float bf16c_sum(const std::vector<float>& xs, LD* sum_abs_partials = nullptr) {
  float s = 0.f;
  uint16_t c = 0;
  LD partials = 0;
  for (float x : xs) {
    flce::kahan_add_bf16c(s, c, x);
    partials += std::fabs(static_cast<LD>(s));
  }
  if (sum_abs_partials) *sum_abs_partials = partials;
  return flce::kahan_result(s, flce::bf16_value(c));
}
}  // namespace

TEST(kahan_bf16c_recovers_terms_below_half_an_ulp) {
  std::vector<float> xs(1 + (1u << 20), 0x1p-25f);
  xs[0] = 1.f;
  const float got = bf16c_sum(xs);
  EXPECT(static_cast<LD>(got) == exact_sum(xs), "bf16-compensated sum %.9g, exact %.12Lg", got,
         exact_sum(xs));
  const std::vector<float> big = {1.f, 1e20f, 1.f, -1e20f};
  EXPECT(bf16c_sum(big) == 2.f, "a term larger than the sum: %g, want exactly 2", bf16c_sum(big));
}

TEST(kahan_bf16c_loses_at_most_2_pow_m9_ulp_per_add) {
  // Gradient-like series: T partial products of either sign. The bound of math.h: the final
  // rounding plus 2^-9 ulp(s_k) (<= 2^-8 u |s_k|) per add.
  long double worst = 0;
  for (int T : {16, 256, 4096}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> xs(T);
      for (float& x : xs) x = check::normal(1.f) * (1.f + 1e3f * (check::uniform(0, 1) < 0.01f));
      LD partials = 0;
      const float got = bf16c_sum(xs, &partials);
      const LD exact = exact_sum(xs);
      // The final rounding is half the spacing where s + c lies, which can be the next binade
      // up from exact's; 1.01 covers the fp32 add of the two compensations (u of c per add).
      const LD acc = 1.01L * 0x1p-8L * kU * partials;
      const LD bound = check::ulp_at(std::fabs(exact) + acc) / 2 + acc;
      EXPECT(near_abs(got, exact, bound), "T=%d: %.9g, exact %.12Lg, bound %.3Lg", T, got, exact,
             bound);
      worst = std::max(worst, std::fabs(got - exact) / bound);
    }
  }
  std::printf("  worst bf16-compensated sum error: %.3Lg of the bound\n", worst);
}

TEST(kahan_bf16c_propagates_nan_and_inf) {
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    const std::vector<float> xs = {1.f, bad, 2.f};
    EXPECT(std::isnan(bf16c_sum(xs)) || std::isinf(bf16c_sum(xs)),
           "a %g term must not give a finite sum (%g)", bad, bf16c_sum(xs));
  }
  EXPECT(std::isnan(bf16c_sum({1.f, NAN, 2.f})), "NaN in, NaN out");
}

TEST(kahan_sum_of_an_infinity_is_that_infinity) {
  // (a masked logit, -inf, in the logits' sum of label smoothing: the loss is +inf, as torch's,
  // not NaN; the compensation alone is NaN there)
  for (float bad : {INFINITY, -INFINITY}) {
    float s = 0.f, c = 0.f;
    for (float x : {1.f, bad, 2.f, 3.f}) flce::kahan_add(s, c, x);
    EXPECT(std::isnan(c), "the compensation of an infinite sum is NaN (%g)", c);
    EXPECT(flce::kahan_result(s, c) == bad, "sum with %g: %g", bad, flce::kahan_result(s, c));
  }
  float s = 0.f, c = 0.f;
  for (float x : {1.f, INFINITY, -INFINITY}) flce::kahan_add(s, c, x);
  EXPECT(std::isnan(flce::kahan_result(s, c)), "inf + -inf: NaN");
  s = 0.f, c = 0.f;
  for (float x : {1.f, NAN, 2.f}) flce::kahan_add(s, c, x);
  EXPECT(std::isnan(flce::kahan_result(s, c)), "NaN in, NaN out");
}


// ------------------------------------------------------------------------------------------------
// Entropy (return_entropy) and temperature.
// ------------------------------------------------------------------------------------------------
namespace {

// H = -sum_j p_j log p_j of softmax over (others, z_t) in long double, from q = sum_j
// exp(z_j - z_t) without ever forming lse - z_t: log p_t = -log1p(q), log p_j = z_j - z_t -
// log1p(q). (A form unlike math.h's, so the test is not the implementation again.)
LD entropy_ld(const std::vector<float>& others, float z_t) {
  LD q = 0;
  for (float z : others) q += std::exp(static_cast<LD>(z) - z_t);
  const LD l1q = std::log1p(q);
  LD h = l1q / (1 + q);  // p_t * -log p_t
  for (float z : others) {
    const LD d = static_cast<LD>(z_t) - z;  // >= 0 at the margins below
    h += std::exp(-d) / (1 + q) * (d + l1q);
  }
  return h;
}

flce::OnlineLse online_state(const std::vector<float>& z) {
  flce::OnlineLse st = flce::lse_empty();
  for (float v : z) flce::lse_add(st, v);
  return st;
}

}  // namespace

TEST(entropy_matches_long_double_at_all_margins) {
  int naive_rejected = 0, naive_tried = 0;
  const size_t v = 4099;
  for (float margin : kMargins) {
    const Row r = make_row(margin, v);
    const LD want = entropy_ld(r.others, r.z_t);
    // Below here H (~ (1 + m) exp(-m) (V - 1)) is no longer a normal fp32 number.
    if (want < 1e3L * FLT_MIN) continue;
    // Online, and by tiles merged in both orders and by a tree (the backends' three ways).
    const flce::OnlineLse seq = online_state(r.others);
    std::vector<flce::OnlineLse> tiles;
    for (size_t j0 = 0; j0 < r.others.size(); j0 += 256)
      tiles.push_back(tile_state(r.others.data() + j0, std::min<size_t>(256, v - 1 - j0)));
    flce::OnlineLse fwd = flce::lse_empty(), bwd = flce::lse_empty();
    for (size_t i = 0; i < tiles.size(); ++i) {
      fwd = flce::lse_merge(fwd, tiles[i]);
      bwd = flce::lse_merge(bwd, tiles[tiles.size() - 1 - i]);
    }
    // The sums s and u carry the recursion's rounding, at most n u relative (all terms >= 0),
    // and every other step a few ulps: a bound, not an estimate.
    const LD tol = (v + 32) * kU * want;
    for (const flce::OnlineLse& x : {seq, fwd, bwd}) {
      const float got = flce::row_entropy(x, r.z_t, false);
      EXPECT(near_abs(got, want, tol), "margin %g: H %.9g, long double %.12Lg (rel %.3Lg)",
             margin, got, want, std::fabs(got - want) / want);
    }
    // The textbook lse - sum_j p_j z_j cancels to nothing near collapse: the check rejects it.
    if (margin >= 20.f && margin <= 88.f) {
      ++naive_tried;
      const float lse = flce::logaddexp(flce::lse_value(seq), r.z_t);
      float pz = std::exp(r.z_t - lse) * r.z_t;
      for (float z : r.others) pz += std::exp(z - lse) * z;
      naive_rejected += !near_abs(lse - pz, want, tol);
    }
  }
  EXPECT(naive_tried > 0 && naive_rejected == naive_tried,
         "the entropy check must reject lse - sum p z at margins 20..88 (rejected %d of %d)",
         naive_rejected, naive_tried);
  // Ignored rows have no entropy; a lone target has none either.
  EXPECT(flce::row_entropy(online_state({1.f, 2.f}), 3.f, true) == 0.f, "ignored row");
  EXPECT(flce::row_entropy(flce::lse_empty(), 3.f, false) == 0.f, "lone target");
  // NaN logits poison it.
  EXPECT(std::isnan(flce::row_entropy(online_state({1.f, kNaN}), 3.f, false)), "NaN logit");
}

TEST(entropy_gradient_matches_long_double) {
  const flce::LossOptions o{0.f, 0.f, 0.f, 4099};
  for (float margin : {0.f, 2.f, 10.f, 30.f, 60.f}) {
    const Row r = make_row(margin, 4099);
    const flce::OnlineLse x = online_state(r.others);
    const float g_ent = check::uniform(0.5f, 2.f);
    // The loss's own gradient off (g = 0): the rows' dz is g_ent dH/dz alone.
    const flce::RowGrad rg = flce::row_grad(x, r.z_t, false, 0.f, 0.f, o, g_ent);
    LD q = 0;
    for (float z : r.others) q += std::exp(static_cast<LD>(z) - r.z_t);
    const LD l1q = std::log1p(q), h = entropy_ld(r.others, r.z_t);
    // dH/dz_j = -p_j (log p_j + H)
    const LD p_t = 1 / (1 + q);
    const LD want_t = -g_ent * p_t * (-l1q + h);
    const LD scale_t = g_ent * p_t * (l1q + h);
    EXPECT(near_abs(rg.dz_t, want_t, 64 * 4099 * kU * scale_t + 4 * FLT_TRUE_MIN),
           "margin %g: dz_t %.9g want %.12Lg", margin, rg.dz_t, want_t);
    for (size_t j = 0; j < r.others.size(); j += 61) {
      const float z = r.others[j];
      const LD d = static_cast<LD>(r.z_t) - z;
      const LD p = std::exp(-d) / (1 + q);
      const LD logp = -d - l1q;
      const LD want = -g_ent * p * (logp + h);
      // p_j's fp32 exp and lse, times |log p_j| + H; the fp32 sums of H (n u).
      const LD tol = g_ent * p * ((16 * kU + check::ulp_at(d)) * (std::fabs(logp) + h) +
                                  4099 * kU * h + 8 * kU * std::fabs(logp)) +
                     4 * FLT_TRUE_MIN;
      const float have = flce::logit_grad(rg, z);
      EXPECT(near_abs(have, want, tol), "margin %g: dH/dz_j(%g) = %.9g want %.12Lg", margin, z,
             have, want);
    }
    // Without an entropy gradient the coefficients are the plain ones (h = 0) and a -inf
    // (masked) logit keeps a zero gradient instead of h * (-inf - k) = NaN.
    const flce::RowGrad plain = flce::row_grad(x, r.z_t, false, 1.f, 0.f, o);
    EXPECT(plain.h == 0.f && flce::logit_grad(plain, -kInf) == 0.f, "plain coefficients");
    EXPECT(flce::logit_grad(rg, -kInf) == -rg.u, "masked logit with an entropy gradient: %g",
           flce::logit_grad(rg, -kInf));
  }
}

TEST(temperature_divides_after_the_softcap) {
  for (int i = 0; i < 2000; ++i) {
    const float u = check::normal(20.f), cap = i % 2 ? 30.f : 0.f;
    const float temp = check::uniform(0.2f, 3.f);
    const LD c = cap > 0 ? cap * std::tanh(static_cast<LD>(u) / cap) : static_cast<LD>(u);
    const LD z = c / temp;
    const float got = flce::logit_transform(u, cap, temp);
    EXPECT(near_abs(got, z, 4 * check::ulp_at(z) + 4 * kU * std::fabs(z)),
           "u %g cap %g T %g: z %.9g want %.12Lg", u, cap, temp, got, z);
    // dz/du = softcap'(u) / T, from z as the backends have it.
    const LD dc = cap > 0 ? 1 - (c / cap) * (c / cap) : 1;
    const LD dz = dc / temp;
    const float gd = flce::logit_transform_grad(got, cap, temp);
    EXPECT(near_abs(gd, dz, 16 * kU * (1 / temp) + 8 * kU * std::fabs(dz)),
           "u %g cap %g T %g: dz/du %.9g want %.12Lg", u, cap, temp, gd, dz);
  }
  EXPECT(flce::logit_transform(3.f, 0.f, 1.f) == 3.f && flce::logit_transform_grad(3.f, 0.f, 1.f) == 1.f,
         "T = 1 is the identity");
}

// ------------------------------------------------------------------------------------------------
// Target distributions (SoftRow): the pivot-relative state, folded one logit at a time and merged
// tile by tile in both orders, against long double at every margin.
// ------------------------------------------------------------------------------------------------
namespace {
flce::SoftRow soft_one(float z, float y, int64_t c) {
  return flce::SoftRow{z, c, y, flce::lse_empty(), 0.f, 0.f};
}

flce::SoftRow soft_tiles(const std::vector<float>& z, const std::vector<float>& y, size_t tile,
                         bool reverse) {
  std::vector<flce::SoftRow> tiles;
  for (size_t i = 0; i < z.size(); i += tile) {
    flce::SoftRow t = flce::soft_empty();
    for (size_t j = i; j < std::min(z.size(), i + tile); ++j) {
      t = flce::soft_merge(t, soft_one(z[j], y[j], static_cast<int64_t>(j)));
    }
    tiles.push_back(t);
  }
  flce::SoftRow st = flce::soft_empty();
  if (reverse) {
    for (auto it = tiles.rbegin(); it != tiles.rend(); ++it) st = flce::soft_merge(*it, st);
  } else {
    for (const auto& t : tiles) st = flce::soft_merge(st, t);
  }
  return st;
}
}  // namespace

TEST(soft_loss_matches_long_double_at_all_margins) {
  long double worst = 0;
  for (float margin : {0.f, 5.f, 20.f, 40.f, 80.f, 200.f}) {
    for (float spread : {1e-7f, 1e-3f, 0.3f}) {
      const size_t n = 1 + check::rng()() % 2000;
      auto z = random_row(n, 1.f);
      const size_t a = check::rng()() % n;
      z[a] = *std::max_element(z.begin(), z.end()) + margin;
      // a target concentrated on the dominant class: 1 - spread there, the rest spread evenly
      std::vector<float> y(n, n > 1 ? spread / static_cast<float>(n - 1) : 0.f);
      y[a] = 1.f - spread;
      LD lse = 0, m = z[a];
      for (float v : z) lse += std::exp(static_cast<LD>(v) - m);
      lse = m + std::log(lse);
      LD ref = 0;
      for (size_t j = 0; j < n; ++j) ref += static_cast<LD>(y[j]) * (lse - z[j]);
      for (bool rev : {false, true}) {
        for (size_t tile : {size_t{1}, size_t{7}, size_t{256}}) {
          const flce::SoftRow st = soft_tiles(z, y, tile, rev);
          // (margin 0: z[a] ties the row's largest logit, and the first of them is the pivot)
          EXPECT(margin == 0.f || st.a == static_cast<int64_t>(a), "pivot %lld, want %zu",
                 (long long)st.a, a);
          const float got = flce::soft_row_loss(st, 1.f, 0.f).loss;
          // Relative accuracy at every margin (a collapsed loss would be off by 100%): sums of
          // n non-negative fp32 terms, one by one here (tile 1), within Higham's gamma_n.
          const LD tol = (static_cast<LD>(n) + 8) * kU * ref;
          EXPECT(std::fabs(got - ref) <= tol, "margin %g spread %g n %zu tile %zu: %.9g vs %.12Lg",
                 margin, spread, n, tile, got, ref);
          worst = std::max(worst, std::fabs(got - ref) / tol);
        }
      }
    }
  }
  std::printf("  worst soft loss error: %.3Lg of the tolerance\n", worst);
}

TEST(soft_merge_skips_masked_columns_without_weight) {
  // A -inf logit with y = 0 (a padded vocabulary column) adds nothing, also as a whole tile.
  flce::SoftRow a = flce::soft_merge(soft_one(1.f, 0.5f, 0), soft_one(0.f, 0.5f, 1));
  const flce::SoftRow masked = flce::soft_merge(soft_one(-kInf, 0.f, 2), soft_one(-kInf, 0.f, 3));
  const float want = flce::soft_row_loss(a, 1.f, 0.f).loss;
  for (const auto& st : {flce::soft_merge(a, masked), flce::soft_merge(masked, a)}) {
    const float got = flce::soft_row_loss(st, 1.f, 0.f).loss;
    EXPECT(got == want, "masked columns changed the loss: %.9g vs %.9g", got, want);
  }
  EXPECT(std::isnan(flce::soft_row_loss(soft_one(kInf, 1.f, 0), 1.f, 0.f).loss),
         "a +inf pivot gives NaN");
}

TEST(soft_merge_of_masked_columns_with_weight_is_infinite) {
  // Target weight on -inf logits (masked columns) makes the loss +inf, also where they are a
  // set of their own first (a GPU thread's columns of a tile: merged with each other under a
  // -inf pivot, -inf - -inf must not turn their gap into NaN), in either merge order.
  const flce::SoftRow a = flce::soft_merge(soft_one(1.f, 0.5f, 0), soft_one(0.f, 0.f, 1));
  const flce::SoftRow masked = flce::soft_merge(soft_one(-kInf, 0.f, 2), soft_one(-kInf, 0.5f, 3));
  EXPECT(masked.g == 0.f && masked.y_rest == 0.5f, "masked set: g %g, y_rest %g", masked.g,
         masked.y_rest);
  for (const auto& st : {flce::soft_merge(a, masked), flce::soft_merge(masked, a)}) {
    const float got = flce::soft_row_loss(st, 1.f, 0.f).loss;
    EXPECT(got == kInf, "target weight on a -inf logit: loss %.9g, want +inf", got);
  }
}

// The pivot column's gradient (soft_row_grad's dz_t) is dz_a = A p_a - g y_a. Where the pivot is
// not the target (a randn row's largest logit with class weights and label smoothing: y_a tiny,
// p_a ~ 1e-3), the collapse-safe form (A - g Y) p_a - g Y q_a + g y_rest cancels from terms of
// g Y to a result of g Y p_a: 1.4e-4 relative off at V = 32000. The check: a few roundings of
// the terms of the better-conditioned form, against long double from the row's state (so that
// only soft_row_grad's own roundings count, not the state's accumulation).
TEST(soft_pivot_grad_matches_long_double) {
  long double worst = 0;
  int checked_far = 0;
  for (float margin : {-1.f, 0.5f, 3.f, 10.f, 40.f}) {  // -1: the row's own largest logit
    for (bool pivot_is_target : {false, true}) {
      for (float z_loss : {0.f, 1e-3f}) {
        const size_t n = 4000;
        auto z = random_row(n, 1.f);
        size_t a = static_cast<size_t>(std::max_element(z.begin(), z.end()) - z.begin());
        if (margin >= 0.f) {
          a = check::rng()() % n;
          z[a] = *std::max_element(z.begin(), z.end()) + margin;
        }
        size_t t = a;
        while (!pivot_is_target && t == a) t = check::rng()() % n;
        // torch's class weights with label smoothing eps: y_c = w_c (eps / V + (1 - eps) [c = t])
        const float eps = 0.1f;
        std::vector<float> y(n);
        for (size_t j = 0; j < n; ++j) {
          const float w = check::uniform(0.f, 1.f);
          y[j] = w * (eps / static_cast<float>(n) + (j == t ? 1.f - eps : 0.f));
        }
        const flce::SoftRow st = soft_tiles(z, y, 256, false);
        EXPECT(st.a == static_cast<int64_t>(a), "pivot %lld, want %zu", (long long)st.a, a);
        const float g = check::uniform(0.1f, 2.f);
        const float g_lse = z_loss != 0.f ? check::uniform(-1.f, 1.f) : 0.f;
        const float zw = st.y_a + st.y_rest;
        const flce::RowGrad got =
            flce::soft_row_grad(st.x, st.p, st.y_a, st.y_rest, zw, g, g_lse, z_loss);

        const LD div = static_cast<LD>(st.x.s) * std::exp(static_cast<LD>(st.x.m) - st.p) + 1;
        const LD p_a = 1 / div, q_a = 1 - p_a, lse = st.p + std::log(div);
        const LD big_y = static_cast<LD>(st.y_a) + st.y_rest;
        const LD A = g * (big_y + 2 * z_loss * zw * lse) + g_lse;
        const LD want = A * p_a - static_cast<LD>(g) * st.y_a;
        // (A's own terms: g_lse and the z-loss's cancel against g Y where they differ in sign)
        const LD zl_terms = g * 2 * z_loss * zw * std::fabs(lse) + std::fabs(g_lse);
        const LD direct = (g * big_y + zl_terms) * p_a + g * static_cast<LD>(st.y_a);
        const LD safe = zl_terms * p_a + g * (big_y * q_a + st.y_rest);
        const LD tol = 8 * kU * std::min(direct, safe) + 2 * std::numeric_limits<float>::denorm_min();
        EXPECT(near_abs(got.dz_t, want, tol),
               "margin %g target %d z_loss %g: dz_a %.9g, want %.12Lg (%.3Lg relative)", margin,
               (int)pivot_is_target, z_loss, got.dz_t, want, std::fabs(got.dz_t - want) / std::fabs(want));
        worst = std::max(worst, std::fabs(got.dz_t - want) / tol);
        checked_far += !pivot_is_target && margin < 0.f;
      }
    }
  }
  EXPECT(checked_far > 0, "no row with a non-target pivot");
  std::printf("  worst soft pivot gradient error: %.3Lg of the tolerance\n", worst);
}


// ---------------------------------------------------------------------------------------------
// Distillation's row math (flce/math.h "Distillation"; csrc/cpu/distill_cpu.cpp).
// ---------------------------------------------------------------------------------------------

TEST(vexpm1_matches_long_double) {
  // The row math's vectorizable expm1: 3 ulp of expm1 everywhere, relative near 0, where
  // exp(x) - 1 loses everything.
  long double worst = 0;
  std::vector<float> xs = {-80.f, -17.f, -1.f, -0.3466f, -0.3467f, -1e-7f, -1e-30f, 0.f, 1e-30f,
                           1e-7f, 0.3466f, 0.3467f, 1.f, 20.f, 88.f};
  for (float x = -80.f; x <= 88.f; x += 0.0137f) xs.push_back(x);
  for (int i = 0; i < 20000; ++i) xs.push_back(check::uniform(-1.f, 1.f));
  for (int i = 0; i < 2000; ++i) xs.push_back(check::uniform(-1e-4f, 1e-4f));
  int naive_bad = 0;
  for (float x : xs) {
    const float got = flce::vexpm1(x);
    const LD ref = std::expm1(static_cast<LD>(x));
    EXPECT(near_ulps(got, ref, 3), "vexpm1(%.9g) = %.9g, long double %.12Lg (%.2Lg ulp)", x, got,
           ref, check::ulps_off(got, ref));
    worst = std::max(worst, check::ulps_off(got, ref));
    naive_bad += !near_ulps(flce::vexp(x) - 1.f, ref, 3);
  }
  EXPECT(naive_bad > 1000, "exp(x) - 1 should fail near 0 (%d failures)", naive_bad);
  EXPECT(flce::vexpm1(-100.f) == -1.f && flce::vexpm1(-kInf) == -1.f, "expm1(-inf) = -1");
  EXPECT(flce::vexpm1(89.f) == kInf && flce::vexpm1(kInf) == kInf, "expm1(inf) = inf");
  EXPECT(std::isnan(flce::vexpm1(kNaN)), "vexpm1(NaN) must be NaN");
  std::printf("  worst vexpm1 error: %.2Lg ulp\n", worst);
}

TEST(vexp_or_expm1_is_each_function) {
  // mix's one reduction for its two branches: each lane bit for bit vexp's or vexpm1's value,
  // over both clamps, the subnormal range, the overflow and NaN.
  std::vector<float> xs = {-kInf, -200.f, -104.5f, -104.f, -103.9f, -100.f, -87.5f, -80.5f, -80.f,
                           -79.9f, -1e-30f, 0.f, 1e-30f, 88.f, 88.5f, kInf, kNaN};
  for (float x = -110.f; x <= 90.f; x += 0.00731f) xs.push_back(x);
  for (int i = 0; i < 20000; ++i) xs.push_back(check::uniform(-2.f, 2.f));
  auto same = [](float a, float b) {
    return std::memcmp(&a, &b, sizeof(a)) == 0 || (std::isnan(a) && std::isnan(b));
  };
  for (float x : xs) {
    EXPECT(same(flce::vexp_or_expm1(x, false), flce::vexp(x)), "exp(%.9g): %.9g, vexp %.9g", x,
           flce::vexp_or_expm1(x, false), flce::vexp(x));
    EXPECT(same(flce::vexp_or_expm1(x, true), flce::vexpm1(x)), "expm1(%.9g): %.9g, vexpm1 %.9g",
           x, flce::vexp_or_expm1(x, true), flce::vexpm1(x));
  }
}

TEST(vlog1p_matches_long_double) {
  // The row math's vectorizable log1p: 2 ulp of log1p from -1 to huge arguments, relative at
  // tiny ones, where log(1 + x) loses everything.
  long double worst = 0;
  std::vector<float> xs = {std::nextafter(-1.f, 0.f), -0.9999f, -0.5f, -1e-7f, -1e-30f, 0.f,
                           1e-30f, 1e-7f, 0.4142f, 1.f, 3.f, 1e10f, 1e30f, 3e38f};
  for (int i = 0; i < 20000; ++i) xs.push_back(check::uniform(-1.f, 1.f));
  for (int i = 0; i < 2000; ++i) xs.push_back(check::uniform(-1e-5f, 1e-5f));
  for (int i = 0; i < 4000; ++i) xs.push_back(std::exp(check::uniform(-80.f, 85.f)));
  int naive_bad = 0;
  for (float x : xs) {
    const float got = flce::vlog1p(x);
    const LD ref = std::log1p(static_cast<LD>(x));
    EXPECT(near_ulps(got, ref, 2), "vlog1p(%.9g) = %.9g, long double %.12Lg (%.2Lg ulp)", x, got,
           ref, check::ulps_off(got, ref));
    worst = std::max(worst, check::ulps_off(got, ref));
    naive_bad += !near_ulps(std::log(1.f + x), ref, 2);
  }
  EXPECT(naive_bad > 1000, "log(1 + x) should fail near 0 (%d failures)", naive_bad);
  EXPECT(flce::vlog1p(-1.f) == -kInf, "log1p(-1) = -inf");
  EXPECT(std::isnan(flce::vlog1p(-1.5f)) && std::isnan(flce::vlog1p(-kInf)), "log1p(< -1) NaN");
  EXPECT(flce::vlog1p(kInf) == kInf, "log1p(inf) = inf");
  EXPECT(std::isnan(flce::vlog1p(kNaN)), "vlog1p(NaN) must be NaN");
  std::printf("  worst vlog1p error: %.2Lg ulp\n", worst);
}

namespace {
// mix(x, w) = log((1 - w) + w e^x), w = sigmoid(y), in long double.
LD mix_ld(LD x, LD y) {
  const LD w = sigmoid_ld(y);
  if (std::fabs(x) <= 1) return std::log1p(w * std::expm1(x));
  return logaddexp_ld(-softplus_ld(y), x - softplus_ld(-y));
}
}  // namespace

TEST(mix_matches_long_double) {
  // JSD's log mixture ratio in fp32 and fp64: a few roundings of the result, plus the rounding
  // of x + log w in the far branch (the inputs' scale); w near 0 and 1 (|y| up to 40) lose
  // nothing.
  long double worst = 0, worst64 = 0;
  for (int i = 0; i < 40000; ++i) {
    const float x = i % 4 == 0 ? check::uniform(-1.f, 1.f)
                               : (i % 4 == 1 ? check::uniform(-1e-4f, 1e-4f)
                                             : check::uniform(-60.f, 60.f));
    const float y = i % 3 == 0 ? check::uniform(-40.f, 40.f) : check::uniform(-3.f, 3.f);
    const LD ref = mix_ld(x, y);
    const float got = flce::mix(x, flce::mix_row(y));
    const LD tol = 6 * kU * std::fabs(ref) + 2 * kU * (std::fabs(x) > 1 ? std::fabs(x) : 0) +
                   2 * kU * (std::fabs(x) > 1 ? softplus_ld(-y) : 0) +
                   std::numeric_limits<float>::denorm_min();
    EXPECT(near_abs(got, ref, tol), "mix(%.9g, y=%.9g) = %.9g, long double %.12Lg", x, y, got,
           ref);
    worst = std::max(worst, std::fabs(got - ref) / tol);
    const double got64 = flce::mix(static_cast<double>(x), flce::mix_row(static_cast<double>(y)));
    const LD tol64 = tol * 0x1p-29L;
    EXPECT(std::fabs(got64 - ref) <= tol64, "fp64 mix(%.9g, y=%.9g) = %.17g, long double %.17Lg",
           x, y, got64, ref);
    worst64 = std::max(worst64, std::fabs(got64 - ref) / tol64);
  }
  // a small argument: log1p(w expm1(x)) keeps relative accuracy where log((1-w) + w e^x) in
  // fp32 rounds to 0 or to a multiple of 2^-24
  const float x = 3e-6f, y = 0.3f;
  const LD ref = mix_ld(x, y);
  EXPECT(near_ulps(flce::mix(x, flce::mix_row(y)), ref, 6), "mix(3e-6, 0.3)");
  const float w = 1.f / (1.f + std::exp(-y));
  const float naive = std::log((1.f - w) + w * std::exp(x));
  EXPECT(!near_ulps(naive, ref, 6), "naive mix should fail at x = 3e-6 (%.9g vs %.12Lg)", naive,
         ref);
  EXPECT(std::isnan(flce::mix(kNaN, flce::mix_row(0.5f))), "mix(NaN) must be NaN");
  EXPECT(flce::mix(kInf, flce::mix_row(0.5f)) == kInf, "mix(inf) = inf");
  EXPECT(near_ulps(flce::mix(-kInf, flce::mix_row(0.5f)), -softplus_ld(0.5L), 2),
         "mix(-inf) = log(1 - w)");
  std::printf("  worst mix error: %.2Lg (fp32), %.2Lg (fp64) of the tolerance\n", worst, worst64);
}

TEST(distill_kl_is_collapse_safe) {
  // KL(P || R) of two confident rows from the header's pieces as the CPU row math assembles it
  // (dominant, dominant_log_p, KL = r_a + sum_{j != a} P_j rrel_j, kl_grad), against long double
  // at margins 0..100 where both share the dominant class: the KL within 1e-5 relative, and the
  // gradient at the dominant class, -P_a c, within a few roundings of its terms; log-softmax
  // differences lose the KL from margin 20 on.
  const int v = 50;
  int naive_bad = 0;
  for (int margin = 0; margin <= 100; margin += 5) {
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<float> p(v), r(v);
      for (int j = 0; j < v; ++j) p[j] = check::normal(), r[j] = check::normal();
      const int a = rep % v;
      p[a] += static_cast<float>(margin);
      r[a] += static_cast<float>(margin) * check::uniform(1.f, 1.1f);
      auto stats = [&](const std::vector<float>& u) {
        float s = 0.f;
        for (int j = 0; j < v; ++j) s += j == a ? 0.f : flce::vexp(u[j] - u[a]);
        return flce::dominant(s);
      };
      const flce::Dominant<float> dp = stats(p), dr = stats(r);
      const float r_a =
          flce::dominant_log_p(p[a], p[a], dp.l) - flce::dominant_log_p(r[a], r[a], dr.l);
      float c = 0.f;
      for (int j = 0; j < v; ++j) {
        const float rrel = (p[j] - p[a]) - (r[j] - r[a]);
        c += j == a ? 0.f : flce::vexp(flce::dominant_log_p(p[j], p[a], dp.l)) * rrel;
      }
      const float kl = r_a + c;
      const float g_a = flce::kl_grad(1.f - dp.e, 0.f, flce::KlCenter<float>{c, 0.f});
      // long double
      LD sp = 0, sr = 0;
      for (int j = 0; j < v; ++j) {
        if (j == a) continue;
        sp += std::exp(static_cast<LD>(p[j]) - p[a]);
        sr += std::exp(static_cast<LD>(r[j]) - r[a]);
      }
      LD want = 0, c_ld = 0, c_abs = 0;
      for (int j = 0; j < v; ++j) {
        const LD lp = (static_cast<LD>(p[j]) - p[a]) - std::log1p(sp);
        const LD lr = (static_cast<LD>(r[j]) - r[a]) - std::log1p(sr);
        want += std::exp(lp) * (lp - lr);
        const LD term = std::exp(lp) * ((static_cast<LD>(p[j]) - p[a]) - (r[j] - r[a]));
        if (j != a) c_ld += term, c_abs += std::fabs(term);
      }
      const LD g_want = -c_ld / (1 + sp);
      if (std::fabs(want) > std::numeric_limits<float>::min()) {
        EXPECT(std::fabs(kl - want) <= 1e-5L * std::fabs(want),
               "margin %d: KL %.9g, long double %.12Lg", margin, kl, want);
        // (c's terms have both signs: a few roundings of their magnitudes' sum, at the logits'
        // scale, whose differences u_j - u_a carry |u| 2^-24)
        const LD scale = 1 + std::fabs(static_cast<LD>(p[a])) + std::fabs(static_cast<LD>(r[a]));
        EXPECT(std::fabs(g_a - g_want) <= 1e-5L * std::fabs(g_want) + 4 * kU * scale * c_abs + 1e-44L,
               "margin %d: gradient at a %.9g, long double %.12Lg", margin, g_a, g_want);
      }
      // the textbook form: log-softmax through the fp32 logsumexp
      float mp = p[a], mr = r[a], lsp = 0.f, lsr = 0.f;
      for (int j = 0; j < v; ++j) lsp += std::exp(p[j] - mp), lsr += std::exp(r[j] - mr);
      float naive = 0.f;
      for (int j = 0; j < v; ++j) {
        const float lp = p[j] - (mp + std::log(lsp)), lr = r[j] - (mr + std::log(lsr));
        naive += std::exp(lp) * (lp - lr);
      }
      naive_bad += margin >= 30 && !(std::fabs(naive - want) <= 1e-5L * std::fabs(want));
    }
  }
  EXPECT(naive_bad > 50, "the textbook KL should fail at margins >= 30 (%d failures)", naive_bad);
}

TEST(distill_kl_grad_row_sums_to_zero) {
  // A KL gradient's row P_j (rrel_j - c) sums to 0 exactly; assembled from fp32 probabilities
  // (dominant, vexp), whose sum misses 1 by a few roundings, it sums to c (1 - sum_j p_j) unless
  // c is divided by that sum, and to c's rounding unless c is held in two parts (kl_center).
  // Flat rows (V = 1024) whose distributions differ at the dominant class (c of order 1, the
  // entries far smaller, as Liger's uniform inputs make them): the sum within 2 roundings of the
  // row's sum_j |g_j| in long double, where an undivided c, or c rounded once, misses that in
  // more than half of the rows.
  const int v = 1024, rows = 200;
  int bad_undivided = 0, bad_rounded = 0;
  LD worst = 0;
  for (int rep = 0; rep < rows; ++rep) {
    std::vector<float> p(v), r(v);
    for (int j = 0; j < v; ++j) p[j] = check::normal(0.5f), r[j] = p[j] + check::normal(0.05f);
    const int a = static_cast<int>(std::max_element(p.begin(), p.end()) - p.begin());
    r[a] += check::uniform(-1.f, 1.f);
    float sp = 0.f;
    for (int j = 0; j < v; ++j) sp += j == a ? 0.f : flce::vexp(p[j] - p[a]);
    const flce::Dominant<float> dp = flce::dominant(sp);
    std::vector<float> pj(v), rrel(v);
    double c = 0, n = 0;
    for (int j = 0; j < v; ++j) {
      pj[j] = flce::vexp(flce::dominant_log_p(p[j], p[a], dp.l));
      rrel[j] = (p[j] - p[a]) - (r[j] - r[a]);
      c += j == a ? 0.0 : static_cast<double>(pj[j]) * rrel[j];
      n += pj[j];
    }
    // the row sum in long double, in roundings of sum_j |g_j|
    auto row_sum = [&](const flce::KlCenter<float>& k) {
      LD sum = 0, mag = 0;
      for (int j = 0; j < v; ++j) {
        const float g = flce::kl_grad(pj[j], rrel[j], k);
        sum += g, mag += std::fabs(static_cast<LD>(g));
      }
      return std::fabs(sum) / (kU * mag);
    };
    const LD got = row_sum(flce::kl_center<float>(c, n));
    EXPECT(got <= 2, "row %d: sum %.3Lg roundings of sum |g|", rep, got);
    worst = std::max(worst, got);
    bad_undivided += !(row_sum(flce::KlCenter<float>{static_cast<float>(c), 0.f}) <= 2);
    bad_rounded += !(row_sum(flce::KlCenter<float>{static_cast<float>(c / n), 0.f}) <= 2);
  }
  EXPECT(bad_undivided > rows / 4 && bad_rounded > rows / 4,
         "an undivided c (%d rows) and c rounded once (%d) should often miss the bound",
         bad_undivided, bad_rounded);
  std::printf("  worst row sum: %.2Lg roundings of sum |g|; out of bound in %d (undivided c) and "
              "%d (c rounded once) of %d rows\n", worst, bad_undivided, bad_rounded, rows);
}

TEST(distill_hard_grad) {
  // p_j off the target; p_t - 1 as -e where the target is the dominant class.
  EXPECT(flce::hard_grad(0.25f, false, true, 1e-20f) == 0.25f, "off-target: p");
  EXPECT(flce::hard_grad(0.25f, true, false, 0.f) == -0.75f, "target: p - 1");
  EXPECT(flce::hard_grad(1.f, true, true, 1e-20f) == -1e-20f, "dominant target: -e");
  const flce::Dominant<double> d = flce::dominant(1e-30);
  EXPECT(d.e == 1e-30 / (1 + 1e-30) && d.l == std::log1p(1e-30), "dominant(1e-30)");
}

int main(int argc, char** argv) { return check::run_all(argc, argv); }
