// Target distributions on the CUDA backend (probability targets, class weights with label
// smoothing; math.h SoftRow): stats_chunks / grad_chunks (chunks.cpp) in soft mode, the states
// merged by soft_combine. Opt-in (FLCE_CUDA_OPT_IN=distributions, read by Python) until they have run
// on a GPU (docs/cuda.md "Target distributions").
//   soft_partial_stats, soft_combine, soft_forward, soft_backward
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "flce_ops.h"

namespace flce {
namespace binding {

// ---------------------------------------------------------------------------------------------
// Target distributions (soft mode of the row kernels and the chunk driver).
// ---------------------------------------------------------------------------------------------
SoftJob soft_job(const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
                 int64_t n, int64_t v_local, int64_t vocab_size, int64_t ignore_index,
                 double label_smoothing) {
  SoftJob j;
  if (target.scalar_type() == at::kLong) {
    j.t = target;
    check_targets(at::Tensor(), target, vocab_size, ignore_index);  // (combine's, no host sync)
  } else {
    // Rows may be strided (a slice of a wider tensor); the columns are read one by one.
    j.q = target.stride(1) == 1 || v_local <= 1 ? target : target.contiguous();
  }
  if (class_weight) j.w = class_weight->contiguous();
  j.ignore_index = ignore_index;
  j.alpha = static_cast<float>(1.0 - label_smoothing);
  j.beta = static_cast<float>(label_smoothing / static_cast<double>(vocab_size));
  return j;
}

cuda::SoftTargetParams soft_rows(const SoftJob& job, int64_t s0) {
  cuda::SoftTargetParams y{};
  if (job.q.defined()) {
    y.q_dtype = to_dtype(job.q.scalar_type());
    y.ldq = job.q.size(0) > 1 ? job.q.stride(0) : job.q.size(1);
    y.q = static_cast<const char*>(job.q.data_ptr()) + s0 * y.ldq * job.q.element_size();
  } else {
    y.t = job.t.data_ptr<int64_t>() + s0 * job.t.stride(0);
    y.t_stride = job.t.stride(0);
  }
  y.ignore_index = job.ignore_index;
  y.w = job.w.defined() ? job.w.data_ptr<float>() : nullptr;
  y.alpha = job.alpha;
  y.beta = job.beta;
  return y;
}

void launch_soft_merge(const float* parts, const int64_t* pivots, int64_t ranks, int64_t n,
                       float* stats, int64_t* pivot, bool finalize, const float* z_weight,
                       double z_loss, float* loss, float* lse, float* entropy) {
  cuda::SoftCombineParams cp{};
  cp.partials = parts;
  cp.pivots = pivots;
  cp.ranks = ranks;
  cp.n = n;
  cp.z_weight = z_weight;
  cp.z_loss = static_cast<float>(z_loss);
  cp.stats = stats;
  cp.pivot = pivot;
  cp.loss = loss;
  cp.lse = lse;
  cp.entropy = entropy;
  check_launch(cuda::launch_soft_combine(cp, finalize, dev::stream()), "soft_combine");
}

void launch_soft_coef(int64_t n, const at::Tensor& stats, const at::Tensor& grad_loss,
                      const std::optional<at::Tensor>& grad_lse,
                      const std::optional<at::Tensor>& grad_entropy,
                      const std::optional<at::Tensor>& z_weight, double z_loss,
                      double temperature, float* coef, float* bound) {
  cuda::RowCoefParams rp{};
  rp.n = n;
  rp.soft = true;
  rp.stats = stats.data_ptr<float>();
  rp.stats_row_stride = stats.stride(0);
  rp.stats_col_stride = stats.stride(1);
  rp.grad_loss = grad_loss.data_ptr<float>();
  rp.grad_loss_stride = grad_loss.stride(0);
  rp.grad_lse = grad_lse ? grad_lse->data_ptr<float>() : nullptr;
  rp.grad_lse_stride = grad_lse ? grad_lse->stride(0) : 0;
  rp.grad_entropy = grad_entropy ? grad_entropy->data_ptr<float>() : nullptr;
  rp.grad_entropy_stride = grad_entropy ? grad_entropy->stride(0) : 0;
  rp.z_weight = z_weight ? z_weight->data_ptr<float>() : nullptr;
  rp.z_weight_stride = z_weight ? z_weight->stride(0) : 0;
  rp.z_loss = static_cast<float>(z_loss);
  rp.temperature = static_cast<float>(temperature);
  rp.coef = coef;
  rp.bound = bound;
  check_launch(cuda::launch_row_coef(rp, dev::stream()), "soft_coef");
}

std::tuple<at::Tensor, at::Tensor> soft_partial_stats_cuda(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& class_weight,
    int64_t vocab_start, int64_t vocab_size, int64_t ignore_index, double label_smoothing,
    double softcap, double temperature) {
  check_linear_operands(input, weight, bias);
  check_soft_target_args(input, target, class_weight, weight.size(0));
  check_device_tensor(input, input, "input");
  const dev::Guard guard(input);
  const NvtxRange range("flce::soft_partial_stats");
  poll_target_checks();
  const SoftJob soft = soft_job(target, class_weight, input.size(0), weight.size(0), vocab_size,
                                ignore_index, label_smoothing);
  LinearJob job{input, weight, at::Tensor(), bias};
  job.shard.vocab_start = vocab_start;
  job.shard.vocab_size = vocab_size;
  job.softcap = softcap;
  job.temperature = temperature;
  job.soft = &soft;
  at::Tensor pivot;
  at::Tensor partials = stats_chunks(job, false, true, &pivot);
  return {partials, pivot};
}

Tensor5 soft_combine_impl(const at::Tensor& partials, const at::Tensor& pivot,
                          const std::optional<at::Tensor>& z_weight, double z_loss) {
  const at::Tensor p = partials.contiguous(), pv = pivot.contiguous();
  const at::Tensor zw = z_weight ? z_weight->contiguous() : at::Tensor();
  const int64_t n = p.size(1);
  const auto f32 = p.options();
  at::Tensor loss = dev::empty({n}, f32), lse = dev::empty({n}, f32),
             ent = dev::empty({n}, f32), stats = dev::empty({n, cuda::kSoftCols}, f32),
             piv = dev::empty({n}, pv.options());
  launch_soft_merge(p.data_ptr<float>(), pv.data_ptr<int64_t>(), p.size(0), n,
                    stats.data_ptr<float>(), piv.data_ptr<int64_t>(), /*finalize=*/true,
                    zw.defined() ? zw.data_ptr<float>() : nullptr, z_loss,
                    loss.data_ptr<float>(), lse.data_ptr<float>(), ent.data_ptr<float>());
  return {loss, lse, stats, piv, ent};
}

Tensor5 soft_combine_cuda(const at::Tensor& partials, const at::Tensor& pivot,
                          const std::optional<at::Tensor>& z_weight, double z_loss) {
  check_soft_combine_args(partials, pivot, z_weight);
  check_device_tensor(partials, partials, "partials");
  const dev::Guard guard(partials);
  const NvtxRange range("flce::soft_combine");
  poll_target_checks();
  return soft_combine_impl(partials, pivot, z_weight, z_loss);
}

// soft_combine(soft_partial_stats(...)) on one device (as flce's composite; registered here so
// that the emulated namespace has it too).
Tensor5 soft_forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& target, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& class_weight,
                          const std::optional<at::Tensor>& z_weight, int64_t ignore_index,
                          double label_smoothing, double z_loss, double softcap,
                          double temperature) {
  auto [partials, pivot] =
      soft_partial_stats_cuda(input, weight, target, bias, class_weight, 0, weight.size(0),
                              ignore_index, label_smoothing, softcap, temperature);
  if (z_weight) check_device_tensor(*z_weight, input, "z_weight");
  check_soft_combine_args(partials.unsqueeze(0), pivot.unsqueeze(0), z_weight);
  return soft_combine_impl(partials.unsqueeze(0), pivot.unsqueeze(0), z_weight, z_loss);
}

Tensor3 soft_backward_cuda(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                           const std::optional<at::Tensor>& grad_entropy, const at::Tensor& input,
                           const at::Tensor& weight, const at::Tensor& target,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& class_weight, const at::Tensor& stats,
                           const at::Tensor& pivot, const std::optional<at::Tensor>& z_weight,
                           int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                           double label_smoothing, double z_loss, double softcap,
                           double temperature, std::array<bool, 3> output_mask,
                           bool grad_input_fp32) {
  check_soft_backward_args(grad_loss, grad_lse, grad_entropy, input, weight, target, bias,
                           class_weight, stats, pivot, z_weight);
  check_device_tensor(input, input, "input");
  check_device_tensor(grad_loss, input, "grad_loss");
  check_device_tensor(stats, input, "stats");
  check_device_tensor(pivot, input, "pivot");
  const dev::Guard guard(input);
  const NvtxRange range("flce::soft_backward");
  poll_target_checks();
  const bool need_e = output_mask[0], need_c = output_mask[1], need_b = output_mask[2] && bias;
  if (auto none = nothing_to_compute(input, weight, bias, {need_e, need_c, need_b},
                                    grad_input_fp32)) {
    return *none;
  }
  const SoftJob soft = soft_job(target, class_weight, input.size(0), weight.size(0), vocab_size,
                                ignore_index, label_smoothing);
  // The pivots are the rows' targets (ignore_index -1: a row without one).
  LinearJob job{input, weight, pivot.contiguous(), bias};
  job.shard.vocab_start = vocab_start;
  job.shard.vocab_size = vocab_size;
  job.ignore_index = -1;
  job.z_loss = z_loss;
  job.softcap = softcap;
  job.temperature = temperature;
  job.soft = &soft;
  GradJob grads;
  grads.stats = stats.contiguous();
  grads.grad_loss = grad_loss;
  grads.grad_lse = grad_lse;
  grads.grad_entropy = grad_entropy;
  grads.z_weight = z_weight;
  grads.mask = {need_e, need_c, need_b};
  return recompute_grads(job, grads, grad_input_fp32);
}

}  // namespace binding

FLCE_CUDA_IMPL(m) {
  m.impl("soft_partial_stats", &binding::soft_partial_stats_cuda);
  m.impl("soft_combine", &binding::soft_combine_cuda);
  m.impl("soft_forward", &binding::soft_forward_cuda);
  m.impl("soft_backward", &binding::soft_backward_cuda);
}

}  // namespace flce
