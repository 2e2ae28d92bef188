// flce CUDA backend: the plain parameter structs and launchers shared by the torch binding
// (binding.h and its .cpp files) and the torch-free kernels (*.cu). Nothing here includes torch
// or ATen.
//
// Conventions: every size, stride and offset is int64_t (N*V, N*D and V*D may pass 2^31);
// strides are in elements. Column index j of a kernel's weight block is the vocabulary id
// col_offset + j, which is what targets are compared against (targets are never used as an
// index, so an out-of-range target cannot cause an out-of-bounds read).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flce/layout.h"
#include "flce/math.h"

namespace flce {
namespace cuda {

// Row layouts: partial statistics [kPartialCols] = (m, s, z_t, sum_z, u), row statistics
// [kStatsCols] = (m_x, s_x, z_t, u_x) (flce/layout.h).
using ::flce::kPartialCols;
using ::flce::kSoftCols;
using ::flce::kStatsCols;

// Storage dtype of a kernel's operands (logits, gradient tile, weight rows).
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Backward, step 1: per-row gradient coefficients (math.h row_grad) and the bound of |dz| per row.
struct RowCoefParams {
  int64_t n;
  const int64_t* target;
  int64_t target_stride;
  const float* stats;  // [n, kStatsCols] = (m_x, s_x, z_t, u_x)
  int64_t stats_row_stride, stats_col_stride;
  const float* grad_loss;  // [n], stride may be 0
  int64_t grad_loss_stride;
  const float* grad_lse;   // [n] or nullptr
  int64_t grad_lse_stride;
  const float* grad_entropy;  // [n] or nullptr (dL/dH of the row's entropy)
  int64_t grad_entropy_stride;
  int64_t ignore_index;
  float label_smoothing, z_loss, softcap;
  float temperature = 1.f;  // the stored dz carries its 1/T (bound only; the coef do not)
  int64_t vocab_size;
  // A target distribution's rows (math.h soft_row_grad): stats [n, kSoftCols] = (m_x, s_x, p,
  // u_x, y_a, y_rest, g), target unused, z_weight [n] (stride z_weight_stride) or nullptr (each
  // row's target mass); the coefficients' u slot then holds the upstream g that multiplies each
  // column's target weight (launch_row_grad with soft targets).
  bool soft = false;
  const float* z_weight = nullptr;
  int64_t z_weight_stride = 1;
  float* coef;   // [n, 8] = RowGrad (ref, a, u, dz_t), (div, h, k, rdiv)
  float* bound;  // [n] >= max_j |dz_j| of the row, chain rule (softcap', 1/T) included
};
cudaError_t launch_row_coef(const RowCoefParams& p, cudaStream_t stream);

// dE rows += (target_resid * inv_scale) * weight[target] in fp32, for the rows whose target is
// in this weight block: the part of the dominant target-column gradient
// that the 16-bit tile lost, added in fp32 (the CPU backend likewise keeps the target column out
// of the tile GEMMs).
struct TargetFixParams {
  const void* weight;  // [v, d] compute dtype, any strides (a transposed classifier included)
  int64_t weight_row_stride, weight_col_stride;
  int64_t n, v, d;
  const int64_t* target;
  int64_t target_stride;
  int64_t col_offset, ignore_index;
  const float* target_resid;  // [n]
  const float* inv_scale;     // device scalar or nullptr
  float* sum;                 // [n, d] fp32, complete rows (one rounding per element)
};
cudaError_t launch_target_fix(const TargetFixParams& p, DType dtype, cudaStream_t stream);

// Merge R partial-stat blocks [R, n, kPartialCols] in rank order. finalize = false: write the
// merged partials to merged [n, kPartialCols]. finalize = true: write loss, lse, entropy and
// stats [n, kStatsCols], and raise *error_flag (set to 1) for a target outside [0, vocab_size)
// that is not ignore_index.
struct CombineParams {
  const float* partials;  // [ranks, n, kPartialCols] contiguous
  int64_t ranks, n;
  const int64_t* target;
  int64_t target_stride;
  int64_t vocab_size, ignore_index;
  float label_smoothing, z_loss;
  float* merged;
  float* loss;
  float* lse;
  float* entropy;  // [n], or nullptr
  float* stats;
  int* error_flag;
};
cudaError_t launch_combine(const CombineParams& p, bool finalize, cudaStream_t stream);

// The same for a target distribution's states (math.h soft_merge): R blocks [R, n, kSoftCols] and
// pivots [R, n] merged in rank order. finalize = false: the merged state into stats and pivot;
// true: also loss, lse and entropy (soft_row_loss with z_weight [n] or each row's target mass,
// row_entropy pivoted on the merged pivot).
struct SoftCombineParams {
  const float* partials;  // [ranks, n, kSoftCols] contiguous
  const int64_t* pivots;  // [ranks, n] contiguous
  int64_t ranks, n;
  const float* z_weight;  // [n] or nullptr
  float z_loss;
  float* stats;           // [n, kSoftCols]
  int64_t* pivot;         // [n]
  float* loss;            // finalize: [n] each
  float* lse;
  float* entropy;
};
cudaError_t launch_soft_combine(const SoftCombineParams& p, bool finalize, cudaStream_t stream);

// out[c] = sum over rows r (in order, compensated) of x[r, c]; x is [rows, cols] contiguous.
cudaError_t launch_column_sum(const float* x, int64_t rows, int64_t cols, float* out,
                              cudaStream_t stream);

// (sum, comp) += x * inv_scale elementwise with Neumaier compensation (math.h kahan_add).
// inv_scale is a device scalar or nullptr for 1.
cudaError_t launch_kahan_accumulate(float* sum, float* comp, const float* x, int64_t count,
                                    const float* inv_scale, cudaStream_t stream);

// out = (dtype) (x * inv_scale) elementwise.
cudaError_t launch_scale_store(void* out, DType dtype, const float* x, int64_t count,
                               const float* inv_scale, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// The single pass (flce::sum_and_grad, 3 GEMMs): a chunk of rows has its raw logits x . w in an
// fp32 buffer [n, v] (cuBLAS, fp32 output), then
//   launch_row_stats  per row (m, s, z_t, sum_z) over the chunk's columns = partial_stats'
//                     format, for launch_combine (and, vocab-parallel, an all-gather first);
//   launch_row_coef   (above) the row coefficients from the combined statistics;
//   launch_row_grad   dz = dloss/dz (x softcap') in the compute dtype, written over the logits in
//                     place, with the target entry's rounding residual and the bias' column sums.
// One CTA per (row block, column split); a split's columns are divided over the CTA's threads
// in a fixed order and reduced in a fixed tree, the splits merged in order: deterministic, no
// atomics.

// Columns of one tile of the row kernels (flce_rows.cu): the unit of their column splits.
constexpr int64_t kRowTileCols = 4096;

// A target distribution's target weights on a row kernel's columns (math.h SoftRow):
//   y_c = w_c (alpha q_c + beta)
// with q a row of probabilities (q: [n, v] of q_dtype, row stride ldq elements, unit column
// stride) or, q = nullptr, the one-hot of the row's class id (t: global ids, stride t_stride;
// a row of ignore_index has y = 0), w the shard's class weights [v] fp32 or nullptr (1).
struct SoftTargetParams {
  const void* q = nullptr;
  DType q_dtype = DType::kFloat32;
  int64_t ldq = 0;
  const int64_t* t = nullptr;
  int64_t t_stride = 1;
  int64_t ignore_index = -100;
  const float* w = nullptr;
  float alpha = 1.f, beta = 0.f;
};

// The logits a row kernel reads, and what it needs of them (both row kernels' parameters).
struct RowOperands {
  // [n, v] raw logits (x . w from the single pass' GEMM, or a caller's: flce::logits_stats),
  // bias, softcap and temperature not applied, row stride ld elements of logits_dtype (fp32,
  // bf16 or fp16), unit column stride.
  const void* logits;
  DType logits_dtype = DType::kFloat32;
  int64_t n, v, ld;
  const float* bias;    // [v] fp32 or nullptr
  float softcap;        // <= 0: none
  float temperature = 1.f;
  const int64_t* target;
  int64_t target_stride;
  int64_t col_offset;   // vocabulary id of column 0
  int64_t ignore_index;
};

// Soft mode of the row kernels (a target distribution): the target weights of the row's
// columns. row_stats then folds the rows into math.h SoftRow states (target unused); row_grad
// takes the rows' pivots as their targets (the pivot column's whole gradient dz_t;
// ignore_index -1 for a row without one) and subtracts u y_c from every other column, u from
// the coefficients' u slot (launch_row_coef with soft = true). Never run on a GPU: opt-in
// (FLCE_CUDA_OPT_IN=distributions). The last member of RowGradParams (its plain kernels' parameters
// keep their offsets); row_stats' soft kernel takes SoftStatsParams (below).
struct SoftMode {
  bool soft = false;
  SoftTargetParams y;
};

struct RowStatsParams : RowOperands {
  float* partials;      // [splits, n, kPartialCols], contiguous
  bool need_sum = true;  // the logit sum (label smoothing); false: 0 stored
  bool need_u = true;    // the entropy's sum u (return_entropy); false: 0 stored
  // Column splits: split k takes a contiguous range of the row's kRowTileCols-column tiles and
  // writes its partial to partials + k * n * kPartialCols (launch_combine merges them in order).
  // More CTAs in flight than one per row: a sub-chunk of a few hundred rows alone leaves the
  // memory system mostly idle.
  int splits = 1;
};
cudaError_t launch_row_stats(const RowStatsParams& p, cudaStream_t stream);

// row_stats in soft mode (SoftMode): partials are [splits, n, kSoftCols] SoftRow states and
// pivots [splits, n] their pivot ids (launch_soft_combine merges them in order); need_sum and
// need_u are ignored (the entropy's u is always kept). A struct of its own: RowStatsParams
// grown by these fields (104 -> 184 bytes) made NVVM read every plain row_stats instance's
// parameter through a param-space pointer, and ptxas schedule their tile loops differently
// (-7..+6 instructions).
struct SoftStatsParams : RowStatsParams {
  int64_t* pivots = nullptr;
  SoftTargetParams y;
};
cudaError_t launch_soft_stats(const SoftStatsParams& p, cudaStream_t stream);
int soft_stats_splits(const SoftStatsParams& p, int sm_count);
// Column splits for launch_row_stats at these parameters (splits ignored) on a device of
// sm_count SMs: at least two waves of the kernel instance's resident CTAs (the occupancy API;
// the host emulation assumes 2 per SM), at most one per tile, the last wave as full as can be.
int row_stats_splits(const RowStatsParams& p, int sm_count);

// return_predicted_tokens (opt-in: its own pass over the logits, launched only when asked, so
// that row_stats is unchanged): argmax [n] int64, the global column (col_offset + j) of each
// row's largest non-target logit z (xform_logit, as row_stats; the first of equals), -1 where
// the row has no non-target column, -2 where a non-target z is NaN (cpu/rows.h
// RowState::track_argmax's values). One CTA per row, all of its columns.
struct RowArgmaxParams : RowOperands {
  int64_t* argmax;
};
cudaError_t launch_row_argmax(const RowArgmaxParams& p, cudaStream_t stream);

// The logits (RowOperands) are overwritten where grad aliases them.
struct RowGradParams : RowOperands {
  const float* coef;    // [n, 8] from launch_row_coef
  // The coefficients may hold the entropy's term (row_coef had a grad_entropy): false lets the
  // kernel skip it (a row's h is 0 without it).
  bool entropy = true;
  // dz in the compute dtype (launch_row_grad's dtype; with 16-bit logits, theirs), row r at
  // grad + r * grad_ld (elements of that dtype). It may alias the logits (grad = logits,
  // grad_ld = ld * sizeof(logit) / sizeof(T)): each row is rewritten tile by tile, every
  // thread's reads of a tile before any write over it.
  void* grad;
  int64_t grad_ld;
  void* grad_lo;        // the rounding residual (T)(dz - hi), same layout, or nullptr
  int64_t grad_lo_ld;
  float* target_resid;  // [n]: dz_t - hi for rows whose target is a column here, else 0; or null
  float* col_partials;  // [ceil(n / rows_per_cta), v] fp32 column sums of dz, or nullptr
  int rows_per_cta;     // rows of one CTA (and of one col_partials row): 1 without col_partials
  // Column splits, as RowStatsParams::splits. Only where the gradient does not alias the logits
  // with a narrower type (a 16-bit tile written over fp32 logits lands on columns another split
  // may not have read yet): launch_row_grad refuses that. A same-width alias (a caller's 16-bit
  // logits, flce::logits_backward in place) rewrites each thread's own columns only.
  int col_splits = 1;
  SoftMode mode;
};
// dtype: the gradient's; fp32 logits give an fp32, bf16 or fp16 gradient, 16-bit logits one in
// their own dtype (anything else: cudaErrorInvalidValue).
cudaError_t launch_row_grad(const RowGradParams& p, DType dtype, cudaStream_t stream);
// Column splits for launch_row_grad, as row_stats_splits (col_splits ignored).
int row_grad_splits(const RowGradParams& p, DType dtype, int sm_count);

// out[t - col_offset] += (sum over the rows with target t, in row order) of resid[row] *
// inv_scale * x[row], for the targets t in [col_offset, col_offset + rows): the part of the
// dominant target-column gradient that the 16-bit gradient tile lost, added to an fp32 dW block
// before it is rounded (the dW counterpart of target_fix, and of the CPU backend's separate
// target-column accumulation). The rows come sorted by target (a stable sort): one CTA per run
// of equal targets, so the sums are in a fixed order and no two CTAs write one row.
struct TargetRowsParams {
  const void* x;                 // [n, d] compute dtype, row stride x_stride, unit column stride
  int64_t x_stride;
  int64_t n, d;
  const int64_t* sorted_target;  // [n] the rows' targets, sorted ascending
  const int64_t* order;          // [n] the row of each sorted position
  int64_t col_offset, rows, ignore_index;
  const float* resid;            // [n] by row: scale * dz_t - hi of the row's target entry
  const float* inv_scale;        // device scalar or nullptr
  float* out;                    // [rows, d] fp32, contiguous (accumulated into), or nullptr:
  // store instead: row c of `store` ([rows, d] in the compute dtype, contiguous) =
  // dtype(base[k] + the residual sum) for the first sorted position k of each target run, base
  // [n, d] fp32 holding each sorted position's full dW row (rounded once, here).
  const float* base;
  void* store;
};
cudaError_t launch_target_rows(const TargetRowsParams& p, DType dtype, cudaStream_t stream);

// out[i] = dtype((sum over k < slices of x[k * count + i]) * scale), the slices added and scaled
// in double and rounded once: the deferred gradients of the single pass -> the gradient.
// x is fp32 or the output dtype (x_dtype); scale is a device double. One slice of the output
// dtype may be scaled in place (out == x).
cudaError_t launch_scale_grad(void* out, DType dtype, const void* x, DType x_dtype, int slices,
                              int64_t count, const double* scale, cudaStream_t stream);

// flce::distill_rows_ (flce_distill.cu): the distillation row math of one chunk, per row of the
// student's and the teacher's logits z_s, z_t [n, v] (contiguous, fp32 or fp64: fp64 true) the
// loss into loss [n] (their dtype) and, where grad_s / grad_t, its gradients over z_s / z_t.
// Ignored rows (valid false): loss 0, gradients 0. target [n] is read on valid rows where
// hard_weight != 0; one outside [0, v) gives that row a NaN loss (never an index out of bounds;
// the binding queues the targets' check). Opt-in (FLCE_CUDA_OPT_IN=distill) until a GPU runs it.
using DistillDiv = ::flce::Divergence;  // (flce/math.h)
struct DistillRowsParams {
  void* z_s;
  void* z_t;
  void* loss;
  const int64_t* target;
  const bool* valid;
  int64_t n, v;
  DistillDiv div;
  bool fp64, grad_s, grad_t;
  // beta (jsd), logit(beta) = log(beta / (1 - beta)), temperature, hard_weight, soft_weight:
  // rounded to the logits' dtype by the kernel, as the CPU op rounds them
  double beta, logit_beta, temperature, hard_weight, soft_weight;
};
cudaError_t launch_distill_rows(const DistillRowsParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace flce
