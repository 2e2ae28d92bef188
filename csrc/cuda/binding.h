// What the CUDA binding's launch sequences share (torch side; the kernels never include it):
//   binding.cpp      these helpers (checks, NVTX, target checks, combine, GEMM, coefficients);
//   chunks.cpp       the row-chunk driver every linear launch sequence runs;
//   accumulate.cpp   its gradient accumulator (dE, dW, db in every accumulation mode);
//   forward.cpp      partial_stats, combine and forward: row statistics and the loss;
//   backward.cpp     backward, the recompute backward from the forward's statistics;
//   single_pass.cpp  sum_and_grad, the single pass of training (3 GEMMs), and scale_grad;
//   logits.cpp       logits_stats and logits_backward, cross-entropy on a caller's logits;
//   soft.cpp         the soft_* ops: target distributions (opt-in).
// Each file reads top to bottom as one launch sequence and registers its own ops. The same
// sources build for a GPU and, with FLCE_CUDA_HOST, against the host emulation (device.h).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "cuda/device.h"
#include "cuda/heuristics.h"
#include "cuda/params.h"
#include "flce_ops.h"

// The CUDA dispatch key of `flce`, or (host emulation) the CPU key of the test-only namespace
// that tools/cuda_host/binding/ defines with the same schemas.
#if defined(FLCE_CUDA_HOST)
#define FLCE_CUDA_IMPL(m) TORCH_LIBRARY_IMPL(flce_cuda_host, CPU, m)
#else
#define FLCE_CUDA_IMPL(m) TORCH_LIBRARY_IMPL(flce, CUDA, m)
#endif

namespace flce {
namespace binding {

using cuda::DType;
using Tensor5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// An NVTX range for the scope.
class NvtxRange {
 public:
  explicit NvtxRange(const char* name);
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

void check_launch(cudaError_t err, const char* what);
DType to_dtype(at::ScalarType t);
// t is on the device (the emulation: the CPU) and on ref's device.
void check_device_tensor(const at::Tensor& t, const at::Tensor& ref, const char* name);
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
bool aligned16(const at::Tensor& t);
inline at::TensorOptions f32_of(const at::Tensor& t) { return t.options().dtype(at::kFloat); }
// A float tensor that the kernels may read as float4/float2: contiguous and 16-byte aligned.
at::Tensor aligned_contiguous(const at::Tensor& t);

// Target checks without a host sync (binding.cpp): poll raises for the oldest landed failure;
// check_targets queues the check of a combine's error flag (undefined: of the targets alone).
void poll_target_checks(bool wait_all = false);
void check_targets(const at::Tensor& flag, const at::Tensor& target, int64_t vocab_size,
                   int64_t ignore_index);

// combine (finalize) of [ranks, n, 5] partials into loss, lse, entropy (or nullptr) and stats,
// raising *flag for out-of-range targets; combine_impl allocates the outputs and queues the
// target check; merge_partials merges [count, n, 5] partials in order into [n, 5].
void launch_finalize(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                     int64_t ignore_index, double label_smoothing, double z_loss, float* loss,
                     float* lse, float* entropy, float* stats, int* flag);
Tensor4 combine_impl(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                     int64_t ignore_index, double label_smoothing, double z_loss);
void merge_partials(const float* parts, int64_t count, int64_t n, float* merged);

// The per-row gradient coefficients (math.h row_grad) from the row statistics.
void launch_coef(const at::Tensor& target, const at::Tensor& stats, const float* grad_loss,
                 int64_t grad_loss_stride, const float* grad_lse, int64_t grad_lse_stride,
                 const float* grad_entropy, int64_t grad_entropy_stride, int64_t ignore_index,
                 double label_smoothing, double z_loss, double softcap, double temperature,
                 int64_t vocab_size, float* coef, float* bound);

// Bytes of the workspace budget (FLCE_CUDA_WORKSPACE_MB, default heuristics::kWorkspaceMb, read
// at every call).
int64_t workspace_bytes();
// out [m, k] fp32 (or the compute dtype) = a [m, j] @ b [j, k] with fp32 accumulation.
void gemm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, float beta = 0.f);

// ---------------------------------------------------------------------------------------------
// The row-chunk driver (chunks.cpp): every linear launch sequence is stats_chunks or grad_chunks.
// ---------------------------------------------------------------------------------------------
// This rank's columns of a vocab-parallel classifier: vocabulary ids [vocab_start, vocab_start +
// V) of vocab_size; group names the process group whose ranks' partial statistics the single
// pass all-gathers (none: one device).
struct Shard {
  int64_t vocab_start = 0, vocab_size = 0;
  std::optional<std::string> group;
  int64_t group_size = 1;
};

// A target distribution's targets (the soft ops; opt-in, docs/cuda.md "Target distributions"):
// y_c = w_c (alpha q_c + beta) with q the probabilities or the one-hot of the class ids t.
struct SoftJob {
  at::Tensor q;  // [n, v] probabilities with a unit column stride, or undefined: class ids t
  at::Tensor t;  // [n] int64 global class ids (q undefined)
  at::Tensor w;  // [v] fp32 class weights, or undefined
  int64_t ignore_index = -100;  // of t
  float alpha = 1.f, beta = 0.f;
};
// The SoftJob of a soft op's (checked) target and class weights over n rows of a shard of
// v_local columns (label smoothing over vocab_size); class ids are checked against vocab_size
// without a host sync (check_targets).
SoftJob soft_job(const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
                 int64_t n, int64_t v_local, int64_t vocab_size, int64_t ignore_index,
                 double label_smoothing);
// The row kernels' view of rows [s0, ...) of a SoftJob.
cuda::SoftTargetParams soft_rows(const SoftJob& job, int64_t s0);
// Merge [ranks, n, kSoftCols] states and [ranks, n] pivots in rank order into stats and pivot;
// finalize: also loss, lse and entropy (z_weight [n] fp32 or undefined: each row's mass).
void launch_soft_merge(const float* parts, const int64_t* pivots, int64_t ranks, int64_t n,
                       float* stats, int64_t* pivot, bool finalize = false,
                       const float* z_weight = nullptr, double z_loss = 0, float* loss = nullptr,
                       float* lse = nullptr, float* entropy = nullptr);
// soft_combine of checked [ranks, n, kSoftCols] partials and [ranks, n] pivots: loss, lse, stats,
// pivot, entropy.
Tensor5 soft_combine_impl(const at::Tensor& partials, const at::Tensor& pivot,
                          const std::optional<at::Tensor>& z_weight, double z_loss);
// The soft coefficients (math.h soft_row_grad, u slot = g) and |dz| bounds of n rows.
void launch_soft_coef(int64_t n, const at::Tensor& stats, const at::Tensor& grad_loss,
                      const std::optional<at::Tensor>& grad_lse,
                      const std::optional<at::Tensor>& grad_entropy,
                      const std::optional<at::Tensor>& z_weight, double z_loss,
                      double temperature, float* coef, float* bound);

// The operands and options of one linear op call (already checked).
struct LinearJob {
  at::Tensor input, weight, target;  // [n, d], [v, d], [n]
  std::optional<at::Tensor> bias;    // [v]
  Shard shard;
  int64_t ignore_index = -100;
  double label_smoothing = 0, z_loss = 0, softcap = 0, temperature = 1;
  // Soft mode (the soft ops): the target weights of every row. stats_chunks then returns the
  // rows' SoftRow states [n, kSoftCols] (target unused) and their pivots; grad_chunks reads
  // given soft statistics, its target being the rows' pivots (ignore_index -1: none).
  const SoftJob* soft = nullptr;
};

// heuristics::chunk_plan within the workspace budget (FLCE_CUDA_WORKSPACE_MB).
using heuristics::ChunkPlan;
ChunkPlan plan_chunks(int64_t n, int64_t v, at::ScalarType compute, bool split, bool must);
// Master weights (16-bit compute, fp32 weight) take the gradient tile as hi + lo for dW.
bool split_grad(const LinearJob& job, bool need_c);

// The merged [n, 5] partial statistics (m, s, z_t, sum_z, u) of the shard's columns; need_sum /
// need_u: compute sum_z / u (else 0). Soft mode: [n, kSoftCols] states and their pivots [n]
// into *pivot. argmax: return_predicted_tokens' [n] int64 columns into *argmax
// (cuda::RowArgmaxParams; -1 on an empty shard).
at::Tensor stats_chunks(const LinearJob& job, bool need_sum, bool need_u,
                        at::Tensor* pivot = nullptr, at::Tensor* argmax = nullptr);

struct GradJob {
  // The forward's row statistics [n, kStatsCols] (the recompute backward), or undefined: each
  // sub-chunk's are computed from its logits, gathered over the shard's group and finalized
  // (the single pass; then no grad_lse / grad_entropy, and not fp16).
  at::Tensor stats;
  at::Tensor grad_loss;  // [n] fp32 dL/dloss_row, stride 0 for one value
  std::optional<at::Tensor> grad_lse, grad_entropy;  // [n] fp32
  std::optional<at::Tensor> z_weight;                 // soft mode: [n] fp32, or each row's mass
  std::array<bool, 3> mask{};                         // dE, dW, db
};
struct GradOut {
  at::Tensor loss_rows, flag;  // computed statistics only: [n] loss, the target check's flag
  at::Tensor ge;               // [n, d] fp32
  at::Tensor gw;               // [v, d] the weight's dtype
  at::Tensor gb;               // [v] fp32
};
GradOut grad_chunks(const LinearJob& job, const GradJob& grads, const ChunkPlan& plan);
// The recompute backward (backward.cpp, soft.cpp): grad_chunks over the whole job from given
// statistics, the gradients in the ops' dtypes (fp32_e: dE in fp32); and the zeros (or empty
// tensors) where nothing is asked or N or V is 0, else nullopt.
Tensor3 recompute_grads(const LinearJob& job, const GradJob& grads, bool fp32_e);
std::optional<Tensor3> nothing_to_compute(const at::Tensor& input, const at::Tensor& weight,
                                          const std::optional<at::Tensor>& bias,
                                          std::array<bool, 3> need, bool fp32_e);

// The gradients of grad_chunks from each group's dz (accumulate.cpp): dE rows, dW and db, every
// accumulation mode of the compute and weight dtypes written once. x, w: the GEMM operands in
// the compute dtype; inv_scale: fp16's inverse tile scale [1], or undefined.
class GradAccumulator {
 public:
  GradAccumulator(const LinearJob& job, std::array<bool, 3> mask, int64_t group_rows,
                  int64_t sub_rows, const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& inv_scale);
  // Where row_grad writes, for its rows from row_in_group on: the target entries' rounding
  // residuals, and a sub-chunk's bias column-sum partials (nullptr: not needed).
  float* target_resid(int64_t row_in_group) const;
  float* bias_partials() const;
  // db += the column sums of the rows of the sub-chunk row_grad just wrote.
  void add_bias(int64_t rows);
  // dE rows [g0, g0 + gn) and dW += from the group's dz [gn, v] (dz_lo: the lo half of master
  // weights' hi + lo tile, or undefined).
  void add_group(const at::Tensor& dz, const at::Tensor& dz_lo, int64_t g0);
  // The last compensations, roundings and scales; the gradients into out.ge, out.gw, out.gb.
  void finish(GradOut& out);

 private:
  void add_de(const at::Tensor& dz, const at::Tensor& tg, int64_t g0);
  void add_dw(const at::Tensor& dz, const at::Tensor& dz_lo, const at::Tensor& tg, int64_t g0);

  // How dE is formed, decided once per job (accumulate.cpp's top comment has the reasons).
  enum class DeMode {
    kNone,
    kTile,     // 16-bit compute: one GEMM over the whole vocabulary, then the target fix
    kPieces,   // fp32: pieces of kFp32PieceCols columns, Neumaier-added
    kFloat64,  // fp32 with FLCE_CUDA_OPT_IN=fp64_grad: in double, rounded once
  };
  // How dW is accumulated, decided once per job.
  enum class DwMode {
    kNone,
    kInWeight,      // an fp32 weight is its own accumulator: groups added by the GEMM's beta
                    // (master weights: the tile's hi + lo), fp32 training's Neumaier-added
    kFloat64,       // fp32 with FLCE_CUDA_OPT_IN=fp64_grad: pieces in double, rounded once a group
    kOneGroup,      // 16-bit weight, one group: straight in its dtype, target rows fixed in fp32
    kScaledPieces,  // 16-bit weight, one group with fp16's scale: fp32 pieces, each rounded once
    kAccumulator,   // 16-bit weight, several groups: a [V, D] fp32 accumulator, rounded once
  };

  const LinearJob& job_;
  at::Tensor x_, w_, x_rows_, inv_scale_;
  const float* inv_ptr_ = nullptr;
  DType dtype_;
  DeMode de_mode_ = DeMode::kNone;
  DwMode dw_mode_ = DwMode::kNone;
  bool need_b_;
  bool fix_target_;  // 16-bit compute: the target entries' residuals, for dE and a 16-bit dW
  bool kahan_dw_;    // fp32 training over several groups: dW Neumaier-added across them
  int64_t pieces_ = 1, groups_ = 0;
  at::Tensor ge_, gw_, gb_;                            // the gradients
  at::Tensor resid_, col_partials_, gb_tmp_, gb_comp_;  // row_grad's side outputs, db's sums
  at::Tensor tmp_e_, comp_e_, e64_;                    // dE's pieces
  at::Tensor acc_w_, comp_w_, tmp_w_, w64_;            // dW's fp32 (fp64) buffers
};

// Statistics of fp32 or 16-bit logits rows (rs without partials / splits) into out [rs.n, 5]:
// column splits through split_buffer ([max_row_splits(v), n, 5]) merged in order. Soft mode
// (soft: the rows' target weights): [rs.n, kSoftCols] states and pivots into out and pivot,
// through split_buffer ([max_row_splits(v), n, kSoftCols]) and split_pivots
// ([max_row_splits(v), n]).
void row_stats_into(cuda::RowStatsParams rs, float* out, float* split_buffer,
                    const cuda::SoftTargetParams* soft = nullptr, int64_t* pivot = nullptr,
                    int64_t* split_pivots = nullptr);
int64_t max_row_splits(int64_t v);
// return_predicted_tokens' columns of rows ops (cuda::RowArgmaxParams) into out [ops.n].
void row_argmax_into(const cuda::RowOperands& ops, int64_t* out);
// [n, 5] partials of an empty shard: the empty state per row.
at::Tensor empty_partials(int64_t n, const at::TensorOptions& f32);
// The same for a target distribution: [n, kSoftCols] empty states, and pivots -1 into *pivot.
at::Tensor empty_soft_partials(int64_t n, const at::TensorOptions& f32, at::Tensor* pivot);
// Every rank's [n, 5] partials of the same rows, [ranks, n, 5] in rank order (functional
// all-gather over the shard's group; the wait is the current stream's, not the host's).
at::Tensor gather_partials(const at::Tensor& partials, const Shard& shard);

// The ops of forward.cpp and backward.cpp that other launch sequences fall back on.
at::Tensor partial_stats_cuda(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& target, const std::optional<at::Tensor>& bias,
                              int64_t vocab_start, int64_t ignore_index, double softcap,
                              double temperature);
Tensor3 backward_cuda(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                      const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                      const std::optional<at::Tensor>& bias, const at::Tensor& stats,
                      int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                      double label_smoothing, double z_loss, double softcap,
                      std::array<bool, 3> output_mask,
                      const std::optional<at::Tensor>& grad_entropy, double temperature,
                      std::optional<bool> exact_bf16_grad, bool grad_input_fp32);

}  // namespace binding
}  // namespace flce
