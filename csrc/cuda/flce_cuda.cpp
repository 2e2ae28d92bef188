// The CUDA backend of the flce ops: the helpers the launch sequences share (binding.h), and the
// ops whose launch sequence is one call of the row-chunk driver (chunks.cpp). The kernels live in
// the torch-free *.cu files of this directory (params.h is the whole interface), and every device
// facility goes through dev:: (device.h): the same source is built for a GPU and, with
// FLCE_CUDA_HOST, against the host emulation of the kernels (CPU tensors, test-only op namespace
// flce_cuda_host), so that CI runs these launch sequences.
//
//   forward        stats_chunks (cuBLAS logits + row_stats) -> combine (finalize) -> loss, lse,
//                  stats, entropy                                  (no atomics: deterministic)
//   partial_stats  stats_chunks of a vocabulary shard: [N, 5]
//   combine        merge of R ranks' partials, target validation
//   backward       grad_chunks from the forward's statistics (recompute: the logits GEMM again,
//                  then dz and the two gradient GEMMs per group of rows)
//   sum_and_grad   (single_pass.cpp) grad_chunks computing the statistics: 3 GEMMs, the training
//                  default.
//   logits_stats,  (logits.cpp) the row kernels on a caller's logits.
//   logits_backward
//   scale_grad     the single pass' deferred gradients times the upstream gradient.
//   soft_*         target distributions (probability targets, class weights with label
//                  smoothing; math.h SoftRow): stats_chunks / grad_chunks in soft mode, the
//                  states merged by soft_combine. Opt-in (FLCE_CUDA_DISTRIBUTIONS=1, read by
//                  Python): never run on a GPU yet (docs/cuda.md "Target distributions").
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

bool env_flag(const char* name, bool fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  return std::strcmp(s, "0") != 0;
}

// FLCE_NVTX=0 disables the ranges (read once).
bool nvtx_enabled() {
  static const bool on = env_flag("FLCE_NVTX", true);
  return on;
}

NvtxRange::NvtxRange(const char* name) : on_(nvtx_enabled()) {
  if (on_) nvtxRangePushA(name);
}

NvtxRange::~NvtxRange() {
  if (on_) nvtxRangePop();
}

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
// step on a GPU; at once in the host emulation, whose kernels run synchronously).
// FLCE_CHECK_TARGETS=sync waits for it in the same call (one device sync per forward, as the
// earlier releases did); FLCE_CHECK_TARGETS=0 disables the check. Skipped while a CUDA graph is
// being captured.
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
// Forward (logit tiles folded into row statistics) and combine.
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

at::Tensor partial_stats_cuda(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& target, const std::optional<at::Tensor>& bias,
                              int64_t vocab_start, int64_t ignore_index, double softcap,
                              double temperature) {
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
  return stats_chunks(job, /*need_sum=*/true, /*need_u=*/true);
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
// Backward with recomputed logit tiles.
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

}  // namespace binding

FLCE_CUDA_IMPL(m) {
  m.impl("check_target", &binding::check_target_cuda);
  m.impl("partial_stats", &binding::partial_stats_cuda);
  m.impl("combine", &binding::combine_cuda);
  m.impl("forward", &binding::forward_cuda);
  m.impl("backward", &binding::backward_cuda);
  m.impl("scale_grad", &binding::scale_grad_cuda);
  m.impl("soft_partial_stats", &binding::soft_partial_stats_cuda);
  m.impl("soft_combine", &binding::soft_combine_cuda);
  m.impl("soft_forward", &binding::soft_forward_cuda);
  m.impl("soft_backward", &binding::soft_backward_cuda);
  m.impl("scale_grad_", &binding::scale_grad_inplace_cuda);
}

}  // namespace flce
