// The recompute backward of the CUDA backend (flce::backward): grad_chunks (chunks.cpp) from the
// forward's statistics: per group of rows the logits GEMM again, dz, then the two gradient GEMMs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "flce_ops.h"

namespace flce {
namespace binding {

Tensor3 backward_cuda(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                      const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                      const std::optional<at::Tensor>& bias, const at::Tensor& stats,
                      int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                      double label_smoothing, double z_loss, double softcap,
                      std::array<bool, 3> output_mask,
                      const std::optional<at::Tensor>& grad_entropy, double temperature,
                      std::optional<bool> exact_bf16_grad, bool grad_input_fp32) {
  check_backward_args(grad_loss, grad_lse, input, weight, target, bias, stats, grad_entropy);
  check_rounded_grad(input, exact_bf16_grad);
  check_device_tensor(input, input, "input");
  check_device_tensor(grad_loss, input, "grad_loss");
  check_device_tensor(stats, input, "stats");
  if (grad_lse) check_device_tensor(*grad_lse, input, "grad_lse");
  if (grad_entropy) check_device_tensor(*grad_entropy, input, "grad_entropy");
  const dev::Guard guard(input);
  const NvtxRange range("flce::backward");
  poll_target_checks();
  const bool need_e = output_mask[0], need_c = output_mask[1], need_b = output_mask[2] && bias;
  if (auto none = nothing_to_compute(input, weight, bias, {need_e, need_c, need_b},
                                    grad_input_fp32)) {
    return *none;
  }
  LinearJob job{input, weight, target, bias};
  job.shard.vocab_start = vocab_start;
  job.shard.vocab_size = vocab_size;
  job.ignore_index = ignore_index;
  job.label_smoothing = label_smoothing;
  job.z_loss = z_loss;
  job.softcap = softcap;
  job.temperature = temperature;
  GradJob grads;
  grads.stats = stats;
  grads.grad_loss = grad_loss;
  grads.grad_lse = grad_lse;
  grads.grad_entropy = grad_entropy;
  grads.mask = {need_e, need_c, need_b};
  return recompute_grads(job, grads, grad_input_fp32);
}

}  // namespace binding

FLCE_CUDA_IMPL(m) {
  m.impl("backward", &binding::backward_cuda);
}

}  // namespace flce
