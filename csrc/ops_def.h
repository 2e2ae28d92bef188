// The schemas of the flce operator library, written once. csrc/ops.cpp defines them in the
// `flce` namespace; the test-only build of the CUDA binding against the host emulation of the
// kernels (tools/cuda_host/binding/) defines the same schemas in `flce_cuda_host`, so that the CUDA
// launch sequence runs on CPU tensors under exactly the op contract it serves on a GPU.
//
// Shapes: input [N, D], weight [V_local, D], target [N] (int64, global vocabulary ids),
// bias [V_local]. Python flattens (..., D) inputs to [N, D]. A single-device call is the
// vocab-parallel case with one rank: vocab_start = 0, V_local = vocab_size.
#pragma once

#include <torch/library.h>

namespace flce {

inline void define_ops(torch::Library& m) {
  // The logits are z = softcap(input . weight + bias) / temperature (temperature 1: none).
  //
  // Per-row statistics of this rank's vocabulary shard [vocab_start, vocab_start + V_local):
  // [N, 5] fp32 = (m, s, z_t, sum_z, u): running max m and sum exp(z - m) over the shard's
  // non-target logits, the target logit (-inf where the shard does not own the target or the row
  // is ignored), the sum of the shard's logits (label smoothing), and u = sum exp(z - m) (m - z)
  // over the non-target logits (the entropy, math.h OnlineLse).
  m.def(
      "partial_stats(Tensor input, Tensor weight, Tensor target, Tensor? bias, int vocab_start, "
      "int ignore_index, float softcap, float temperature=1.0) -> Tensor");
  // Combine R ranks' partials [R, N, 5] into the collapse-safe loss. Validates targets against
  // the global vocab_size. Returns loss [N], lse [N], stats [N, 4] = (m_x, s_x, z_t, u_x) (the
  // non-target logits' online state, and the target logit) and entropy [N] (of softmax(z), 0
  // for ignored rows), all fp32.
  m.def(
      "combine(Tensor partials, Tensor target, int vocab_size, int ignore_index, "
      "float label_smoothing, float z_loss) -> (Tensor loss, Tensor lse, Tensor stats, "
      "Tensor entropy)");
  m.def(
      "forward(Tensor input, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, float temperature=1.0, "
      "bool? exact_bf16_grad=None) -> (Tensor loss, Tensor lse, Tensor stats, Tensor entropy)");
  // forward's exact_bf16_grad is not used by the forward itself: its autograd passes it on to
  // backward.
  //
  // exact_bf16_grad (backward, sum_and_grad; bf16 inputs only, ignored otherwise): how the
  // gradient tile is multiplied. None: the backend's default; False: rounded once to bf16
  // (dE and dW within 1.5x bf16's rounding floor, norm-wise); True: exact, at the floor (the
  // CPU backend: csrc/cpu/tile_gemm.h bf16_grad). The CUDA backend always rounds once and
  // refuses True.
  //
  // Gradients from recomputed logit tiles and the fp32 row statistics. grad_loss [N] fp32 (may be
  // an expanded scalar), grad_lse and grad_entropy [N] fp32 or None. Outputs follow output_mask
  // (input, weight, bias); an unrequested one is an empty tensor. Each gradient has the dtype of
  // its tensor, except grad_input with grad_input_fp32=True: fp32, not rounded, so that the
  // vocab-parallel path sums the ranks' parts of dE in fp32 and rounds the sum once.
  m.def(
      "backward(Tensor grad_loss, Tensor? grad_lse, Tensor input, Tensor weight, Tensor target, "
      "Tensor? bias, Tensor stats, int vocab_start, int vocab_size, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, bool[3] output_mask, "
      "Tensor? grad_entropy=None, float temperature=1.0, bool? exact_bf16_grad=None, "
      "bool grad_input_fp32=False) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // The single pass (3 GEMMs, no recompute): the reduced loss (fp32 scalar: the sum, or with
  // mean=True the mean over non-ignored rows) and, per output_mask, the gradients, computed in
  // the same pass. Gradients are deferred: tensors [1, *shape] (empty [0] when not requested)
  // of the reduced loss (the mean's 1 / count is in every row's gradient): grad_input and
  // grad_bias fp32, grad_weight fp32 on the CPU backend and in the weight's dtype on CUDA (whose
  // 16-bit dW GEMM writes it directly); scale_grad multiplies them by the upstream gradient over
  // `divisor` (float64 scalar, 1) and rounds to the gradient's dtype. python/flce/_ops.py's fake
  // kernel mirrors this. scale_grad also takes k = 2 slices (added in double).
  // For reduction "sum"/"mean" when gradients are needed.
  // Vocab-parallel (CUDA backend): weight is this rank's shard of global rows [vocab_start,
  // vocab_start + V_local) of a vocabulary of vocab_size (-1: V_local), and each chunk of rows'
  // [rows, 4] partial statistics are all-gathered over the process group group_name (of
  // group_size ranks, torch's functional collectives) before they are combined; the loss is
  // then the global one on every rank, grad_weight and grad_bias the shard's, and grad_input
  // this rank's part of the sum over ranks (the caller reduces it).
  m.def(
      "sum_and_grad(Tensor input, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, bool[3] output_mask, bool mean, "
      "int vocab_start=0, int vocab_size=-1, str? group_name=None, int group_size=1, "
      "float temperature=1.0, bool? exact_bf16_grad=None) -> "
      "(Tensor loss, Tensor divisor, Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // Target distributions (math.h SoftRow): probability targets (soft labels), and class
  // targets with per-class weights and label smoothing, every term of the loss taken from the
  // row's largest logit (collapse-safe). target: this shard's probabilities [N, V_local] (any
  // float dtype) or class ids [N] int64 (global; ignore_index rows have no target weight);
  // class_weight: this shard's per-class weights [V_local] fp32, or None. The target weights are
  // y_c = w_c ((1 - label_smoothing) q_c + label_smoothing / vocab_size).
  // Returns [N, 7] fp32 = (m_x, s_x, p, u_x, y_a, y_rest, g) and the pivot a [N] int64 (the
  // global class id of the shard's largest logit; -1 for an empty shard).
  m.def(
      "soft_partial_stats(Tensor input, Tensor weight, Tensor target, Tensor? bias, "
      "Tensor? class_weight, int vocab_start, int vocab_size, int ignore_index, "
      "float label_smoothing, float softcap, float temperature) -> (Tensor, Tensor)");
  // Merge R shards' partials [R, N, 7] and pivots [R, N] in rank order: the unreduced loss [N],
  // lse [N], the merged state [N, 7] and pivot [N] (the backward's stats) and the entropy [N].
  // z_weight: the z-loss's row weights [N] fp32; None: each row's target mass sum_c y_c.
  m.def(
      "soft_combine(Tensor partials, Tensor pivot, Tensor? z_weight, float z_loss) -> "
      "(Tensor loss, Tensor lse, Tensor stats, Tensor pivot_out, Tensor entropy)");
  // One device: soft_combine(soft_partial_stats(...)).
  m.def(
      "soft_forward(Tensor input, Tensor weight, Tensor target, Tensor? bias, "
      "Tensor? class_weight, Tensor? z_weight, int ignore_index, float label_smoothing, "
      "float z_loss, float softcap, float temperature) -> "
      "(Tensor loss, Tensor lse, Tensor stats, Tensor pivot, Tensor entropy)");
  // Gradients from recomputed logit tiles and soft_combine's stats and pivot, as backward's
  // (grad_input_fp32 too).
  m.def(
      "soft_backward(Tensor grad_loss, Tensor? grad_lse, Tensor? grad_entropy, Tensor input, "
      "Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight, Tensor stats, "
      "Tensor pivot, Tensor? z_weight, int vocab_start, int vocab_size, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, float temperature, "
      "bool[3] output_mask, bool grad_input_fp32=False) -> "
      "(Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // The single pass of a target distribution (one device), as sum_and_grad: the reduced loss
  // and the deferred gradients. mean: over the rows for probability targets; for class targets
  // over z_weight's sum (torch's class weights of the targets) or the non-ignored rows.
  m.def(
      "soft_sum_and_grad(Tensor input, Tensor weight, Tensor target, Tensor? bias, "
      "Tensor? class_weight, Tensor? z_weight, int ignore_index, float label_smoothing, "
      "float z_loss, float softcap, float temperature, bool[3] output_mask, bool mean) -> "
      "(Tensor loss, Tensor divisor, Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // Raises IndexError for a target outside [0, vocab_size) that is not ignore_index, as combine
  // does (on CUDA without a host sync: at the first flce call after the GPU has run it), for the
  // paths whose loss torch ops compute (python/flce/_composite.py).
  m.def("check_target(Tensor target, int vocab_size, int ignore_index) -> ()");
  // dtype(sum_k deferred[k] * scale): the slices added and scaled in double, rounded once.
  m.def("scale_grad(Tensor deferred, Tensor scale, ScalarType dtype) -> Tensor");
  // The same for one slice [1, ...] already in the gradient's dtype, in place: the gradient is
  // then deferred[0] itself (no second buffer of its size).
  m.def("scale_grad_(Tensor(a!) deferred, Tensor scale) -> ()");

  // Cross-entropy on given logits (flce.cross_entropy, the logits-level vocab-parallel path).
  // logits [N, V_local]: float32, bfloat16 or float16, unit column stride (any row stride), the
  // raw logits u of this rank's columns [vocab_start, vocab_start + V_local); the loss is taken
  // of z = softcap(u) / temperature, as for the linear ops (no bias). Nothing here copies or
  // widens the logits beyond a tile at a time.
  //
  // partial_stats' [N, 5] row statistics (m, s, z_t, sum_z, u) of this rank's columns, for
  // combine. with_sum: the logit sum (label smoothing; else 0 may be stored); with_entropy: the
  // entropy's sum u (else 0 may be stored).
  m.def(
      "logits_stats(Tensor logits, Tensor target, int vocab_start, int ignore_index, "
      "float softcap, float temperature, bool with_sum, bool with_entropy) -> Tensor");
  // One device: combine(logits_stats(...)) -> loss, lse, stats, entropy as forward's.
  // inplace_backward is for autograd only (python/flce/_ops.py): the backward then writes the
  // gradient over the logits (logits_backward_).
  m.def(
      "logits_forward(Tensor logits, Tensor target, int ignore_index, float label_smoothing, "
      "float z_loss, float softcap, float temperature, bool with_entropy, "
      "bool inplace_backward=False) -> (Tensor loss, Tensor lse, Tensor stats, Tensor entropy)");
  // d objective / d logits [N, V_local] in the logits' dtype from the row statistics (combine's
  // stats) and the upstream gradients, as backward's gradient tile: grad_loss [N] fp32 (may be
  // an expanded scalar), grad_lse and grad_entropy [N] fp32 or None.
  m.def(
      "logits_backward(Tensor grad_loss, Tensor? grad_lse, Tensor? grad_entropy, Tensor logits, "
      "Tensor target, Tensor stats, int vocab_start, int vocab_size, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, float temperature) -> Tensor");
  // Target distributions on given logits (soft_partial_stats' formats and target weights).
  // return_predicted_tokens: forward's, partial_stats', logits_forward's and logits_stats'
  // outputs and argmax [N] int64, the global column of each row's largest non-target logit z
  // (after bias, softcap and temperature; the first of equals, as torch.argmax), -1 where the
  // row (the shard) has no non-target column, -2 where a non-target logit is NaN
  // (cpu/rows.h RowState::track_argmax, cuda/params.h RowArgmaxParams). Python forms the
  // predicted token from it and the stats' m_x and z_t (flce/_common.py predicted_from_stats),
  // over vocabulary shards after merging the ranks' columns by their m (flce/parallel.py).
  m.def(
      "forward_argmax(Tensor input, Tensor weight, Tensor target, Tensor? bias, "
      "int ignore_index, float label_smoothing, float z_loss, float softcap, "
      "float temperature=1.0, bool? exact_bf16_grad=None) -> (Tensor loss, Tensor lse, "
      "Tensor stats, Tensor entropy, Tensor argmax)");
  m.def(
      "partial_stats_argmax(Tensor input, Tensor weight, Tensor target, Tensor? bias, "
      "int vocab_start, int ignore_index, float softcap, float temperature=1.0) -> "
      "(Tensor partials, Tensor argmax)");
  m.def(
      "logits_forward_argmax(Tensor logits, Tensor target, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, float temperature, "
      "bool with_entropy, bool inplace_backward=False) -> (Tensor loss, Tensor lse, "
      "Tensor stats, Tensor entropy, Tensor argmax)");
  m.def(
      "logits_stats_argmax(Tensor logits, Tensor target, int vocab_start, int ignore_index, "
      "float softcap, float temperature, bool with_sum, bool with_entropy) -> "
      "(Tensor partials, Tensor argmax)");
  m.def(
      "soft_logits_stats(Tensor logits, Tensor target, Tensor? class_weight, int vocab_start, "
      "int vocab_size, int ignore_index, float label_smoothing, float softcap, "
      "float temperature) -> (Tensor, Tensor)");
  // One device: soft_combine(soft_logits_stats(...)).
  m.def(
      "soft_logits_forward(Tensor logits, Tensor target, Tensor? class_weight, "
      "Tensor? z_weight, int ignore_index, float label_smoothing, float z_loss, float softcap, "
      "float temperature) -> (Tensor loss, Tensor lse, Tensor stats, Tensor pivot, "
      "Tensor entropy)");
  // d objective / d logits in the logits' dtype from soft_combine's stats and pivot.
  m.def(
      "soft_logits_backward(Tensor grad_loss, Tensor? grad_lse, Tensor? grad_entropy, "
      "Tensor logits, Tensor target, Tensor? class_weight, Tensor stats, Tensor pivot, "
      "Tensor? z_weight, int vocab_start, int vocab_size, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, float temperature) -> Tensor");
  // The same gradient written over the logits, which must not be needed afterwards (each
  // element is read before its gradient replaces it).
  m.def(
      "logits_backward_(Tensor grad_loss, Tensor? grad_lse, Tensor? grad_entropy, "
      "Tensor(a!) logits, Tensor target, Tensor stats, int vocab_start, int vocab_size, "
      "int ignore_index, float label_smoothing, float z_loss, float softcap, "
      "float temperature) -> ()");
  // flce.linear_distillation's row math on one chunk (python/flce/distill.py, _rows; the CPU
  // backend, csrc/cpu/distill_cpu.cpp; the CUDA backend, csrc/cuda/distill.cpp): z_s, z_t
  // [rows, V] the student's and the teacher's logits (float32 or float64, contiguous, one
  // dtype), target [rows] int64 (read where valid and hard_weight != 0), valid [rows] bool.
  // Writes each row's loss into loss [rows] (the logits' dtype; 0 where not valid) and, where
  // grad_s / grad_t, the loss's gradient in the student's / teacher's logits over z_s / z_t (0
  // on rows not valid); a logits buffer whose gradient is not wanted is left as it was.
  // divergence: "forward_kl", "reverse_kl" or "jsd" (beta in (0, 1)).
  m.def(
      "distill_rows_(Tensor(a!) z_s, Tensor(b!) z_t, Tensor(c!) loss, Tensor target, "
      "Tensor valid, str divergence, float beta, float temperature, float hard_weight, "
      "float soft_weight, bool grad_s, bool grad_t) -> ()");
}

}  // namespace flce
