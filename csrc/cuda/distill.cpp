// flce::distill_rows_ on the CUDA backend: the row math of flce.linear_distillation's chunk loop
// (python/flce/distill.py, which calls it between its cuBLAS GEMMs) as one launch of
// distill_rows_kernel (flce_distill.cu). Opt-in (FLCE_CUDA_OPT_IN=distill, read by Python) until
// it has run on a GPU (docs/cuda.md "Distillation"). The same contract and argument checks as
// the CPU op (csrc/cpu/distill_cpu.cpp), but the valid rows' targets, which are checked without
// a host sync (check_targets: reported at a later call) and give their row a NaN loss meanwhile.
//   distill_rows_
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <string>

#include "cuda/binding.h"
#include "cuda/device.h"

namespace flce {
namespace binding {

void distill_rows_cuda(at::Tensor& z_s, at::Tensor& z_t, at::Tensor& loss,
                       const at::Tensor& target, const at::Tensor& valid,
                       c10::string_view divergence, double beta, double temperature,
                       double hard_weight, double soft_weight, bool grad_s, bool grad_t) {
  TORCH_CHECK(z_s.dim() == 2 && z_t.sizes() == z_s.sizes(),
              "flce::distill_rows_: z_s and z_t must be [rows, V] of one shape, got ",
              z_s.sizes(), " and ", z_t.sizes());
  TORCH_CHECK((z_s.scalar_type() == at::kFloat || z_s.scalar_type() == at::kDouble) &&
                  z_t.scalar_type() == z_s.scalar_type() && loss.scalar_type() == z_s.scalar_type(),
              "flce::distill_rows_: z_s, z_t and loss must be float32 or float64, one dtype");
  TORCH_CHECK(z_s.is_contiguous() && z_t.is_contiguous() && loss.is_contiguous(),
              "flce::distill_rows_: z_s, z_t and loss must be contiguous");
  const int64_t rows = z_s.size(0), v = z_s.size(1);
  TORCH_CHECK(loss.dim() == 1 && loss.size(0) == rows, "flce::distill_rows_: loss must be [",
              rows, "]");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == rows && target.scalar_type() == at::kLong &&
                  target.is_contiguous(),
              "flce::distill_rows_: target must be [rows] int64, contiguous");
  TORCH_CHECK(valid.dim() == 1 && valid.size(0) == rows && valid.scalar_type() == at::kBool &&
                  valid.is_contiguous(),
              "flce::distill_rows_: valid must be [rows] bool, contiguous");
  TORCH_CHECK(v >= 1, "flce::distill_rows_: V must be at least 1");
  cuda::DistillDiv div;
  if (divergence == "forward_kl") {
    div = cuda::DistillDiv::kForwardKl;
  } else if (divergence == "reverse_kl") {
    div = cuda::DistillDiv::kReverseKl;
  } else {
    TORCH_CHECK(divergence == "jsd", "flce::distill_rows_: divergence must be forward_kl, "
                "reverse_kl or jsd, got ", std::string(divergence));
    TORCH_CHECK(beta > 0.0 && beta < 1.0, "flce::distill_rows_: jsd needs beta in (0, 1), got ",
                beta);
    div = cuda::DistillDiv::kJsd;
  }
  TORCH_CHECK(temperature > 0.0, "flce::distill_rows_: temperature must be positive");
  check_device_tensor(z_s, z_s, "z_s");
  check_device_tensor(z_t, z_s, "z_t");
  check_device_tensor(loss, z_s, "loss");
  check_device_tensor(target, z_s, "target");
  check_device_tensor(valid, z_s, "valid");
  const dev::Guard guard(z_s);
  const NvtxRange range("flce::distill_rows_");
  poll_target_checks();
  if (hard_weight != 0.0) {
    // (the targets of ignored rows are not read: -1, the check's ignore_index)
    check_targets(at::Tensor(), at::where(valid, target, -1), v, -1);
  }
  cuda::DistillRowsParams p{};
  p.z_s = z_s.data_ptr();
  p.z_t = z_t.data_ptr();
  p.loss = loss.data_ptr();
  p.target = target.data_ptr<int64_t>();
  p.valid = valid.data_ptr<bool>();
  p.n = rows;
  p.v = v;
  p.div = div;
  p.fp64 = z_s.scalar_type() == at::kDouble;
  p.grad_s = grad_s;
  p.grad_t = grad_t;
  p.beta = beta;
  p.logit_beta = div == cuda::DistillDiv::kJsd ? std::log(beta / (1.0 - beta)) : 0.0;
  p.temperature = temperature;
  p.hard_weight = hard_weight;
  p.soft_weight = soft_weight;
  check_launch(cuda::launch_distill_rows(p, dev::stream()), "distill_rows");
}

}  // namespace binding

FLCE_CUDA_IMPL(m) { m.impl("distill_rows_", &binding::distill_rows_cuda); }

}  // namespace flce
