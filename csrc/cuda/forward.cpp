// The forward launch sequences of the CUDA backend: the row statistics of a vocabulary range
// (stats_chunks, chunks.cpp: cuBLAS logits + row_stats per chunk of rows), their combine into
// loss, lse, stats and entropy (no atomics: deterministic), and the two together.
//   partial_stats  stats_chunks of a vocabulary shard: [N, 5]
//   combine        merge of R ranks' partials, target validation
//   forward        partial_stats of the whole vocabulary -> combine (finalize)
//   *_argmax       the same and return_predicted_tokens' columns (stats_chunks' argmax)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "flce_ops.h"

namespace flce {
namespace binding {

namespace {

// partial_stats, and with `argmax` return_predicted_tokens' columns (stats_chunks).
at::Tensor partial_stats_impl(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& target, const std::optional<at::Tensor>& bias,
                              int64_t vocab_start, int64_t ignore_index, double softcap,
                              double temperature, at::Tensor* argmax) {
  check_linear_args(input, weight, target, bias);
  check_device_tensor(input, input, "input");
  const dev::Guard guard(input);
  const NvtxRange range("flce::partial_stats");
  poll_target_checks();
  LinearJob job{input, weight, target, bias};
  job.shard.vocab_start = vocab_start;
  job.ignore_index = ignore_index;
  job.softcap = softcap;
  job.temperature = temperature;
  return stats_chunks(job, /*need_sum=*/true, /*need_u=*/true, nullptr, argmax);
}

}  // namespace

at::Tensor partial_stats_cuda(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& target, const std::optional<at::Tensor>& bias,
                              int64_t vocab_start, int64_t ignore_index, double softcap,
                              double temperature) {
  return partial_stats_impl(input, weight, target, bias, vocab_start, ignore_index, softcap,
                            temperature, nullptr);
}

std::tuple<at::Tensor, at::Tensor> partial_stats_argmax_cuda(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t vocab_start, int64_t ignore_index,
    double softcap, double temperature) {
  at::Tensor argmax;
  at::Tensor partials = partial_stats_impl(input, weight, target, bias, vocab_start,
                                           ignore_index, softcap, temperature, &argmax);
  return {partials, argmax};
}

Tensor4 combine_cuda(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                     int64_t ignore_index, double label_smoothing, double z_loss) {
  check_combine_args(partials, target);
  check_device_tensor(partials, partials, "partials");
  const dev::Guard guard(partials);
  const NvtxRange range("flce::combine");
  poll_target_checks();
  return combine_impl(partials, target, vocab_size, ignore_index, label_smoothing, z_loss);
}

Tensor4 forward_cuda(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index,
                     double label_smoothing, double z_loss, double softcap, double temperature,
                     std::optional<bool> exact_bf16_grad) {
  check_linear_args(input, weight, target, bias);
  check_rounded_grad(input, exact_bf16_grad);
  check_device_tensor(input, input, "input");
  const dev::Guard guard(input);
  const NvtxRange range("flce::forward");
  poll_target_checks();
  LinearJob job{input, weight, target, bias};
  job.ignore_index = ignore_index;
  job.softcap = softcap;
  job.temperature = temperature;
  const at::Tensor partials = stats_chunks(job, label_smoothing != 0.0, /*need_u=*/true);
  return combine_impl(partials.unsqueeze(0), target, weight.size(0), ignore_index,
                      label_smoothing, z_loss);
}

// forward's outputs and return_predicted_tokens' columns (ops_def.h forward_argmax).
Tensor5 forward_argmax_cuda(const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& target, const std::optional<at::Tensor>& bias,
                            int64_t ignore_index, double label_smoothing, double z_loss,
                            double softcap, double temperature,
                            std::optional<bool> exact_bf16_grad) {
  check_rounded_grad(input, exact_bf16_grad);
  auto [partials, argmax] = partial_stats_argmax_cuda(input, weight, target, bias, 0,
                                                      ignore_index, softcap, temperature);
  const dev::Guard guard(input);
  auto [loss, lse, stats, ent] = combine_impl(partials.unsqueeze(0), target, weight.size(0),
                                              ignore_index, label_smoothing, z_loss);
  return {loss, lse, stats, ent, argmax};
}

}  // namespace binding

FLCE_CUDA_IMPL(m) {
  m.impl("partial_stats", &binding::partial_stats_cuda);
  m.impl("combine", &binding::combine_cuda);
  m.impl("forward", &binding::forward_cuda);
  m.impl("partial_stats_argmax", &binding::partial_stats_argmax_cuda);
  m.impl("forward_argmax", &binding::forward_argmax_cuda);
}

}  // namespace flce
