// Op signatures and the argument checks every backend shares (torch side only; kernels never
// include this file).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "flce/layout.h"

namespace flce {

using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensor5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Row layouts of the ops: kPartialCols, kStatsCols (flce/layout.h).

using PartialStatsFn = at::Tensor(const at::Tensor& input, const at::Tensor& weight,
                                  const at::Tensor& target, const std::optional<at::Tensor>& bias,
                                  int64_t vocab_start, int64_t ignore_index, double softcap,
                                  double temperature);
using CombineFn = Tensor4(const at::Tensor& partials, const at::Tensor& target,
                          int64_t vocab_size, int64_t ignore_index, double label_smoothing,
                          double z_loss);
using BackwardFn = Tensor3(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                           const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& target, const std::optional<at::Tensor>& bias,
                           const at::Tensor& stats, int64_t vocab_start, int64_t vocab_size,
                           int64_t ignore_index, double label_smoothing, double z_loss,
                           double softcap, std::array<bool, 3> output_mask,
                           const std::optional<at::Tensor>& grad_entropy, double temperature,
                           std::optional<bool> exact_bf16_grad);

using SoftPartialStatsFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& class_weight,
    int64_t vocab_start, int64_t vocab_size, int64_t ignore_index, double label_smoothing,
    double softcap, double temperature);
using SoftLogitsStatsFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& logits, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, int64_t vocab_start, int64_t vocab_size,
    int64_t ignore_index, double label_smoothing, double softcap, double temperature);
using SoftCombineFn = Tensor5(const at::Tensor& partials, const at::Tensor& pivot,
                              const std::optional<at::Tensor>& z_weight, double z_loss);

// Checks shared by all backends. Python validates first with argument names; these keep a
// direct torch.ops.flce call from reaching a kernel with inconsistent arguments.
void check_linear_operands(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias);
void check_linear_args(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                       const std::optional<at::Tensor>& bias);
// The CUDA backend's 16-bit gradient tiles are rounded once (docs/numerics.md): it has no exact
// bf16 mode, and refuses exact_bf16_grad=True for bf16 inputs rather than return gradients less
// accurate than asked for.
void check_rounded_grad(const at::Tensor& input, std::optional<bool> exact_bf16_grad);
void check_combine_args(const at::Tensor& partials, const at::Tensor& target);
void check_soft_backward_args(const at::Tensor& grad_loss,
                              const std::optional<at::Tensor>& grad_lse,
                              const std::optional<at::Tensor>& grad_entropy,
                              const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& target, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& class_weight,
                              const at::Tensor& stats, const at::Tensor& pivot,
                              const std::optional<at::Tensor>& z_weight);
// A target distribution's target: float [N, v_local] probabilities or int64 [N] class ids;
// class_weight [v_local] fp32 or none; on input's device.
void check_soft_target_args(const at::Tensor& input, const at::Tensor& target,
                            const std::optional<at::Tensor>& class_weight, int64_t v_local);
// soft partials [R, N, kSoftCols] fp32 and pivots [R, N] int64; z_weight [N] fp32 or none.
void check_soft_combine_args(const at::Tensor& partials, const at::Tensor& pivot,
                             const std::optional<at::Tensor>& z_weight);
void check_backward_args(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                         const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& target, const std::optional<at::Tensor>& bias,
                         const at::Tensor& stats,
                         const std::optional<at::Tensor>& grad_entropy = std::nullopt);
// A target distribution's logits and target (check_soft_target_args), and its backward's rows:
// upstream gradients, stats [N, kSoftCols], pivot [N] int64, z_weight [N] fp32 or none.
void check_soft_logits_args(const at::Tensor& logits, const at::Tensor& target,
                            const std::optional<at::Tensor>& class_weight);
void check_soft_rows(int64_t n, const at::Tensor& grad_loss,
                     const std::optional<at::Tensor>& grad_lse,
                     const std::optional<at::Tensor>& grad_entropy, const at::Tensor& stats,
                     const at::Tensor& pivot, const std::optional<at::Tensor>& z_weight);
// logits [N, V] float32/bfloat16/float16 with unit column stride, target [N] int64, one device;
// stats [N, kStatsCols] fp32 and the upstream gradients [N] fp32 when given.
void check_logits_args(const at::Tensor& logits, const at::Tensor& target);
void check_logits_backward_args(const at::Tensor& grad_loss,
                                const std::optional<at::Tensor>& grad_lse,
                                const std::optional<at::Tensor>& grad_entropy,
                                const at::Tensor& logits, const at::Tensor& target,
                                const at::Tensor& stats);
// flce::distill_rows_'s arguments (its contract: csrc/ops.cpp): z_s, z_t [rows, V >= 1] and
// loss [rows], one float32 or float64 dtype, contiguous; target [rows] int64 and valid [rows]
// bool, contiguous; a known divergence (jsd with beta in (0, 1)), temperature > 0. Returns the
// divergence as flce/math.h's Divergence: 0 forward_kl, 1 reverse_kl, 2 jsd.
int check_distill_rows_args(const at::Tensor& z_s, const at::Tensor& z_t, const at::Tensor& loss,
                            const at::Tensor& target, const at::Tensor& valid,
                            c10::string_view divergence, double beta, double temperature);

}  // namespace flce
