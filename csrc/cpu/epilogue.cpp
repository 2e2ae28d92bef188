#include "cpu/epilogue.h"

#include <cmath>
#include <cstring>

#include "flce/math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLCE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FLCE_CLONES
#endif

namespace flce::cpu {

FLCE_CLONES float row_max(const float* z, int64_t n) {
  float m = neg_inf();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = z[j] > m ? z[j] : m;
  return m;
}

FLCE_CLONES float row_sum_exp(const float* z, int64_t n, float m, float* u) {
  float s = 0.f, v = 0.f;
#pragma omp simd reduction(+ : s, v)
  for (int64_t j = 0; j < n; ++j) {
    const float e = vexp(z[j] - m);
    s += e;
    // A -inf logit (masked, or the target masked in place) adds 0 to both (0 * inf is NaN).
    v += z[j] == neg_inf() ? 0.f : e * (m - z[j]);
  }
  *u = v;
  return s;
}

FLCE_CLONES float row_sum_exp(const float* z, int64_t n, float m) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += vexp(z[j] - m);
  return s;
}

FLCE_CLONES float row_sum(const float* z, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += z[j];
  return s;
}

FLCE_CLONES void row_grad_fill(float* z, int64_t n, const RowGrad& rg, float cap, float temp) {
  if (temp != 1.f) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) z[j] = logit_grad(rg, z[j]) * logit_transform_grad(z[j], cap, temp);
  } else if (cap > 0.f) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) z[j] = logit_grad(rg, z[j]) * softcap_grad(z[j], cap);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) z[j] = logit_grad(rg, z[j]);
  }
}

namespace {
// row_soft_fold's sums over columns [0, n), added into out.
inline void soft_fold_range(const float* z, const float* y, int64_t n, float p, float* out) {
  float s = 0.f, u = 0.f, ys = 0.f, gs = 0.f;
#pragma omp simd reduction(+ : s, u, ys, gs)
  for (int64_t j = 0; j < n; ++j) {
    const float e = vexp(z[j] - p);
    s += e;
    u += e == 0.f ? 0.f : e * (p - z[j]);
    ys += y[j];
    gs += soft_gap_term(y[j], p, z[j]);
  }
  out[0] += s;
  out[1] += u;
  out[2] += ys;
  out[3] += gs;
}
}  // namespace

// (the pivot's column left out by the two ranges around it, not by a compare per column)
FLCE_CLONES void row_soft_fold(const float* z, const float* y, int64_t n, int64_t a, float p,
                               float* out) {
  out[0] = out[1] = out[2] = out[3] = 0.f;
  soft_fold_range(z, y, a, p, out);
  soft_fold_range(z + a + 1, y + a + 1, n - a - 1, p, out);
}

FLCE_CLONES void row_soft_grad_fill(float* z, const float* y, int64_t n, const RowGrad& rg,
                                    float cap, float temp) {
  // (the transforms' cases apart, as row_grad_fill: a loop without them vectorizes)
  if (temp != 1.f) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      z[j] = soft_logit_grad(rg, z[j], y[j]) * logit_transform_grad(z[j], cap, temp);
    }
  } else if (cap > 0.f) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) z[j] = soft_logit_grad(rg, z[j], y[j]) * softcap_grad(z[j], cap);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) z[j] = soft_logit_grad(rg, z[j], y[j]);
  }
}

void row_bias_softcap(float* z, const float* bias, int64_t n, float cap, float temp) {
  if (bias) {
    for (int64_t j = 0; j < n; ++j) z[j] += bias[j];
  }
  if (cap > 0.f || temp != 1.f) {
    for (int64_t j = 0; j < n; ++j) z[j] = logit_transform(z[j], cap, temp);
  }
}

FLCE_CLONES void row_split_bf16(const float* g, uint16_t* hi, uint16_t* lo, int64_t n,
                                float scale) {
  if (lo == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) hi[j] = bf16_bits(g[j] * scale);
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float x = g[j] * scale;
    const uint16_t h = bf16_bits(x);
    hi[j] = h;
    lo[j] = bf16_bits(x - bf16_value(h));
  }
}

FLCE_CLONES float row_absmax(const float* z, int64_t n) {
  float m = 0.f;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::fabs(z[j]) > m ? std::fabs(z[j]) : m;
  return m;
}

// (The conversions are cloned as the math is: given logits are read and written through them,
// and the baseline x86-64 build converts 4 values per instruction where AVX-512 converts 16.)
FLCE_CLONES void row_scale(float* out, const void* x, Dtype dtype, int64_t n, float alpha) {
  if (dtype == Dtype::f32) {
    const float* xf = static_cast<const float*>(x);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = alpha * xf[j];
  } else if (dtype == Dtype::bf16) {
    const uint16_t* xb = static_cast<const uint16_t*>(x);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = alpha * bf16_value(xb[j]);
  } else {
    const _Float16* xh = static_cast<const _Float16*>(x);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = alpha * static_cast<float>(xh[j]);
  }
}

FLCE_CLONES void row_kahan_add(float* s, uint16_t* c, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) kahan_add_bf16c(s[j], c[j], x[j]);
}

FLCE_CLONES void row_add_bf16(float* s, const uint16_t* c, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = kahan_result(s[j], bf16_value(c[j]));
}

FLCE_CLONES void row_kahan_add_pair(float* s, uint16_t* c, const float* xs, const uint16_t* xc,
                                    int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    kahan_add_bf16c(s[j], c[j], xs[j]);
    kahan_add_bf16c(s[j], c[j], bf16_value(xc[j]));
  }
}

FLCE_CLONES void row_store(const float* x, void* out, Dtype dtype, int64_t n) {
  if (dtype == Dtype::f32) {
    std::memcpy(out, x, n * sizeof(float));
  } else if (dtype == Dtype::bf16) {
    uint16_t* o = static_cast<uint16_t*>(out);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[j] = bf16_bits(x[j]);
  } else {
    _Float16* o = static_cast<_Float16*>(out);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[j] = static_cast<_Float16>(x[j]);
  }
}

}  // namespace flce::cpu
