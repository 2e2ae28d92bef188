// The single pass of the CUDA backend (flce::sum_and_grad): the training default, the loss and
// its gradients with 3 GEMMs, no recompute: grad_chunks (chunks.cpp) computing each sub-chunk's
// statistics from its logits before turning them into dz. Where it cannot (fp16, whose gradient
// tile needs a scale known only after every row's statistics; a vocabulary too large for the
// workspace), forward + recompute backward, the same driver twice. scale_grad then multiplies the
// deferred gradients by the upstream gradient in the backward.
//
// Memory beyond inputs and outputs: the group buffer G * V * elt (twice for fp32 master weights:
// hi and lo) plus the fp32 sub-chunk S * V * 4, within FLCE_CUDA_WORKSPACE_MB (default 1.5 GiB);
// dE in fp32 [N, D] until the backward; for a 16-bit weight the target rows' fp32 dW [G, D], or
// with more than one group the fp32 dW accumulator [V, D] (rounded into the weight's dtype at the
// end of the forward). At N = 4096, V = 128256, D = 4096 bf16: one group (1.00 GiB) + a 256-row
// sub-chunk (0.12 GiB) + dE (64 MiB) + the target rows (64 MiB) = 1.25 GiB; quack's chunked
// linear cross-entropy holds its 4096 x V bf16 logits, 0.98 GiB.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "cuda/params.h"
#include "flce_ops.h"

namespace flce {
namespace binding {
namespace {

Tensor5 sum_and_grad_cuda(const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& target, const std::optional<at::Tensor>& bias,
                          int64_t ignore_index, double label_smoothing, double z_loss,
                          double softcap, std::array<bool, 3> output_mask, bool mean,
                          int64_t vocab_start, int64_t vocab_size,
                          const std::optional<std::string>& group_name, int64_t group_size,
                          double temperature, std::optional<bool> exact_bf16_grad) {
  check_linear_args(input, weight, target, bias);
  check_rounded_grad(input, exact_bf16_grad);
  check_device_tensor(input, input, "input");
  TORCH_CHECK_VALUE(vocab_start >= 0 && group_size >= 1 && (group_name || group_size == 1),
                    "flce: sum_and_grad: vocab_start >= 0 and a group_name for group_size > 1, "
                    "got vocab_start=", vocab_start, ", group_size=", group_size);
  const Shard shard{vocab_start, vocab_size < 0 ? weight.size(0) : vocab_size, group_name,
                    group_size};
  TORCH_CHECK_VALUE(shard.vocab_start + weight.size(0) <= shard.vocab_size,
                    "flce: sum_and_grad: the shard [", vocab_start, ", ",
                    vocab_start + weight.size(0), ") does not fit a vocabulary of ",
                    shard.vocab_size);
  const dev::Guard guard(input);
  const NvtxRange range("flce::sum_and_grad");
  poll_target_checks();
  const bool need_e = output_mask[0], need_c = output_mask[1], need_b = output_mask[2] && bias;
  const int64_t n = input.size(0), v = weight.size(0);
  const at::ScalarType compute = input.scalar_type();
  const auto f32 = f32_of(input);
  LinearJob job{input, weight, target, bias, shard};
  job.ignore_index = ignore_index;
  job.label_smoothing = label_smoothing;
  job.z_loss = z_loss;
  job.softcap = softcap;
  job.temperature = temperature;

  // The upstream gradient of every row's loss: 1 (sum) or 1 / count (mean; 0 when every row is
  // ignored, whose gradients are then 0 rather than 0 * inf), on the device: no host sync.
  const at::Tensor count = (target != ignore_index).sum();
  const at::Tensor grad_scale =
      (mean ? at::where(count > 0, 1.0 / count.to(at::kDouble), at::zeros_like(count, at::kDouble))
            : at::ones({}, f32.dtype(at::kDouble)))
          .to(at::kFloat)
          .reshape({1})
          .contiguous();
  auto reduce = [&](const at::Tensor& loss_rows) {
    const at::Tensor total = loss_rows.sum(at::kDouble);
    return (mean ? total / count.to(at::kDouble) : total).to(at::kFloat);
  };
  const at::Tensor one = at::ones({}, input.options().dtype(at::kDouble));

  // Every rank of a vocab-parallel group takes the same branch and walks the same chunks: they
  // plan with the same v (the mean shard size), whatever their own.
  const ChunkPlan plan =
      plan_chunks(n, shard.group ? ceil_div(shard.vocab_size, shard.group_size) : v, compute,
                  split_grad(job, need_c), /*must=*/false);
  GradJob grads;
  grads.grad_loss = grad_scale.expand({n});
  grads.mask = {need_e, need_c, need_b};
  const bool single =
      compute != at::kHalf && plan.group_rows > 0 && n > 0 && (v > 0 || shard.group);
  if (single) {
    const GradOut g = grad_chunks(job, grads, plan);
    check_targets(g.flag, target, shard.vocab_size, ignore_index);
    return {reduce(g.loss_rows), one, need_e ? g.ge.unsqueeze(0) : input.new_empty({0}),
            need_c ? g.gw.unsqueeze(0) : weight.new_empty({0}),
            need_b ? g.gb.unsqueeze(0) : weight.new_empty({0})};
  }
  // Forward, then the recompute backward from its statistics (combine_impl queues the target
  // check).
  const at::Tensor partials = stats_chunks(job, label_smoothing != 0.0, /*need_u=*/false);
  at::Tensor loss;
  std::tie(loss, std::ignore, grads.stats, std::ignore) =
      combine_impl(gather_partials(partials, shard), target, shard.vocab_size, ignore_index,
                   label_smoothing, z_loss);
  if (n == 0 || v == 0) {
    const int64_t d = input.size(1);
    return {reduce(loss), one, need_e ? at::zeros({1, n, d}, f32) : input.new_empty({0}),
            need_c ? at::zeros({1, v, d}, weight.options()) : weight.new_empty({0}),
            need_b ? at::zeros({1, v}, f32) : weight.new_empty({0})};
  }
  const GradOut g = grad_chunks(job, grads, plan_chunks(n, v, compute, split_grad(job, need_c),
                                                        /*must=*/true));
  return {reduce(loss), one, need_e ? g.ge.unsqueeze(0) : input.new_empty({0}),
          need_c ? g.gw.unsqueeze(0) : weight.new_empty({0}),
          need_b ? g.gb.unsqueeze(0) : weight.new_empty({0})};
}

// The single pass' deferred gradients [k, ...] (k = 1, or 2 slices summed) times the upstream
// gradient, scaled in double and rounded once into the gradient's dtype (scale_grad), or in
// place (scale_grad_).
at::Tensor scale_grad_cuda(const at::Tensor& deferred, const at::Tensor& scale,
                           at::ScalarType dtype) {
  TORCH_CHECK_VALUE(deferred.dim() >= 1 && (deferred.size(0) == 1 || deferred.size(0) == 2),
                    "flce: scale_grad needs a deferred gradient [k, ...] with k = 1 or 2, got ",
                    deferred.sizes());
  check_device_tensor(deferred, deferred, "deferred");
  const dev::Guard guard(deferred);
  const at::Tensor x = deferred.contiguous();
  const at::Tensor k = scale.to(deferred.device(), at::kDouble).reshape({1}).contiguous();
  at::Tensor out = dev::empty(x[0].sizes(), x.options().dtype(dtype));
  check_launch(cuda::launch_scale_grad(out.data_ptr(), to_dtype(dtype), x.data_ptr(),
                                       to_dtype(x.scalar_type()), static_cast<int>(x.size(0)),
                                       out.numel(), k.data_ptr<double>(), dev::stream()),
               "scale_grad");
  return out;
}

void scale_grad_inplace_cuda(const at::Tensor& deferred, const at::Tensor& scale) {
  TORCH_CHECK_VALUE(deferred.dim() >= 1 && deferred.size(0) == 1 && deferred.is_contiguous(),
                    "flce: scale_grad_ needs a contiguous deferred gradient [1, ...], got ",
                    deferred.sizes());
  check_device_tensor(deferred, deferred, "deferred");
  const dev::Guard guard(deferred);
  const at::Tensor k = scale.to(deferred.device(), at::kDouble).reshape({1}).contiguous();
  const DType dt = to_dtype(deferred.scalar_type());
  // Each element is read and written by one thread, once: the kernel may write over its input.
  check_launch(cuda::launch_scale_grad(deferred.data_ptr(), dt, deferred.data_ptr(), dt, 1,
                                       deferred.numel(), k.data_ptr<double>(), dev::stream()),
               "scale_grad_");
}

}  // namespace
}  // namespace binding

FLCE_CUDA_IMPL(m) {
  m.impl("sum_and_grad", &binding::sum_and_grad_cuda);
  m.impl("scale_grad", &binding::scale_grad_cuda);
  m.impl("scale_grad_", &binding::scale_grad_inplace_cuda);
}

}  // namespace flce
