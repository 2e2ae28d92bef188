// The argument checks every backend shares (declared in flce_ops.h). Kept apart from ops.cpp,
// which registers the `flce` library, so that the test-only emulated CUDA binding
// (tools/cuda_host/binding/) links them without registering `flce` twice.
#include <ATen/ATen.h>

#include <string>

#include "flce_ops.h"

namespace flce {

namespace {
bool is_float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}
}  // namespace

void check_linear_operands(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(input.dim() == 2, "flce: input must be [N, D], got ", input.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2, "flce: weight must be [V, D], got ", weight.sizes());
  TORCH_CHECK_VALUE(input.size(1) == weight.size(1), "flce: input has D=", input.size(1),
                    " but weight has D=", weight.size(1));
  TORCH_CHECK_TYPE(is_float_kind(input.scalar_type()),
                   "flce: input must be float32, bfloat16 or float16, got ", input.scalar_type());
  TORCH_CHECK_TYPE(is_float_kind(weight.scalar_type()),
                   "flce: weight must be float32, bfloat16 or float16, got ", weight.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == input.scalar_type() || weight.scalar_type() == at::kFloat,
                   "flce: weight must have the input's dtype (", input.scalar_type(),
                   ") or be float32 master weights, got ", weight.scalar_type());
  TORCH_CHECK_VALUE(input.device() == weight.device(),
                    "flce: input and weight must be on one device, got ", input.device(), ", ",
                    weight.device());
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

void check_rounded_grad(const at::Tensor& input, std::optional<bool> exact_bf16_grad) {
  TORCH_CHECK_VALUE(!(exact_bf16_grad.value_or(false) && input.scalar_type() == at::kBFloat16),
                    "flce: exact_bf16_grad=True: the CUDA backend rounds bf16 gradient tiles "
                    "once (dE and dW within 1.5x bf16's rounding floor) and has no exact mode; "
                    "pass None or False, or run the exact mode on the CPU backend");
}

void check_linear_args(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                       const std::optional<at::Tensor>& bias) {
  check_linear_operands(input, weight, bias);
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == input.size(0),
                    "flce: target must be [N] with N=", input.size(0), ", got ", target.sizes());
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, "flce: target must be int64, got ",
                   target.scalar_type());
  TORCH_CHECK_VALUE(input.device() == target.device(),
                    "flce: input and target must be on one device, got ", input.device(), ", ",
                    target.device());
}

void check_soft_target_args(const at::Tensor& input, const at::Tensor& target,
                            const std::optional<at::Tensor>& class_weight, int64_t v_local) {
  const int64_t n = input.size(0);
  if (target.scalar_type() == at::kLong) {
    TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == n,
                      "flce: class targets must be [N] with N=", n, ", got ", target.sizes());
  } else {
    TORCH_CHECK_TYPE(is_float_kind(target.scalar_type()),
                     "flce: target must be int64 class ids or float32/bfloat16/float16 "
                     "probabilities, got ", target.scalar_type());
    TORCH_CHECK_VALUE(target.dim() == 2 && target.size(0) == n && target.size(1) == v_local,
                      "flce: probability targets must be [N, V] with N=", n, ", V=", v_local,
                      ", got ", target.sizes());
  }
  TORCH_CHECK_VALUE(target.device() == input.device(), "flce: target must be on ",
                    input.device(), ", got ", target.device());
  if (class_weight) {
    TORCH_CHECK_VALUE(class_weight->dim() == 1 && class_weight->size(0) == v_local &&
                          class_weight->scalar_type() == at::kFloat &&
                          class_weight->device() == input.device(),
                      "flce: class_weight must be float32 [V] with V=", v_local, " on ",
                      input.device(), ", got ", class_weight->scalar_type(), " ",
                      class_weight->sizes());
  }
}

void check_soft_combine_args(const at::Tensor& partials, const at::Tensor& pivot,
                             const std::optional<at::Tensor>& z_weight) {
  TORCH_CHECK_VALUE(partials.dim() == 3 && partials.size(2) == kSoftCols &&
                        partials.scalar_type() == at::kFloat,
                    "flce: soft partials must be float32 [R, N, ", kSoftCols, "], got ",
                    partials.sizes());
  TORCH_CHECK_VALUE(pivot.dim() == 2 && pivot.size(0) == partials.size(0) &&
                        pivot.size(1) == partials.size(1) && pivot.scalar_type() == at::kLong &&
                        pivot.device() == partials.device(),
                    "flce: pivot must be int64 [R, N] beside partials ", partials.sizes(),
                    ", got ", pivot.sizes());
  if (z_weight) {
    TORCH_CHECK_VALUE(z_weight->dim() == 1 && z_weight->size(0) == partials.size(1) &&
                          z_weight->scalar_type() == at::kFloat &&
                          z_weight->device() == partials.device(),
                      "flce: z_weight must be float32 [N]");
  }
}

void check_combine_args(const at::Tensor& partials, const at::Tensor& target) {
  TORCH_CHECK_VALUE(partials.dim() == 3 && partials.size(2) == kPartialCols &&
                        partials.size(1) == target.size(0),
                    "flce: partials must be [R, N, ", kPartialCols, "] with N=", target.size(0),
                    ", got ", partials.sizes());
  TORCH_CHECK_TYPE(partials.scalar_type() == at::kFloat, "flce: partials must be float32");
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, "flce: target must be int64");
  TORCH_CHECK_VALUE(partials.device() == target.device(),
                    "flce: partials and target must be on one device");
}

namespace {
// The per-row upstream gradients and statistics of a backward over n rows.
void check_row_grads(int64_t n, const at::Tensor& grad_loss,
                     const std::optional<at::Tensor>& grad_lse,
                     const std::optional<at::Tensor>& grad_entropy, const at::Tensor& stats,
                     int64_t stats_cols = kStatsCols);
}  // namespace

namespace {
void check_logits_tensor(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "flce: logits must be [N, V], got ", logits.sizes());
  TORCH_CHECK_TYPE(is_float_kind(logits.scalar_type()),
                   "flce: logits must be float32, bfloat16 or float16, got ",
                   logits.scalar_type());
  // (an empty tensor's strides are whatever its view left: nothing is read through them)
  TORCH_CHECK_VALUE(logits.stride(1) == 1 || logits.size(1) <= 1 || logits.numel() == 0,
                    "flce: logits must have a unit column stride, got strides ",
                    logits.strides());
}
}  // namespace

void check_logits_args(const at::Tensor& logits, const at::Tensor& target) {
  check_logits_tensor(logits);
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == logits.size(0),
                    "flce: target must be [N] with N=", logits.size(0), ", got ", target.sizes());
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, "flce: target must be int64, got ",
                   target.scalar_type());
  TORCH_CHECK_VALUE(logits.device() == target.device(),
                    "flce: logits and target must be on one device, got ", logits.device(),
                    ", ", target.device());
}

void check_logits_backward_args(const at::Tensor& grad_loss,
                                const std::optional<at::Tensor>& grad_lse,
                                const std::optional<at::Tensor>& grad_entropy,
                                const at::Tensor& logits, const at::Tensor& target,
                                const at::Tensor& stats) {
  check_logits_args(logits, target);
  check_row_grads(logits.size(0), grad_loss, grad_lse, grad_entropy, stats);
}

void check_soft_backward_args(const at::Tensor& grad_loss,
                              const std::optional<at::Tensor>& grad_lse,
                              const std::optional<at::Tensor>& grad_entropy,
                              const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& target, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& class_weight,
                              const at::Tensor& stats, const at::Tensor& pivot,
                              const std::optional<at::Tensor>& z_weight) {
  check_linear_operands(input, weight, bias);
  check_soft_target_args(input, target, class_weight, weight.size(0));
  check_soft_rows(input.size(0), grad_loss, grad_lse, grad_entropy, stats, pivot, z_weight);
}

void check_soft_logits_args(const at::Tensor& logits, const at::Tensor& target,
                            const std::optional<at::Tensor>& class_weight) {
  check_logits_tensor(logits);
  check_soft_target_args(logits, target, class_weight, logits.size(1));
}

void check_soft_rows(int64_t n, const at::Tensor& grad_loss,
                     const std::optional<at::Tensor>& grad_lse,
                     const std::optional<at::Tensor>& grad_entropy, const at::Tensor& stats,
                     const at::Tensor& pivot, const std::optional<at::Tensor>& z_weight) {
  check_row_grads(n, grad_loss, grad_lse, grad_entropy, stats, kSoftCols);
  TORCH_CHECK_VALUE(pivot.dim() == 1 && pivot.size(0) == n && pivot.scalar_type() == at::kLong,
                    "flce: pivot must be int64 [N], got ", pivot.sizes());
  if (z_weight) {
    TORCH_CHECK_VALUE(z_weight->dim() == 1 && z_weight->size(0) == n &&
                          z_weight->scalar_type() == at::kFloat,
                      "flce: z_weight must be float32 [N]");
  }
}

void check_backward_args(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                         const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& target, const std::optional<at::Tensor>& bias,
                         const at::Tensor& stats, const std::optional<at::Tensor>& grad_entropy) {
  check_linear_args(input, weight, target, bias);
  check_row_grads(input.size(0), grad_loss, grad_lse, grad_entropy, stats);
}

namespace {
void check_row_grads(int64_t n, const at::Tensor& grad_loss,
                     const std::optional<at::Tensor>& grad_lse,
                     const std::optional<at::Tensor>& grad_entropy, const at::Tensor& stats,
                     int64_t stats_cols) {
  TORCH_CHECK_VALUE(grad_loss.dim() == 1 && grad_loss.size(0) == n &&
                        grad_loss.scalar_type() == at::kFloat,
                    "flce: grad_loss must be float32 [N], got ", grad_loss.sizes(), " ",
                    grad_loss.scalar_type());
  if (grad_lse) {
    TORCH_CHECK_VALUE(grad_lse->dim() == 1 && grad_lse->size(0) == n &&
                          grad_lse->scalar_type() == at::kFloat,
                      "flce: grad_lse must be float32 [N]");
  }
  if (grad_entropy) {
    TORCH_CHECK_VALUE(grad_entropy->dim() == 1 && grad_entropy->size(0) == n &&
                          grad_entropy->scalar_type() == at::kFloat,
                      "flce: grad_entropy must be float32 [N]");
  }
  TORCH_CHECK_VALUE(stats.dim() == 2 && stats.size(0) == n && stats.size(1) == stats_cols &&
                        stats.scalar_type() == at::kFloat,
                    "flce: stats must be float32 [N, ", stats_cols, "], got ", stats.sizes());
}
}  // namespace

int check_distill_rows_args(const at::Tensor& z_s, const at::Tensor& z_t, const at::Tensor& loss,
                            const at::Tensor& target, const at::Tensor& valid,
                            c10::string_view divergence, double beta, double temperature) {
  TORCH_CHECK(z_s.dim() == 2 && z_t.sizes() == z_s.sizes(),
              "flce::distill_rows_: z_s and z_t must be [rows, V] of one shape, got ",
              z_s.sizes(), " and ", z_t.sizes());
  TORCH_CHECK((z_s.scalar_type() == at::kFloat || z_s.scalar_type() == at::kDouble) &&
                  z_t.scalar_type() == z_s.scalar_type() && loss.scalar_type() == z_s.scalar_type(),
              "flce::distill_rows_: z_s, z_t and loss must be float32 or float64, one dtype");
  TORCH_CHECK(z_s.is_contiguous() && z_t.is_contiguous() && loss.is_contiguous(),
              "flce::distill_rows_: z_s, z_t and loss must be contiguous");
  const int64_t rows = z_s.size(0);
  TORCH_CHECK(loss.dim() == 1 && loss.size(0) == rows, "flce::distill_rows_: loss must be [",
              rows, "]");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == rows && target.scalar_type() == at::kLong &&
                  target.is_contiguous(),
              "flce::distill_rows_: target must be [rows] int64, contiguous");
  TORCH_CHECK(valid.dim() == 1 && valid.size(0) == rows && valid.scalar_type() == at::kBool &&
                  valid.is_contiguous(),
              "flce::distill_rows_: valid must be [rows] bool, contiguous");
  TORCH_CHECK(z_s.size(1) >= 1, "flce::distill_rows_: V must be at least 1");
  TORCH_CHECK(temperature > 0.0, "flce::distill_rows_: temperature must be positive");
  if (divergence == "forward_kl") return 0;
  if (divergence == "reverse_kl") return 1;
  TORCH_CHECK(divergence == "jsd", "flce::distill_rows_: divergence must be forward_kl, "
              "reverse_kl or jsd, got ", std::string(divergence));
  TORCH_CHECK(beta > 0.0 && beta < 1.0, "flce::distill_rows_: jsd needs beta in (0, 1), got ",
              beta);
  return 2;
}

}  // namespace flce
