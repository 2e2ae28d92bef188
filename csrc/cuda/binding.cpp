// What the CUDA binding's launch sequences share (declared in binding.h): NVTX ranges, launch and
// tensor checks, target checks without a host sync, the combine (finalize) of row partials, the
// workspace budget, the library GEMM, the row coefficients, and the recompute backward's
// gradients from given statistics. The launch sequences themselves are one file each (binding.h
// lists them); the kernels live in the torch-free *.cu files of this directory (params.h is the
// whole interface), and every device facility goes through dev:: (device.h): the same source is
// built for a GPU and, with FLCE_CUDA_HOST, against the host emulation of the kernels (CPU
// tensors, test-only op namespace flce_cuda_host), so that CI runs these launch sequences.
// Targets are checked without a host sync (see check_targets below). See docs/cuda.md.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <string>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "cuda/heuristics.h"
#include "cuda/params.h"
#include "flce_ops.h"

namespace flce {
namespace binding {

// Always on: without a profiler attached NVTX's calls return at once (no tool is injected), so a
// switch would save nothing a step can measure.
NvtxRange::NvtxRange(const char* name) { nvtxRangePushA(name); }

NvtxRange::~NvtxRange() { nvtxRangePop(); }

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "flce: CUDA launch of ", what, " failed: ",
              cudaGetErrorString(err));
}

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, "flce: unsupported dtype ", t);
  }
}

void check_device_tensor(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK_VALUE(dev::on_device(t) && t.device() == ref.device(), "flce: ", name,
                    " must be on ", ref.device(), " (", dev::device_kind(), "), got ", t.device());
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
}

at::Tensor aligned_contiguous(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

// ---------------------------------------------------------------------------------------------
// Target checks without a host sync. A kernel (combine) raises a device flag for a target outside
// [0, vocab_size) that is not ignore_index (such a row gets an infinite loss: its target logit
// is never found; targets are only compared with column ids, never used as an index). The flag,
// the first offending row and its target are copied to pinned host memory asynchronously; the
// IndexError is raised by the first flce call that finds the copy landed (usually the next op or
// step on a GPU; the next flce call in the host emulation, whose copy reports itself landed from
// its second poll on). FLCE_CHECK_TARGETS=sync waits for it in the same call (one device sync
// per forward); FLCE_CHECK_TARGETS=0 disables the check. Skipped while a CUDA graph is being
// captured.
// ---------------------------------------------------------------------------------------------
enum class CheckMode { kOff, kAsync, kSync };

CheckMode check_mode() {
  static const CheckMode mode = [] {
    const char* s = std::getenv("FLCE_CHECK_TARGETS");
    if (s == nullptr || *s == '\0' || std::strcmp(s, "1") == 0) return CheckMode::kAsync;
    if (std::strcmp(s, "0") == 0) return CheckMode::kOff;
    TORCH_CHECK_VALUE(std::strcmp(s, "sync") == 0,
                      "flce: FLCE_CHECK_TARGETS must be 0, 1 or sync, got '", s, "'");
    return CheckMode::kSync;
  }();
  return mode;
}

struct PendingCheck {
  dev::PendingCopy info;  // [3] int64: (flag, first offending row, its target)
  int64_t vocab_size, ignore_index;
};

// Checks still in flight, oldest first (shared by every device and thread of the process).
// Never destroyed: at exit a pending check's pinned buffer would be freed after the CUDA runtime
// has shut down (an abort, "driver shutting down"), or after the host emulation's allocation
// registry is gone.
std::mutex g_checks_mutex;
std::deque<PendingCheck>& g_checks = *new std::deque<PendingCheck>();

// Raises for the oldest landed failing check; wait_all: wait for every pending copy first.
void poll_target_checks(bool wait_all) {
  std::unique_lock<std::mutex> lock(g_checks_mutex);
  while (!g_checks.empty() && (wait_all || g_checks.front().info.ready())) {
    const at::Tensor info = g_checks.front().info.wait();
    const int64_t vocab = g_checks.front().vocab_size, ii = g_checks.front().ignore_index;
    g_checks.pop_front();
    const int64_t* h = info.data_ptr<int64_t>();
    if (h[0] == 0) continue;
    lock.unlock();
    TORCH_CHECK_INDEX(false, "flce: target[", h[1], "] = ", h[2],
                      " is out of range for a vocabulary of ", vocab,
                      " (and is not ignore_index = ", ii, ")",
                      check_mode() == CheckMode::kSync
                          ? ""
                          : " (found by the device; flce reports it at the first call after the "
                            "GPU has run the step that had it: FLCE_CHECK_TARGETS=sync reports it "
                            "at once)");
  }
}

void check_targets(const at::Tensor& flag, const at::Tensor& target, int64_t vocab_size,
                   int64_t ignore_index) {
  if (check_mode() == CheckMode::kOff || dev::capturing() || target.numel() == 0) return;
  // The first offending row and its target, found on the device (argmax: the first maximum).
  const at::Tensor bad = ((target != ignore_index) & ((target < 0) | (target >= vocab_size)));
  const at::Tensor row = bad.to(at::kInt).argmax().reshape({1});
  // (no kernel's flag: the targets' own, any offending row)
  const at::Tensor raised = flag.defined() ? flag.to(at::kLong) : bad.any().to(at::kLong);
  const at::Tensor info = at::cat({raised.reshape({1}), row, target.index_select(0, row)});
  {
    std::lock_guard<std::mutex> lock(g_checks_mutex);
    g_checks.push_back(PendingCheck{dev::PendingCopy(info), vocab_size, ignore_index});
  }
  // A host far ahead of its GPU waits here rather than queueing pinned copies without bound.
  poll_target_checks(check_mode() == CheckMode::kSync ||
                     g_checks.size() > heuristics::kMaxPendingChecks);
}

// flce::check_target: the same check of targets whose loss torch ops compute (the composite path).
void check_target_cuda(const at::Tensor& target, int64_t vocab_size, int64_t ignore_index) {
  check_device_tensor(target, target, "target");
  const dev::Guard guard(target);
  poll_target_checks();
  check_targets(at::Tensor(), target.reshape(-1), vocab_size, ignore_index);
}

// ---------------------------------------------------------------------------------------------
// Combine (finalize) of row partials.
// ---------------------------------------------------------------------------------------------

// combine (finalize) of [ranks, n, 5] partials into loss [n], lse [n], stats [n, 4] (written
// through their pointers), raising *flag for out-of-range targets.
void launch_finalize(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                     int64_t ignore_index, double label_smoothing, double z_loss, float* loss,
                     float* lse, float* entropy, float* stats, int* flag) {
  cuda::CombineParams cp{};
  cp.partials = partials.data_ptr<float>();
  cp.ranks = partials.size(0);
  cp.n = partials.size(1);
  cp.target = target.data_ptr<int64_t>();
  cp.target_stride = target.stride(0);
  cp.vocab_size = vocab_size;
  cp.ignore_index = ignore_index;
  cp.label_smoothing = static_cast<float>(label_smoothing);
  cp.z_loss = static_cast<float>(z_loss);
  cp.loss = loss;
  cp.lse = lse;
  cp.entropy = entropy;
  cp.stats = stats;
  cp.error_flag = flag;
  check_launch(cuda::launch_combine(cp, true, dev::stream()), "combine");
}

Tensor4 combine_impl(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                     int64_t ignore_index, double label_smoothing, double z_loss) {
  const at::Tensor p = aligned_contiguous(partials);
  const int64_t n = p.size(1);
  const auto f32 = p.options();
  at::Tensor loss = dev::empty({n}, f32), lse = dev::empty({n}, f32),
             entropy = dev::empty({n}, f32), stats = dev::empty({n, cuda::kStatsCols}, f32);
  at::Tensor flag = at::zeros({1}, p.options().dtype(at::kInt));
  launch_finalize(p, target, vocab_size, ignore_index, label_smoothing, z_loss,
                  loss.data_ptr<float>(), lse.data_ptr<float>(), entropy.data_ptr<float>(),
                  stats.data_ptr<float>(), flag.data_ptr<int>());
  check_targets(flag, target, vocab_size, ignore_index);
  return {loss, lse, stats, entropy};
}

// [parts, n, kPartialCols] partials (vocab splits of one rank) merged in order into [n, 5].
void merge_partials(const float* parts, int64_t count, int64_t n, float* merged) {
  cuda::CombineParams cp{};
  cp.partials = parts;
  cp.ranks = count;
  cp.n = n;
  cp.merged = merged;
  check_launch(cuda::launch_combine(cp, false, dev::stream()), "merge");
}

// Bytes of the workspace budget (FLCE_CUDA_WORKSPACE_MB, read at every call): the chunk driver's
// logits and gradient buffers.
int64_t workspace_bytes() {
  const char* s = std::getenv("FLCE_CUDA_WORKSPACE_MB");
  if (s == nullptr || *s == '\0') return static_cast<int64_t>(heuristics::kWorkspaceMb) << 20;
  char* end = nullptr;
  const double mb = std::strtod(s, &end);  // fractions too (tests of the chunking)
  TORCH_CHECK_VALUE(end != s && *end == '\0' && mb > 0 && std::isfinite(mb),
                    "flce: FLCE_CUDA_WORKSPACE_MB must be a positive number of MiB, got '", s,
                    "'");
  // (at most 2^50 bytes: a larger value, cast to int64, would wrap around to the smallest plan)
  return static_cast<int64_t>(std::min(mb, 1073741824.0) * (1 << 20));
}

// out [m, k] fp32 (or the compute dtype) = a [m, j] @ b [j, k] with fp32 accumulation.
void gemm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, float beta) {
  dev::gemm(out, a, b, 1.f, beta);
}

// The per-row gradient coefficients (math.h row_grad) from the row statistics.
void launch_coef(const at::Tensor& target, const at::Tensor& stats, const float* grad_loss,
                 int64_t grad_loss_stride, const float* grad_lse, int64_t grad_lse_stride,
                 const float* grad_entropy, int64_t grad_entropy_stride, int64_t ignore_index,
                 double label_smoothing, double z_loss, double softcap, double temperature,
                 int64_t vocab_size, float* coef, float* bound) {
  cuda::RowCoefParams rp{};
  rp.n = target.size(0);
  rp.target = target.data_ptr<int64_t>();
  rp.target_stride = target.stride(0);
  rp.stats = stats.data_ptr<float>();
  rp.stats_row_stride = stats.stride(0);
  rp.stats_col_stride = stats.stride(1);
  rp.grad_loss = grad_loss;
  rp.grad_loss_stride = grad_loss_stride;
  rp.grad_lse = grad_lse;
  rp.grad_lse_stride = grad_lse_stride;
  rp.grad_entropy = grad_entropy;
  rp.grad_entropy_stride = grad_entropy_stride;
  rp.ignore_index = ignore_index;
  rp.label_smoothing = static_cast<float>(label_smoothing);
  rp.z_loss = static_cast<float>(z_loss);
  rp.softcap = static_cast<float>(softcap);
  rp.temperature = static_cast<float>(temperature);
  rp.vocab_size = vocab_size;
  rp.coef = coef;
  rp.bound = bound;
  check_launch(cuda::launch_row_coef(rp, dev::stream()), "row_coef");
}

// ---------------------------------------------------------------------------------------------
// The recompute backward's gradients from given statistics (backward.cpp, soft.cpp).
// ---------------------------------------------------------------------------------------------
// The gradients where there is nothing to compute (none asked, N = 0 or V = 0: zeros), else none
// (fp32_e: dE in fp32).
std::optional<Tensor3> nothing_to_compute(const at::Tensor& input, const at::Tensor& weight,
                                          const std::optional<at::Tensor>& bias,
                                          std::array<bool, 3> need, bool fp32_e) {
  const int64_t n = input.size(0), v = weight.size(0), d = input.size(1);
  if ((need[0] || need[1] || need[2]) && n > 0 && v > 0) return std::nullopt;
  const auto e_opts = fp32_e ? f32_of(input) : input.options();
  return Tensor3{need[0] ? at::zeros({n, d}, e_opts) : input.new_empty({0}),
                 need[1] ? at::zeros({v, d}, weight.options()) : weight.new_empty({0}),
                 need[2] ? at::zeros({v}, bias->options()) : weight.new_empty({0})};
}

// grad_chunks over the whole job with the given statistics (grads.stats), the gradients in the
// ops' dtypes (grads.mask: the ones asked, bias included only where there is one); fp32_e: dE
// in fp32 (grad_input_fp32).
Tensor3 recompute_grads(const LinearJob& job, const GradJob& grads, bool fp32_e) {
  const at::Tensor& input = job.input;
  const ChunkPlan plan = plan_chunks(input.size(0), job.weight.size(0), input.scalar_type(),
                                     split_grad(job, grads.mask[1]), /*must=*/true);
  const GradOut g = grad_chunks(job, grads, plan);
  return {grads.mask[0] ? g.ge.to(fp32_e ? at::kFloat : input.scalar_type()) : input.new_empty({0}),
          grads.mask[1] ? g.gw : job.weight.new_empty({0}),
          grads.mask[2] ? g.gb.to(job.bias->scalar_type()) : job.weight.new_empty({0})};
}

}  // namespace binding

FLCE_CUDA_IMPL(m) { m.impl("check_target", &binding::check_target_cuda); }

}  // namespace flce
