// Per-row epilogue loops of the CPU backend. Each is compiled for AVX-512, AVX2 and baseline
// x86-64 (GCC target_clones, picked at load time by the CPU's features) and vectorized with
// `omp simd`; the math comes from flce/math.h. Reductions are in a fixed order for a given
// machine, so results are bitwise reproducible run to run.
#pragma once

#include <cstdint>

#include "flce/math.h"

namespace flce::cpu {

// max_j z[j]; -inf for n = 0.
float row_max(const float* z, int64_t n);
// sum_j exp(z[j] - m) (vexp), and in *u the entropy's sum_j exp(z[j] - m) (m - z[j]) (-inf
// logits add nothing to either).
float row_sum_exp(const float* z, int64_t n, float m, float* u);
// sum_j exp(z[j] - m) alone.
float row_sum_exp(const float* z, int64_t n, float m);
// sum_j z[j].
float row_sum(const float* z, int64_t n);
// z[j] <- logit_grad(rg, z[j]) * dz/du(z[j]): the non-target gradient of a row (softcap and
// temperature chain rule).
void row_grad_fill(float* z, int64_t n, const RowGrad& rg, float cap, float temp);
// A target distribution's tile row with pivot column a (its largest logit p = z[a]), over the
// other columns j != a: out = {sum exp(z[j] - p), the entropy's sum exp(z[j] - p) (p - z[j]),
// sum y[j], sum soft_gap_term(y[j], p, z[j])} (math.h SoftRow's x.s, x.u, y_rest, g; -inf logits
// add 0 to the first two). p must be finite.
void row_soft_fold(const float* z, const float* y, int64_t n, int64_t a, float p, float* out);
// z[j] <- soft_logit_grad(rg, z[j], y[j]) * dz/du(z[j]): a target distribution's non-pivot
// gradient.
void row_soft_grad_fill(float* z, const float* y, int64_t n, const RowGrad& rg, float cap,
                        float temp);
// z[j] <- softcap(z[j] + bias[j]) / temp (bias may be null, cap <= 0 disables the softcap,
// temp = 1 the temperature).
void row_bias_softcap(float* z, const float* bias, int64_t n, float cap, float temp);
// scale * g = hi + lo with hi, lo bfloat16 (bit patterns), round to nearest even; lo null:
// hi = scale * g rounded once.
void row_split_bf16(const float* g, uint16_t* hi, uint16_t* lo, int64_t n, float scale);
// max_j |z[j]| (NaN-blind; 0 for n = 0).
float row_absmax(const float* z, int64_t n);
enum class Dtype { f32, bf16, f16 };

// out[j] = alpha * x[j] for a row x stored as dtype.
void row_scale(float* out, const void* x, Dtype dtype, int64_t n, float alpha);
// (s, c) += x elementwise with Neumaier compensation, c stored in bf16 (kahan_add_bf16c).
void row_kahan_add(float* s, uint16_t* c, const float* x, int64_t n);
// s[j] += c[j] for bf16 c: a compensated sum's result (kahan_result).
void row_add_bf16(float* s, const uint16_t* c, int64_t n);
// (s, c) += (xs, xc) elementwise: another accumulator's sum and bf16 compensation, each added
// with kahan_add_bf16c.
void row_kahan_add_pair(float* s, uint16_t* c, const float* xs, const uint16_t* xc, int64_t n);
// out[j] = x[j] rounded (to nearest even) to dtype.
void row_store(const float* x, void* out, Dtype dtype, int64_t n);

}  // namespace flce::cpu
