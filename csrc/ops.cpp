// The flce operator library: the `flce` namespace with the schemas of ops_def.h and the composite
// forward (the shared argument checks are in checks.cpp). Backends implement the ops with
// TORCH_LIBRARY_IMPL(flce, CPU|CUDA, m); Python registers fake (meta) kernels and autograd
// (python/flce/_ops.py).
#include <Python.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>

#include "cpu/single_pass.h"
#include "cpu/tile_gemm.h"
#include "flce_ops.h"
#include "ops_def.h"

namespace flce {

// forward = combine(partial_stats(...)) on one device. Composite so that every backend that
// implements the two parts gets it; a backend may register a fused kernel of its own instead.
Tensor4 forward_composite(const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& target, const std::optional<at::Tensor>& bias,
                          int64_t ignore_index, double label_smoothing, double z_loss,
                          double softcap, double temperature,
                          std::optional<bool> /*exact_bf16_grad: the autograd's*/) {
  static auto partial_op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flce::partial_stats", "")
                               .typed<PartialStatsFn>();
  static auto combine_op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flce::combine", "")
                               .typed<CombineFn>();
  at::Tensor partials =
      partial_op.call(input, weight, target, bias, 0, ignore_index, softcap, temperature);
  return combine_op.call(partials.unsqueeze(0), target, weight.size(0), ignore_index,
                         label_smoothing, z_loss);
}

// soft_forward = soft_combine(soft_partial_stats(...)) on one device, composite as forward.
Tensor5 soft_forward_composite(const at::Tensor& input, const at::Tensor& weight,
                               const at::Tensor& target, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& class_weight,
                               const std::optional<at::Tensor>& z_weight, int64_t ignore_index,
                               double label_smoothing, double z_loss, double softcap,
                               double temperature) {
  static auto partial_op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flce::soft_partial_stats", "")
                               .typed<SoftPartialStatsFn>();
  static auto combine_op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flce::soft_combine", "")
                               .typed<SoftCombineFn>();
  auto [partials, pivot] =
      partial_op.call(input, weight, target, bias, class_weight, 0, weight.size(0), ignore_index,
                      label_smoothing, softcap, temperature);
  return combine_op.call(partials.unsqueeze(0), pivot.unsqueeze(0), z_weight, z_loss);
}

// soft_logits_forward = soft_combine(soft_logits_stats(...)) on one device.
Tensor5 soft_logits_forward_composite(const at::Tensor& logits, const at::Tensor& target,
                                      const std::optional<at::Tensor>& class_weight,
                                      const std::optional<at::Tensor>& z_weight,
                                      int64_t ignore_index, double label_smoothing,
                                      double z_loss, double softcap, double temperature) {
  static auto stats_op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flce::soft_logits_stats", "")
                             .typed<SoftLogitsStatsFn>();
  static auto combine_op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flce::soft_combine", "")
                               .typed<SoftCombineFn>();
  auto [partials, pivot] = stats_op.call(logits, target, class_weight, 0, logits.size(1),
                                         ignore_index, label_smoothing, softcap, temperature);
  return combine_op.call(partials.unsqueeze(0), pivot.unsqueeze(0), z_weight, z_loss);
}

TORCH_LIBRARY(flce, m) {
  define_ops(m);
  // The CPU backend's tile GEMM path in this process, "onednn" or "blas" (csrc/cpu/tile_gemm.h);
  // flce.build_info()["cpu_gemm"].
  m.def("cpu_gemm_path() -> str", [] {
    return std::string(cpu::gemm_path(at::kFloat) == cpu::GemmPath::onednn ? "onednn" : "blas");
  });
  // Whether the CPU backend's bf16 tile GEMMs run on AMX (cpu::bf16_gemm_amx);
  // flce.build_info()["cpu_amx"], and the CPU's bf16 training path (flce/api.py).
  m.def("cpu_bf16_amx() -> bool", [] { return cpu::bf16_gemm_amx(); });
  // Whether they multiply bf16 natively (cpu::bf16_gemm_native: AMX, AVX512-BF16 or oneDNN)
  // rather than widened to fp32; flce.build_info()["cpu_bf16_native"].
  m.def("cpu_bf16_native() -> bool", [] { return cpu::bf16_gemm_native(); });
  // How the CPU backend multiplies bf16 gradient tiles for a given exact_bf16_grad
  // (cpu::bf16_grad): "rounded", "split" or "widened"; flce.build_info()["cpu_bf16_grad"].
  m.def("cpu_bf16_grad(bool? exact_bf16_grad=None) -> str", [](std::optional<bool> exact) {
    return std::string(cpu::bf16_grad_name(cpu::bf16_grad(exact)));
  });
  // op(a) @ op(b) in fp32 on the CPU backend's tile GEMM engine (cpu::gemm_benchmark): the
  // benchmarks' floor (benchmarks/_peers.py, gemm3-flce), not part of the API.
  m.def("cpu_tile_gemm(Tensor a, Tensor b, bool trans_a=False, bool trans_b=False) -> Tensor",
        &cpu::gemm_benchmark);
  // The sizes of the CPU single pass's logits (cpu/single_pass.h), for Python's model of the
  // pass's memory (flce/_common.py, cpu_single_pass_bytes): [rows per block, logits bytes for
  // fp32 inputs, for 16-bit inputs, columns per tile, tile row padding in floats].
  // The row layouts (flce/layout.h): [kPartialCols, kStatsCols, kSoftCols].
  m.def("row_layout() -> int[]",
        [] { return std::vector<int64_t>{kPartialCols, kStatsCols, kSoftCols}; });
  m.def("cpu_single_pass_layout() -> int[]", [] {
    return std::vector<int64_t>{cpu::FUSED_BLOCK_N, cpu::kFusedWorkspaceBytes,
                                cpu::kFusedWorkspaceBytes16, cpu::BLOCK_V_WIDE, cpu::TILE_PAD};
  });
}

TORCH_LIBRARY_IMPL(flce, CompositeExplicitAutograd, m) {
  m.impl("forward", &forward_composite);
  m.impl("soft_forward", &soft_forward_composite);
  m.impl("soft_logits_forward", &soft_logits_forward_composite);
}

}  // namespace flce

// flce._C is imported only for the side effect of registering the ops above; the module itself
// is empty (extension-cpp style, limited API).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
