// Cross-entropy on a caller's logits, CUDA backend (flce::logits_stats, logits_forward,
// logits_backward, logits_backward_; schemas in ops_def.h): the single pass's row kernels
// (flce_rows.cu) reading the logits in their own dtype, fp32, bf16 or fp16.
//
//   logits_stats     row_stats over (row, column split) CTAs -> [splits, N, 5] -> merged in
//                    order into partial_stats' [N, 5]              (one read of the logits)
//   logits_forward   logits_stats -> combine (finalize, target check without a host sync)
//   *_argmax         the same and return_predicted_tokens' columns (launch_row_argmax)
//   logits_backward  row_coef from the statistics and the upstream gradients -> row_grad:
//                    dz in the logits' dtype, into a new tensor or over the logits
//                    (one read and one write)
// Memory beyond the gradient: [splits, N, 5] partials and [N, 8] coefficients. Deterministic:
// fixed splits, merged in order, no atomics.
//
//   soft_logits_stats, soft_logits_forward, soft_logits_backward: the same in the row kernels'
//   soft mode (target distributions, read beside the logits; opt-in, docs/cuda.md "Target
//   distributions"): [splits, N, 7] states and pivots merged in order (soft_combine).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "cuda/params.h"
#include "flce_ops.h"

namespace flce {
namespace binding {
namespace {

void check_logits_device(const at::Tensor& logits, const at::Tensor& target) {
  check_device_tensor(logits, logits, "logits");
  check_device_tensor(target, logits, "target");
}

// Row stride of the logits in elements (any, for one row).
int64_t row_stride(const at::Tensor& z) { return z.size(0) > 1 ? z.stride(0) : z.size(1); }

// The caller's logits as the row kernels read them (no bias; target undefined: none, soft
// statistics).
cuda::RowOperands row_operands(const at::Tensor& logits, const at::Tensor& target,
                               int64_t vocab_start, int64_t ignore_index, double softcap,
                               double temperature) {
  cuda::RowOperands r{};
  r.logits = logits.data_ptr();
  r.logits_dtype = to_dtype(logits.scalar_type());
  r.n = logits.size(0);
  r.v = logits.size(1);
  r.ld = row_stride(logits);
  r.softcap = static_cast<float>(softcap);
  r.temperature = static_cast<float>(temperature);
  r.target = target.defined() ? target.data_ptr<int64_t>() : nullptr;
  r.target_stride = target.defined() ? target.stride(0) : 0;
  r.col_offset = vocab_start;
  r.ignore_index = ignore_index;
  return r;
}

// logits_stats, and with `argmax` return_predicted_tokens' columns (cuda::RowArgmaxParams;
// -1 on an empty shard).
at::Tensor logits_stats_impl(const at::Tensor& logits, const at::Tensor& target,
                             int64_t vocab_start, int64_t ignore_index, double softcap,
                             double temperature, bool with_sum, bool with_entropy,
                             at::Tensor* argmax) {
  check_logits_args(logits, target);
  check_logits_device(logits, target);
  const dev::Guard guard(logits);
  const NvtxRange range("flce::logits_stats");
  poll_target_checks();
  const int64_t n = logits.size(0), v = logits.size(1);
  const auto f32 = f32_of(logits);
  if (argmax != nullptr) {
    *argmax = v == 0 ? at::full({n}, -1, target.options()) : dev::empty({n}, target.options());
  }
  if (n == 0) return dev::empty({0, cuda::kPartialCols}, f32);
  if (v == 0) return empty_partials(n, f32);  // an empty shard: the empty state per row
  cuda::RowStatsParams rs{};
  static_cast<cuda::RowOperands&>(rs) =
      row_operands(logits, target, vocab_start, ignore_index, softcap, temperature);
  rs.need_sum = with_sum;
  rs.need_u = with_entropy;
  at::Tensor merged = dev::empty({n, cuda::kPartialCols}, f32);
  at::Tensor splits = dev::empty({max_row_splits(v) * n * cuda::kPartialCols}, f32);
  row_stats_into(rs, merged.data_ptr<float>(), splits.data_ptr<float>());
  if (argmax != nullptr) row_argmax_into(rs, argmax->data_ptr<int64_t>());
  return merged;
}

at::Tensor logits_stats_cuda(const at::Tensor& logits, const at::Tensor& target,
                             int64_t vocab_start, int64_t ignore_index, double softcap,
                             double temperature, bool with_sum, bool with_entropy) {
  return logits_stats_impl(logits, target, vocab_start, ignore_index, softcap, temperature,
                           with_sum, with_entropy, nullptr);
}

std::tuple<at::Tensor, at::Tensor> logits_stats_argmax_cuda(
    const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
    int64_t ignore_index, double softcap, double temperature, bool with_sum, bool with_entropy) {
  at::Tensor argmax;
  at::Tensor partials = logits_stats_impl(logits, target, vocab_start, ignore_index, softcap,
                                          temperature, with_sum, with_entropy, &argmax);
  return {partials, argmax};
}

// logits_forward, and with `argmax` return_predicted_tokens' columns.
Tensor4 logits_forward_impl(const at::Tensor& logits, const at::Tensor& target,
                            int64_t ignore_index, double label_smoothing, double z_loss,
                            double softcap, double temperature, bool with_entropy,
                            at::Tensor* argmax) {
  const dev::Guard guard(logits);
  const NvtxRange range("flce::logits_forward");
  const at::Tensor partials =
      logits_stats_impl(logits, target, 0, ignore_index, softcap, temperature,
                        label_smoothing != 0.0, with_entropy, argmax);
  return combine_impl(partials.unsqueeze(0), target, logits.size(1), ignore_index,
                      label_smoothing, z_loss);
}

Tensor4 logits_forward_cuda(const at::Tensor& logits, const at::Tensor& target,
                            int64_t ignore_index, double label_smoothing, double z_loss,
                            double softcap, double temperature, bool with_entropy,
                            bool /*inplace_backward: autograd's*/) {
  return logits_forward_impl(logits, target, ignore_index, label_smoothing, z_loss, softcap,
                             temperature, with_entropy, nullptr);
}

Tensor5 logits_forward_argmax_cuda(const at::Tensor& logits, const at::Tensor& target,
                                   int64_t ignore_index, double label_smoothing, double z_loss,
                                   double softcap, double temperature, bool with_entropy,
                                   bool /*inplace_backward: autograd's*/) {
  at::Tensor argmax;
  auto [loss, lse, stats, ent] = logits_forward_impl(logits, target, ignore_index,
                                                     label_smoothing, z_loss, softcap,
                                                     temperature, with_entropy, &argmax);
  return {loss, lse, stats, ent, argmax};
}

// row_grad over the logits of ops into out (the logits' dtype; out may be the logits
// themselves) from the coefficients coef [n, 8]; entropy: they hold the entropy's term.
void launch_logits_grad(const cuda::RowOperands& ops, const float* coef, bool entropy,
                        const cuda::SoftMode& mode, const at::Tensor& out) {
  const DType dtype = ops.logits_dtype;
  cuda::RowGradParams rg{};
  static_cast<cuda::RowOperands&>(rg) = ops;
  rg.mode = mode;
  rg.coef = coef;
  rg.grad = out.data_ptr();
  rg.grad_ld = row_stride(out);
  rg.rows_per_cta = 1;
  rg.entropy = entropy;
  // In place, the gradient has the logits' width: each thread rewrites the columns it read.
  rg.col_splits = cuda::row_grad_splits(rg, dtype, static_cast<int>(dev::sm_count()));
  check_launch(cuda::launch_row_grad(rg, dtype, dev::stream()), "row_grad");
}

// The gradient into out (the logits' dtype; out may be the logits themselves).
void logits_grad(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                 const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
                 const at::Tensor& target, const at::Tensor& stats, int64_t vocab_start,
                 int64_t vocab_size, int64_t ignore_index, double label_smoothing, double z_loss,
                 double softcap, double temperature, const at::Tensor& out) {
  check_logits_backward_args(grad_loss, grad_lse, grad_entropy, logits, target, stats);
  check_logits_device(logits, target);
  check_device_tensor(grad_loss, logits, "grad_loss");
  check_device_tensor(stats, logits, "stats");
  if (grad_lse) check_device_tensor(*grad_lse, logits, "grad_lse");
  if (grad_entropy) check_device_tensor(*grad_entropy, logits, "grad_entropy");
  const dev::Guard guard(logits);
  const NvtxRange range("flce::logits_backward");
  poll_target_checks();
  const int64_t n = logits.size(0), v = logits.size(1);
  if (n == 0 || v == 0) return;
  const auto f32 = f32_of(logits);
  at::Tensor coef = dev::empty({n, 8}, f32), bound = dev::empty({n}, f32);
  launch_coef(target, stats, grad_loss.data_ptr<float>(), grad_loss.stride(0),
              grad_lse ? grad_lse->data_ptr<float>() : nullptr, grad_lse ? grad_lse->stride(0) : 0,
              grad_entropy ? grad_entropy->data_ptr<float>() : nullptr,
              grad_entropy ? grad_entropy->stride(0) : 0, ignore_index, label_smoothing, z_loss,
              softcap, temperature, vocab_size, coef.data_ptr<float>(), bound.data_ptr<float>());
  launch_logits_grad(
      row_operands(logits, target, vocab_start, ignore_index, softcap, temperature),
      coef.data_ptr<float>(), grad_entropy.has_value(), cuda::SoftMode{}, out);
}

at::Tensor logits_backward_cuda(const at::Tensor& grad_loss,
                                const std::optional<at::Tensor>& grad_lse,
                                const std::optional<at::Tensor>& grad_entropy,
                                const at::Tensor& logits, const at::Tensor& target,
                                const at::Tensor& stats, int64_t vocab_start, int64_t vocab_size,
                                int64_t ignore_index, double label_smoothing, double z_loss,
                                double softcap, double temperature) {
  at::Tensor out = dev::empty(logits.sizes(), logits.options());
  logits_grad(grad_loss, grad_lse, grad_entropy, logits, target, stats, vocab_start, vocab_size,
              ignore_index, label_smoothing, z_loss, softcap, temperature, out);
  return out;
}

void logits_backward_inplace_cuda(const at::Tensor& grad_loss,
                                  const std::optional<at::Tensor>& grad_lse,
                                  const std::optional<at::Tensor>& grad_entropy,
                                  const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& stats, int64_t vocab_start,
                                  int64_t vocab_size, int64_t ignore_index,
                                  double label_smoothing, double z_loss, double softcap,
                                  double temperature) {
  logits_grad(grad_loss, grad_lse, grad_entropy, logits, target, stats, vocab_start, vocab_size,
              ignore_index, label_smoothing, z_loss, softcap, temperature, logits);
}

std::tuple<at::Tensor, at::Tensor> soft_logits_stats_cuda(
    const at::Tensor& logits, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, int64_t vocab_start, int64_t vocab_size,
    int64_t ignore_index, double label_smoothing, double softcap, double temperature) {
  check_soft_logits_args(logits, target, class_weight);
  check_device_tensor(logits, logits, "logits");
  const dev::Guard guard(logits);
  const NvtxRange range("flce::soft_logits_stats");
  poll_target_checks();
  const int64_t n = logits.size(0), v = logits.size(1);
  const auto f32 = f32_of(logits);
  at::Tensor pivot;
  if (n == 0 || v == 0) return {empty_soft_partials(n, f32, &pivot), pivot};
  const SoftJob soft =
      soft_job(target, class_weight, n, v, vocab_size, ignore_index, label_smoothing);
  cuda::RowStatsParams rs{};
  static_cast<cuda::RowOperands&>(rs) =
      row_operands(logits, at::Tensor(), vocab_start, ignore_index, softcap, temperature);
  const cuda::SoftTargetParams y = soft_rows(soft, 0);  // (no target: the rows' weights)
  at::Tensor merged = dev::empty({n, cuda::kSoftCols}, f32);
  pivot = dev::empty({n}, logits.options().dtype(at::kLong));
  at::Tensor splits = dev::empty({max_row_splits(v) * n * cuda::kSoftCols}, f32);
  at::Tensor split_pivots = dev::empty({max_row_splits(v) * n}, logits.options().dtype(at::kLong));
  row_stats_into(rs, merged.data_ptr<float>(), splits.data_ptr<float>(), &y,
                 pivot.data_ptr<int64_t>(), split_pivots.data_ptr<int64_t>());
  return {merged, pivot};
}

Tensor5 soft_logits_forward_cuda(const at::Tensor& logits, const at::Tensor& target,
                                 const std::optional<at::Tensor>& class_weight,
                                 const std::optional<at::Tensor>& z_weight, int64_t ignore_index,
                                 double label_smoothing, double z_loss, double softcap,
                                 double temperature) {
  auto [partials, pivot] =
      soft_logits_stats_cuda(logits, target, class_weight, 0, logits.size(1), ignore_index,
                             label_smoothing, softcap, temperature);
  if (z_weight) check_device_tensor(*z_weight, logits, "z_weight");
  check_soft_combine_args(partials.unsqueeze(0), pivot.unsqueeze(0), z_weight);
  return soft_combine_impl(partials.unsqueeze(0), pivot.unsqueeze(0), z_weight, z_loss);
}

at::Tensor soft_logits_backward_cuda(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const at::Tensor& stats, const at::Tensor& pivot, const std::optional<at::Tensor>& z_weight,
    int64_t vocab_start, int64_t vocab_size, int64_t ignore_index, double label_smoothing,
    double z_loss, double softcap, double temperature) {
  check_soft_logits_args(logits, target, class_weight);
  check_soft_rows(logits.size(0), grad_loss, grad_lse, grad_entropy, stats, pivot, z_weight);
  check_device_tensor(logits, logits, "logits");
  check_device_tensor(grad_loss, logits, "grad_loss");
  check_device_tensor(stats, logits, "stats");
  check_device_tensor(pivot, logits, "pivot");
  const dev::Guard guard(logits);
  const NvtxRange range("flce::soft_logits_backward");
  poll_target_checks();
  const int64_t n = logits.size(0), v = logits.size(1);
  at::Tensor out = dev::empty(logits.sizes(), logits.options());
  if (n == 0 || v == 0) return out;
  const SoftJob soft =
      soft_job(target, class_weight, n, v, vocab_size, ignore_index, label_smoothing);
  const auto f32 = f32_of(logits);
  const at::Tensor st = stats.contiguous();
  at::Tensor coef = dev::empty({n, 8}, f32), bound = dev::empty({n}, f32);
  launch_soft_coef(n, st, grad_loss, grad_lse, grad_entropy, z_weight, z_loss, temperature,
                   coef.data_ptr<float>(), bound.data_ptr<float>());
  // The pivots are the rows' targets (ignore_index -1: a row without one).
  const at::Tensor pv = pivot.contiguous();
  cuda::SoftMode mode;
  mode.soft = true;
  mode.y = soft_rows(soft, 0);
  launch_logits_grad(row_operands(logits, pv, vocab_start, /*ignore_index=*/-1, softcap,
                                  temperature),
                     coef.data_ptr<float>(), grad_entropy.has_value(), mode, out);
  return out;
}

}  // namespace
}  // namespace binding

FLCE_CUDA_IMPL(m) {
  m.impl("soft_logits_stats", &binding::soft_logits_stats_cuda);
  m.impl("soft_logits_forward", &binding::soft_logits_forward_cuda);
  m.impl("soft_logits_backward", &binding::soft_logits_backward_cuda);
  m.impl("logits_stats", &binding::logits_stats_cuda);
  m.impl("logits_forward", &binding::logits_forward_cuda);
  m.impl("logits_stats_argmax", &binding::logits_stats_argmax_cuda);
  m.impl("logits_forward_argmax", &binding::logits_forward_argmax_cuda);
  m.impl("logits_backward", &binding::logits_backward_cuda);
  m.impl("logits_backward_", &binding::logits_backward_inplace_cuda);
}

}  // namespace flce
