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

#include "cuda/binding.h"
#include "cuda/device.h"

namespace flce {
namespace binding {

void distill_rows_cuda(at::Tensor& z_s, at::Tensor& z_t, at::Tensor& loss,
                       const at::Tensor& target, const at::Tensor& valid,
                       c10::string_view divergence, double beta, double temperature,
                       double hard_weight, double soft_weight, bool grad_s, bool grad_t) {
  const auto div = static_cast<cuda::DistillDiv>(
      check_distill_rows_args(z_s, z_t, loss, target, valid, divergence, beta, temperature));
  const int64_t rows = z_s.size(0), v = z_s.size(1);
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
