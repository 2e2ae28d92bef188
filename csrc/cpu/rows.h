// The CPU backend's per-row statistics, shared by the fused linear ops (flce_cpu.cpp) and
// cross-entropy on given logits (logits_cpu.cpp): a row's running state over its tiles, the
// fold of one fp32 tile row into it, target columns and checks, and combine.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "cpu/epilogue.h"
#include "flce/math.h"
#include "flce_ops.h"

namespace flce::cpu {

inline bool row_ignored(int64_t t, int64_t ignore_index) { return t == ignore_index; }

// A row's running statistics over the tiles of a shard.
struct RowState {
  OnlineLse lse = lse_empty();  // over non-target logits
  float z_t = neg_inf();        // target logit, where this shard holds it
  float sum_z = 0.f, sum_c = 0.f;  // Kahan sum of all logits (label smoothing)
  float sum() const { return kahan_result(sum_z, sum_c); }
  // Append the statistics of a later vocabulary range: only the range that holds the target
  // has its logit (NaN passes through).
  void merge(const RowState& b) {
    lse = lse_merge(lse, b.lse);
    if (b.z_t != neg_inf()) z_t = b.z_t;
    kahan_add(sum_z, sum_c, b.sum());
  }
  // The partial_stats row (m, s, z_t, sum_z, u).
  void store(float* p) const {
    p[0] = lse.m;
    p[1] = lse.s;
    p[2] = z_t;
    p[3] = sum();
    p[4] = lse.u;
  }
};

// Fold one tile row (bv logits; the target at column tl, or tl outside [0, bv)) into st. The
// row is scratch: the target is masked out of (max, sum exp) in place, then restored.
// loss_only: the caller needs the loss alone and no label smoothing (the single pass without
// it): the entropy's u and the sum of logits stay 0, and the row takes two vector passes (max,
// sum of exponentials) instead of three (the sum of logits) with the entropy's product in one.
inline void fold_row(float* row, int64_t bv, int64_t tl, RowState& st, bool loss_only = false) {
  const bool has_t = tl >= 0 && tl < bv;
  float z_target = 0.f;
  if (has_t) {
    z_target = row[tl];
    row[tl] = neg_inf();
    st.z_t = z_target;
  }
  const float mx = row_max(row, bv);
  // An all -inf tile (only the target, or -inf logits) adds nothing: exp(-inf - -inf) is NaN.
  float u = 0.f;
  const float s = mx == neg_inf() ? 0.f
                  : loss_only     ? row_sum_exp(row, bv, mx)
                                  : row_sum_exp(row, bv, mx, &u);
  lse_add_tile(st.lse, mx, s, u);
  if (has_t) row[tl] = z_target;
  if (!loss_only) kahan_add(st.sum_z, st.sum_c, row_sum(row, bv));
}

// The target's column in the shard, or -1 for an ignored row.
inline int64_t shard_col(int64_t t, int64_t vocab_start, int64_t ignore_index) {
  return row_ignored(t, ignore_index) ? -1 : t - vocab_start;
}

inline void check_targets(const int64_t* t, int64_t n, int64_t vocab_size, int64_t ignore_index) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(t[i] == ignore_index || (t[i] >= 0 && t[i] < vocab_size),
                      "flce: target[", i, "] = ", t[i], " is out of range for a vocabulary of ",
                      vocab_size, " (and is not ignore_index = ", ignore_index, ")");
  }
}

// flce::combine on the CPU (flce_cpu.cpp).
Tensor4 combine_cpu(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                    int64_t ignore_index, double label_smoothing, double z_loss);

}  // namespace flce::cpu
