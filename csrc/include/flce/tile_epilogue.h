// flce/tile_epilogue.h: the arithmetic of the fused logits path (FLCE_CUDA_FUSED_LOGITS=1), once,
// for the CUTLASS kernel's epilogue (csrc/cuda/sm90), its SIMT stand-in (csrc/cuda/flce_fused.cu)
// and the host tests (tests/cpp/test_tile_epilogue.cpp). Torch-free, header-only, like math.h.
//
// The logits GEMM's epilogue sees the fp32 accumulators acc of one (row, column tile) of
// z = x . w^T and keeps none of them:
//   z_j = softcap(acc_j + b_j) / T            (math.h logit_transform)
//   m   = max of the tile's non-target z_j    (fmaxf: NaN skipped; -inf when there is none)
//   r   = m, or 0 when m = -inf               (the tile's reference, epi_ref)
//   E_j = exp(z_j - r) for non-target j, 0 at the target column
//   s   = sum of the fp32 E_j, before anything is rounded (the loss keeps fp32 accuracy)
//   z_t = the target's logit where the tile holds it, else -inf
//   stored: E_j c_j in the gradient's dtype, one value per logit, with c_j = softcap'(z_j), the
//         chain rule's factor that needs z_j (1 without softcap): each <= 1, no overflow
//         whatever the logits' range (epi_stored)
// and stores the partial (m, s, z_t, 0, 0) in partial_stats' format (math.h OnlineLse with u =
// 0: the path returns no entropy; sum_z = 0: label smoothing takes the exact path). r = 0 for an
// empty tile keeps -inf - -inf out of E and s (exp(-inf) = 0), as the row kernels do; a NaN
// logit makes its E and s NaN.
//
// The gradient pass turns the stored values into dz in place, per (row, tile) from the row's
// coefficients (math.h RowGrad, from the merged statistics) and the tile's m:
//   f    = a exp(r - ref) rdiv                 (epi_grad_factor; 0 for an empty tile)
//   dz_j = f (E_j c_j) / T  for non-target j    (epi_logit_grad, with u = 0)
//   dz_t = dz_t c_t / T at the target column    (the collapse-safe entry from the fp32 z_t)
// which is math.h's (a exp(z_j - ref) rdiv - u) logit_transform_grad(z_j) with exp(z_j - ref)
// split as exp(z_j - r) exp(r - ref), r <= ref (ref is the row's max, r a max of some of its
// columns): f <= a rdiv, no overflow. (u = g eps / V is label smoothing's term; the kernels take
// it, but the path keeps smoothing on the exact one, below.)
//
// Accuracy (docs/numerics.md "Fused logits"): the stored E_j carries one rounding to the
// gradient's dtype (relative 2^-8 in bf16, its unit roundoff), and dz_j a second one when it is
// stored: |dz_j - exact| <= (2 * 2^-8 + 2^-16 + a few 2^-24) |dz_j| with u = 0, one bf16 ulp
// where the exact path has half of one. With u != 0 (label smoothing) f E_j - u cancels and E's
// rounding is not bounded relative to dz_j: smoothing keeps the exact path. (With softcap and
// u != 0 the chain rule would also need c_j apart from E_j: u c_j.)
#pragma once

#include "flce/math.h"

namespace flce {

// One thread's share of one (row, tile) in the epilogue's first step, and the merge of the
// shares of one row (a quad of a WGMMA fragment, a warp of the stand-in): m over the non-target
// values, z_t where the share holds the target column.
struct EpiRow {
  float m;
  float zt;
};

FLCE_HD EpiRow epi_row_empty() { return EpiRow{neg_inf(), neg_inf()}; }

// One logit z of the share; is_target at the target column.
FLCE_HD void epi_see(EpiRow& r, float z, bool is_target) {
  if (is_target) {
    r.zt = z;
  } else {
    r.m = fmaxf(r.m, z);
  }
}

// Symmetric in its arguments (a butterfly's partners compute the same value): at most one share
// holds the target column, the others have z_t = -inf; a NaN z_t wins either way.
FLCE_HD EpiRow epi_merge(EpiRow a, EpiRow b) {
  return EpiRow{fmaxf(a.m, b.m), b.zt != neg_inf() ? b.zt : a.zt};
}

// The column of target t within the tile [col0, col0 + cols) of a shard of v columns whose first
// is vocabulary id col_offset, or -1: an ignored row, or a target outside the tile (targets are
// compared, never used as an index).
FLCE_HD int epi_tile_target(int64_t t, int64_t ignore_index, int64_t col_offset, int64_t v,
                            int64_t col0, int cols) {
  const int64_t c = t - col_offset;
  if (t == ignore_index || c < 0 || c >= v || c < col0 || c >= col0 + cols) return -1;
  return static_cast<int>(c - col0);
}

// The tile's reference r: its max, or 0 when it has no non-target logit above -inf.
FLCE_HD float epi_ref(float m) { return m == neg_inf() ? 0.f : m; }

// The stored value of one logit z: exp(z - r), 0 at the target column. -inf logits (columns
// masked by the bias) give 0.
FLCE_HD float epi_exp(float z, float ref, bool is_target) {
  return is_target ? 0.f : vexp(z - ref);
}

// The logit of one accumulator: the bias (0: none), softcap (<= 0: none) and temperature.
FLCE_HD float epi_logit(float acc, float bias, float softcap, float temperature) {
  return logit_transform(acc + bias, softcap, temperature);
}

// The stored value of a non-target logit z with its E = exp(z - r): E c, c = softcap'(z) (the
// chain rule's factor of math.h logit_transform_grad but its 1 / T, which the gradient pass
// applies); E itself without softcap.
FLCE_HD float epi_stored(float e, float z, float softcap, float temperature) {
  if (!(softcap > 0.f)) return e;
  return e * softcap_grad(temperature == 1.f ? z : z * temperature, softcap);
}

// The partial of one (row, tile) in partial_stats' format (m, s, z_t, sum_z, u).
FLCE_HD void epi_store_partial(float* q, float m, float s, float zt) {
  q[0] = m;
  q[1] = s;
  q[2] = zt;
  q[3] = 0.f;
  q[4] = 0.f;
}

// ---------------------------------------------------------------------------------------------
// The gradient pass.
// ---------------------------------------------------------------------------------------------

// f of one (row, tile) with maximum m: dz_j = epi_logit_grad(f, E_j, ...) for its non-target
// columns. An empty tile (m = -inf) stored E = 0 and gets f = 0 (exp(0 - ref) could overflow).
FLCE_HD float epi_grad_factor(const RowGrad& g, float m) {
  if (m == neg_inf()) return 0.f;
  return g.a * (vexp(m - g.ref) * g.rdiv);
}

// dz of one non-target column from its stored value (epi_stored), with the temperature's chain
// rule (1 / T).
FLCE_HD float epi_logit_grad(float f, float stored, float u, float inv_temperature) {
  return (f * stored - u) * inv_temperature;
}

// dz of the target column: the row's collapse-safe dz_t times the chain rule at the fp32 z_t.
FLCE_HD float epi_target_grad(float dz_t, float z_t, float softcap, float temperature) {
  return dz_t * logit_transform_grad(z_t, softcap, temperature);
}

}  // namespace flce
