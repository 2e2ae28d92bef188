// The flce operator library: schemas declared once, here. Backends implement them with
// TORCH_LIBRARY_IMPL(flce, CPU|CUDA, m); Python registers fake (meta) kernels and autograd
// (python/flce/_ops.py).
//
// Shapes: input [N, D], weight [V_local, D], target [N] (int64, global vocabulary ids),
// bias [V_local]. Python flattens (..., D) inputs to [N, D]. A single-device call is the
// vocab-parallel case with one rank: vocab_start = 0, V_local = vocab_size.
#include <Python.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>

#include "cpu/tile_gemm.h"
#include "flce_ops.h"

namespace flce {

namespace {
bool is_float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}
}  // namespace

void check_linear_args(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(input.dim() == 2, "flce: input must be [N, D], got ", input.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2, "flce: weight must be [V, D], got ", weight.sizes());
  TORCH_CHECK_VALUE(input.size(1) == weight.size(1), "flce: input has D=", input.size(1),
                    " but weight has D=", weight.size(1));
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == input.size(0),
                    "flce: target must be [N] with N=", input.size(0), ", got ", target.sizes());
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, "flce: target must be int64, got ",
                   target.scalar_type());
  TORCH_CHECK_TYPE(is_float_kind(input.scalar_type()),
                   "flce: input must be float32, bfloat16 or float16, got ", input.scalar_type());
  TORCH_CHECK_TYPE(is_float_kind(weight.scalar_type()),
                   "flce: weight must be float32, bfloat16 or float16, got ", weight.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == input.scalar_type() || weight.scalar_type() == at::kFloat,
                   "flce: weight must have the input's dtype (", input.scalar_type(),
                   ") or be float32 master weights, got ", weight.scalar_type());
  TORCH_CHECK_VALUE(input.device() == weight.device() && input.device() == target.device(),
                    "flce: input, weight and target must be on one device, got ", input.device(),
                    ", ", weight.device(), ", ", target.device());
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0),
                      "flce: bias must be [V] with V=", weight.size(0), ", got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == weight.scalar_type(),
                     "flce: bias must have the weight's dtype ", weight.scalar_type(), ", got ",
                     bias->scalar_type());
    TORCH_CHECK_VALUE(bias->device() == input.device(), "flce: bias must be on ", input.device(),
                      ", got ", bias->device());
  }
}

void check_combine_args(const at::Tensor& partials, const at::Tensor& target) {
  TORCH_CHECK_VALUE(partials.dim() == 3 && partials.size(2) == 4 &&
                        partials.size(1) == target.size(0),
                    "flce: partials must be [R, N, 4] with N=", target.size(0), ", got ",
                    partials.sizes());
  TORCH_CHECK_TYPE(partials.scalar_type() == at::kFloat, "flce: partials must be float32");
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, "flce: target must be int64");
  TORCH_CHECK_VALUE(partials.device() == target.device(),
                    "flce: partials and target must be on one device");
}

void check_backward_args(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                         const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& target, const std::optional<at::Tensor>& bias,
                         const at::Tensor& stats) {
  check_linear_args(input, weight, target, bias);
  const int64_t n = input.size(0);
  TORCH_CHECK_VALUE(grad_loss.dim() == 1 && grad_loss.size(0) == n &&
                        grad_loss.scalar_type() == at::kFloat,
                    "flce: grad_loss must be float32 [N], got ", grad_loss.sizes(), " ",
                    grad_loss.scalar_type());
  if (grad_lse) {
    TORCH_CHECK_VALUE(grad_lse->dim() == 1 && grad_lse->size(0) == n &&
                          grad_lse->scalar_type() == at::kFloat,
                      "flce: grad_lse must be float32 [N]");
  }
  TORCH_CHECK_VALUE(stats.dim() == 2 && stats.size(0) == n && stats.size(1) == 3 &&
                        stats.scalar_type() == at::kFloat,
                    "flce: stats must be float32 [N, 3], got ", stats.sizes());
}

// forward = combine(partial_stats(...)) on one device. Composite so that every backend that
// implements the two parts gets it; a backend may register a fused kernel of its own instead.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_composite(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
    double z_loss, double softcap) {
  static auto partial_op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flce::partial_stats", "")
                               .typed<PartialStatsFn>();
  static auto combine_op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flce::combine", "")
                               .typed<CombineFn>();
  at::Tensor partials = partial_op.call(input, weight, target, bias, 0, ignore_index, softcap);
  return combine_op.call(partials.unsqueeze(0), target, weight.size(0), ignore_index,
                         label_smoothing, z_loss);
}

TORCH_LIBRARY(flce, m) {
  // Per-row statistics of this rank's vocabulary shard [vocab_start, vocab_start + V_local):
  // [N, 4] fp32 = (m, s, z_t, sum_z): running max and sum exp(z - m) over the shard's non-target
  // logits, the target logit (-inf where the shard does not own the target or the row is
  // ignored), and the sum of the shard's logits (label smoothing).
  m.def(
      "partial_stats(Tensor input, Tensor weight, Tensor target, Tensor? bias, int vocab_start, "
      "int ignore_index, float softcap) -> Tensor");
  // Combine R ranks' partials [R, N, 4] into the collapse-safe loss. Validates targets against
  // the global vocab_size. Returns loss [N], lse [N], stats [N, 3] = (m_x, s_x, z_t) (the
  // non-target logits' max and sum exp(z - m_x), and the target logit), all fp32.
  m.def(
      "combine(Tensor partials, Tensor target, int vocab_size, int ignore_index, "
      "float label_smoothing, float z_loss) -> (Tensor loss, Tensor lse, Tensor stats)");
  m.def(
      "forward(Tensor input, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap) -> (Tensor loss, Tensor lse, "
      "Tensor stats)");
  // Gradients from recomputed logit tiles and the fp32 row statistics. grad_loss [N] fp32 (may be
  // an expanded scalar), grad_lse [N] fp32 or None. Outputs follow output_mask (input, weight,
  // bias); an unrequested one is an empty tensor. Each gradient has the dtype of its tensor.
  m.def(
      "backward(Tensor grad_loss, Tensor? grad_lse, Tensor input, Tensor weight, Tensor target, "
      "Tensor? bias, Tensor stats, int vocab_start, int vocab_size, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, bool[3] output_mask) -> "
      "(Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // The reduced loss (fp32 scalar: the sum, or with mean=True the mean over non-ignored rows)
  // and, per output_mask, the gradients of the *sum*, computed in the same pass (no recompute).
  // `divisor` (float64 scalar) is what the loss was divided by (1 or the token count).
  // Gradients are deferred: fp32 (sum, compensation) pairs [2, *shape] (empty when not
  // requested), for scale_grad once the upstream gradient is known. For reduction "sum"/"mean"
  // when gradients are needed.
  m.def(
      "sum_and_grad(Tensor input, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
      "float label_smoothing, float z_loss, float softcap, bool[3] output_mask, bool mean) -> "
      "(Tensor loss, Tensor divisor, Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // dtype((pair[0] + pair[1]) * scale), computed in double and rounded once.
  m.def("scale_grad(Tensor pair, Tensor scale, ScalarType dtype) -> Tensor");
  // The CPU backend's tile GEMM path in this process, "onednn" or "blas" (csrc/cpu/tile_gemm.h);
  // flce.build_info()["cpu_gemm"].
  m.def("cpu_gemm_path() -> str", [] {
    return std::string(cpu::gemm_path(at::kFloat) == cpu::GemmPath::onednn ? "onednn" : "blas");
  });
}

TORCH_LIBRARY_IMPL(flce, CompositeExplicitAutograd, m) { m.impl("forward", &forward_composite); }

}  // namespace flce

// flce._C is imported only for the side effect of registering the ops above; the module itself
// is empty (extension-cpp style, limited API).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
