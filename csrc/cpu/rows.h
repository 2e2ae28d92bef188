// The CPU backend's per-row statistics, shared by the fused linear ops (flce_cpu.cpp) and
// cross-entropy on given logits (logits_cpu.cpp): a row's running state over its tiles, the
// fold of one fp32 tile row into it, target columns and checks, and combine.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

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
  // return_predicted_tokens: the global column of the largest non-target logit folded so far
  // (the first of equals, as torch.argmax), kArgNone while no non-target column has been
  // folded, kArgNaN for good once a non-target logit is NaN (torch.argmax would take the first
  // NaN; flce gives those rows -1). merge() and the partials do not carry it: one shard's
  // forward returns it beside them.
  static constexpr int64_t kArgNone = -1, kArgNaN = -2;
  int64_t arg = kArgNone;
  float arg_max = neg_inf();
  float sum() const { return kahan_result(sum_z, sum_c); }
  // Fold a tile (its target masked; col0: its first global column) into arg, given its largest
  // logit mx (row_max skips NaN) and its sum of exponentials s (NaN where the tile holds a NaN
  // or a +inf: only then is it scanned for a NaN). Tiles come in column order, so the column
  // moves only to a strictly larger mx: an equal later one keeps the earlier, lower column.
  // After the row's first tiles the scan for mx is rare.
  void track_argmax(const float* row, int64_t bv, float mx, float s, int64_t col0) {
    if (arg == kArgNaN) return;
    if (std::isnan(s)) {
      for (int64_t j = 0; j < bv; ++j) {
        if (std::isnan(row[j])) {
          arg = kArgNaN;
          return;
        }
      }
    }
    if (arg >= 0 && !(mx > arg_max)) return;
    for (int64_t j = 0; j < bv; ++j) {
      if (row[j] == mx) {
        arg = col0 + j;
        arg_max = mx;
        return;
      }
    }
  }
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
// arg_col0 >= 0: the tile's first global column, and the row's argmax is tracked
// (RowState::track_argmax).
inline void fold_row(float* row, int64_t bv, int64_t tl, RowState& st, bool loss_only = false,
                     int64_t arg_col0 = -1) {
  const bool has_t = tl >= 0 && tl < bv;
  float z_target = 0.f;
  if (has_t) {
    z_target = row[tl];
    row[tl] = neg_inf();
    st.z_t = z_target;
  }
  const float mx = row_max(row, bv);
  // A tile without a logit above -inf (only the target, -inf logits, or NaN, which the max
  // skips) takes its exponents against 0, as the CUDA row kernels do: -inf adds exp(-inf) = 0
  // (not exp(-inf - -inf) = NaN) and a NaN stays in the sum.
  const float ref = mx == neg_inf() ? 0.f : mx;
  float u = 0.f;
  const float s = loss_only ? row_sum_exp(row, bv, ref) : row_sum_exp(row, bv, ref, &u);
  lse_add_tile(st.lse, mx, s, u);
  if (arg_col0 >= 0) st.track_argmax(row, bv, mx, s, arg_col0);
  if (has_t) row[tl] = z_target;
  if (!loss_only) kahan_add(st.sum_z, st.sum_c, row_sum(row, bv));
}

// The target weights y_c of a target distribution (math.h SoftRow) on a shard's columns:
// y = w (alpha q + beta), with q a row of probabilities [N, V_local] (row stride ldq) or the
// one-hot of a class target (global ids; an ignored row has y = 0), w the shard's class weights
// or 1.
struct SoftTargets {
  const void* q = nullptr;  // probabilities, or null: class targets t
  Dtype q_dtype = Dtype::f32;
  int64_t ldq = 0;
  const int64_t* t = nullptr;
  int64_t ignore_index = -100;
  const float* w = nullptr;  // [V_local] or null
  float alpha = 1.f, beta = 0.f;
  int64_t vocab_start = 0;

  // y of row i on shard columns [v0, v0 + n): the probabilities themselves where they are fp32
  // and nothing transforms them, else written into scratch.
  const float* row(int64_t i, int64_t v0, int64_t n, float* scratch) const {
    if (q && q_dtype == Dtype::f32 && alpha == 1.f && beta == 0.f && !w) {
      return static_cast<const float*>(q) + i * ldq + v0;
    }
    fill(i, v0, n, scratch);
    return scratch;
  }

  // y of row i on shard columns [v0, v0 + n) into y.
  void fill(int64_t i, int64_t v0, int64_t n, float* y) const {
    if (q) {
      const int64_t size = q_dtype == Dtype::f32 ? 4 : 2;
      row_scale(y, static_cast<const char*>(q) + (i * ldq + v0) * size, q_dtype, n, alpha);
      if (beta != 0.f) {
        for (int64_t j = 0; j < n; ++j) y[j] += beta;
      }
    } else {
      const bool ign = row_ignored(t[i], ignore_index);
      for (int64_t j = 0; j < n; ++j) y[j] = ign ? 0.f : beta;
      const int64_t c = t[i] - vocab_start - v0;
      if (!ign && c >= 0 && c < n) y[c] += alpha;
    }
    if (w) {
      for (int64_t j = 0; j < n; ++j) y[j] *= w[v0 + j];
    }
  }
};

// Fold one tile row (bv logits with target weights y, column 0 being vocabulary id col0) into a
// target distribution's state: the tile's pivot is its largest logit (the first of equals); the
// other logits go into an OnlineLse taken against the pivot (m = p: a reference >= every one of
// them, which lse_merge and row_grad take as they take a max), with the entropy's sum, and their
// y into y_rest and G, in one pass (row_soft_fold). A tile of -inf logits only (or NaN) has
// pivot p = -inf and adds its y to y_rest against it (soft_merge then adds its G term).
inline void fold_soft_row(const float* row, const float* y, int64_t bv, int64_t col0,
                          SoftRow& st) {
  if (bv == 0) return;
  const float mx = row_max(row, bv);
  int64_t a = 0;
  while (a + 1 < bv && !(row[a] == mx)) ++a;
  const float p = row[a];
  float sums[4] = {0.f, 0.f, 0.f, 0.f};
  if (p == neg_inf()) {
    for (int64_t j = 0; j < bv; ++j) sums[2] += j == a ? 0.f : y[j];
    // (every logit -inf, or NaN ones row_max skipped: the NaN reaches s through the sum)
    for (int64_t j = 0; j < bv; ++j) sums[0] += row[j] == row[j] ? 0.f : row[j];
  } else {
    row_soft_fold(row, y, bv, a, p, sums);
  }
  const OnlineLse x = p == neg_inf() && sums[0] == 0.f ? lse_empty() : OnlineLse{p, sums[0], sums[1]};
  st = soft_merge(st, SoftRow{p, col0 + a, y[a], x, sums[2], sums[3]});
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
// flce::soft_combine on the CPU (flce_cpu.cpp).
Tensor5 soft_combine_cpu(const at::Tensor& partials, const at::Tensor& pivot,
                         const std::optional<at::Tensor>& z_weight, double z_loss);
// The SoftTargets of a soft op's arguments (checked): target probabilities [N, V_local] or class
// ids [N], the shard's class weights [V_local] fp32 or none. The tensors made contiguous are
// kept in `keep`.
SoftTargets soft_targets(const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
                         int64_t n, int64_t v_local, int64_t vocab_start, int64_t vocab_size,
                         int64_t ignore_index, double label_smoothing,
                         std::vector<at::Tensor>& keep);

}  // namespace flce::cpu
