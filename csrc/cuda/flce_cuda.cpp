// The CUDA backend of the flce ops: validation, operand preparation, workspace and the launch
// sequences. The kernels themselves live in the torch-free *.cu files of this directory (params.h
// is the whole interface), and every device facility goes through dev:: (device.h): the same
// source is built for a GPU and, with FLCE_CUDA_HOST, against the host emulation of the kernels
// (CPU tensors, test-only op namespace flce_cuda_host), so that CI runs these launch sequences.
// This file holds the helpers they share (binding.h) and the fused forward / recompute backward;
// single_pass.cpp the single pass, logits.cpp cross-entropy on given logits.
//
//   forward        partial_stats kernel over (row blocks x vocab splits) -> [splits, N, 4]
//                  -> combine (finalize) -> loss, lse, stats        (no atomics: deterministic)
//   partial_stats  the same kernel, splits merged to [N, 4]
//   combine        merge of R ranks' partials, target validation
//   backward       row coefficients -> per vocab chunk: gradient tile kernel (dz into a bounded
//                  workspace) -> cuBLAS GEMMs with fp32 results -> Kahan accumulation of dE
//                  across chunks; dC chunks are disjoint rows; dbias from per-row-block partials.
//   sum_and_grad   (single_pass.cpp) the single pass, 3 GEMMs, the training default.
//   logits_stats,  (logits.cpp) the row kernels of the single pass on a caller's logits.
//   logits_backward
//   scale_grad     the single pass' deferred gradients times the upstream gradient.
// Targets are checked without a host sync (see check_targets below). See docs/cuda.md.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <string>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "cuda/params.h"
#include "flce_ops.h"

namespace flce {
namespace binding {

bool env_flag(const char* name, bool fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  return std::strcmp(s, "0") != 0;
}

// A positive integer from the environment (read at every call), else the fallback.
int64_t env_int(const char* name, int64_t fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  const long long v = std::atoll(s);
  TORCH_CHECK_VALUE(v > 0, "flce: ", name, " must be a positive integer, got '", s, "'");
  return v;
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

// The operand as a logit-tile kernel reads it, in the compute dtype. The exact fp32 SIMT tile
// takes any strides (chunk == 0). The tensor-core tiles stream 16-byte chunks (`chunk` elements)
// with cp.async: unit column stride, 16-byte aligned base and rows, and d_pad (d rounded up to a
// chunk) columns; otherwise (or for an fp32 master weight) this makes one copy, zero-padded
// (zeros add nothing to the dot products).
at::Tensor tile_operand(const at::Tensor& t, at::ScalarType compute, int64_t d_pad,
                        int64_t chunk) {
  at::Tensor x = t.scalar_type() == compute ? t : t.to(compute);
  if (chunk == 0) return x;
  const bool ok = x.size(1) == d_pad && (x.stride(1) == 1 || d_pad == 0) &&
                  x.stride(0) % chunk == 0 && aligned16(x);
  if (ok) return x;
  at::Tensor p = at::zeros({x.size(0), d_pad}, x.options());
  p.narrow(1, 0, x.size(1)).copy_(x);
  return p;
}

// fp32 runs on TF32 tensor cores when torch allows TF32 for fp32 matmuls
// (torch.set_float32_matmul_precision("high" | "medium")), else on the exact SIMT tile.
bool fp32_uses_tf32() {
  return at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST;
}

struct Prepared {
  at::ScalarType compute;
  DType dtype;        // tile kind
  int64_t chunk;      // elements per 16-byte cp.async chunk; 0 for the SIMT tile
  at::Tensor x;       // [n, d_pad] tile operand
  at::Tensor bias32;  // [v] fp32 contiguous, or undefined
  int64_t n, v, d, d_pad;

  at::Tensor operand(const at::Tensor& t) const { return tile_operand(t, compute, d_pad, chunk); }
};

Prepared prepare(const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  Prepared p;
  p.compute = input.scalar_type();
  p.dtype = to_dtype(p.compute);
  if (p.dtype == DType::kFloat32 && fp32_uses_tf32()) p.dtype = DType::kFloat32Tf32;
  p.chunk = p.dtype == DType::kFloat32 ? 0 : 16 / input.element_size();
  p.n = input.size(0);
  p.v = weight.size(0);
  p.d = input.size(1);
  p.d_pad = p.chunk == 0 ? p.d : ceil_div(p.d, p.chunk) * p.chunk;
  p.x = p.operand(input);
  if (bias) p.bias32 = bias->to(at::kFloat).contiguous();
  return p;
}

cuda::LinearArgs linear_args(const Prepared& p, const at::Tensor& w, int64_t bias_offset,
                             const at::Tensor& target, int64_t col_offset, int64_t ignore_index,
                             double softcap, double temperature) {
  cuda::LinearArgs a{};
  a.input = p.x.data_ptr();
  a.weight = w.data_ptr();
  a.bias = p.bias32.defined() ? p.bias32.data_ptr<float>() + bias_offset : nullptr;
  a.n = p.n;
  a.v = w.size(0);
  a.d = p.d_pad;
  a.input_row_stride = p.x.stride(0);
  a.input_col_stride = p.x.stride(1);
  a.weight_row_stride = w.stride(0);
  a.weight_col_stride = w.stride(1);
  a.target = target.data_ptr<int64_t>();
  a.target_stride = target.stride(0);
  a.col_offset = col_offset;
  a.ignore_index = ignore_index;
  a.softcap = static_cast<float>(softcap);
  a.temperature = static_cast<float>(temperature);
  return a;
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
  const at::Tensor info = at::cat({flag.to(at::kLong).reshape({1}), row, target.index_select(0, row)});
  {
    std::lock_guard<std::mutex> lock(g_checks_mutex);
    g_checks.push_back(PendingCheck{dev::PendingCopy(info), vocab_size, ignore_index});
  }
  // A host far ahead of its GPU waits here rather than queueing pinned copies without bound.
  constexpr size_t kMaxPending = 64;
  poll_target_checks(check_mode() == CheckMode::kSync || g_checks.size() > kMaxPending);
}

// ---------------------------------------------------------------------------------------------
// Forward (logit tiles folded into row statistics) and combine.
// ---------------------------------------------------------------------------------------------

// [splits, n, 4] partial statistics of the whole weight (vocabulary ids from vocab_start).
at::Tensor run_partials(const at::Tensor& input, const at::Tensor& weight,
                        const at::Tensor& target, const std::optional<at::Tensor>& bias,
                        int64_t vocab_start, int64_t ignore_index, double softcap,
                        double temperature) {
  const auto f32 = f32_of(input);
  const int64_t n = input.size(0), v = weight.size(0);
  if (n == 0) return dev::empty({1, 0, cuda::kPartialCols}, f32);
  if (v == 0) {
    // An empty shard: the empty state (m, s, z_t, sum_z, u) for every row.
    const float inf = std::numeric_limits<float>::infinity();
    return at::tensor({-inf, 0.f, -inf, 0.f, 0.f}, f32)
        .expand({1, n, cuda::kPartialCols})
        .contiguous();
  }
  const Prepared p = prepare(input, weight, bias);
  const at::Tensor w = p.operand(weight);
  const cuda::TileShape ts = cuda::tile_shape(p.dtype);
  const int64_t row_blocks = ceil_div(n, ts.block_n);
  const int64_t vtiles = ceil_div(v, ts.block_v);
  // Enough CTAs for ~16 waves at 2 CTAs per SM, so that the last (partial) wave costs little;
  // each split adds only one [n, 4] partial.
  int64_t splits = std::clamp<int64_t>(ceil_div(dev::sm_count() * 32, row_blocks), 1,
                                       std::min<int64_t>(vtiles, 65535));
  const int64_t tiles_per_split = ceil_div(vtiles, splits);
  splits = ceil_div(vtiles, tiles_per_split);  // no empty split

  at::Tensor partials = dev::empty({splits, n, cuda::kPartialCols}, f32);
  cuda::StatsParams sp{};
  sp.lin = linear_args(p, w, 0, target, vocab_start, ignore_index, softcap, temperature);
  sp.partials = partials.data_ptr<float>();
  sp.splits = static_cast<int>(splits);
  sp.tiles_per_split = tiles_per_split;
  check_launch(cuda::launch_partial_stats(sp, p.dtype, dev::stream()), "partial_stats");
  return partials;
}

// combine (finalize) of [ranks, n, 4] partials into loss [n], lse [n], stats [n, 3] (written
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
  at::Tensor partials = run_partials(input, weight, target, bias, vocab_start, ignore_index,
                                     softcap, temperature);
  if (partials.size(0) == 1) return partials.select(0, 0);
  at::Tensor merged = dev::empty({input.size(0), cuda::kPartialCols}, partials.options());
  merge_partials(partials.data_ptr<float>(), partials.size(0), input.size(0),
                 merged.data_ptr<float>());
  return merged;
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
                     double label_smoothing, double z_loss, double softcap, double temperature) {
  check_linear_args(input, weight, target, bias);
  check_device_tensor(input, input, "input");
  const dev::Guard guard(input);
  const NvtxRange range("flce::forward");
  poll_target_checks();
  const at::Tensor partials =
      run_partials(input, weight, target, bias, 0, ignore_index, softcap, temperature);
  return combine_impl(partials, target, weight.size(0), ignore_index, label_smoothing, z_loss);
}

// Bytes of the workspace budget (FLCE_CUDA_WORKSPACE_MB, default 1536 MiB, read at every call):
// the recompute backward's gradient tile and the single pass' group buffer plus its logits
// sub-chunk.
int64_t workspace_bytes() {
  const char* s = std::getenv("FLCE_CUDA_WORKSPACE_MB");
  const double mb = s != nullptr ? std::atof(s) : 0.0;  // fractions too (tests of the chunking)
  return static_cast<int64_t>((mb > 0 ? mb : 1536.0) * (1 << 20));
}

// out [m, k] fp32 (or the compute dtype) = a [m, j] @ b [j, k] with fp32 accumulation.
void gemm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, float beta) {
  dev::gemm(out, a, b, 1.f, beta);
}

bool fp32_grads_in_fp64() {
  const char* s = std::getenv("FLCE_CUDA_FP32_GRAD");
  if (s == nullptr || *s == '\0' || std::strcmp(s, "fp32") == 0) return false;
  TORCH_CHECK_VALUE(std::strcmp(s, "fp64") == 0,
                    "flce: FLCE_CUDA_FP32_GRAD must be fp32 or fp64, got '", s, "'");
  return true;
}

void gemm_f64(const at::Tensor& out64, const at::Tensor& a, const at::Tensor& b, bool accumulate,
              int64_t piece) {
  const int64_t k = a.size(1);
  if (k == 0 && !accumulate) out64.zero_();
  for (int64_t k0 = 0; k0 < k; k0 += piece) {
    const int64_t kc = std::min(piece, k - k0);
    const at::Tensor a64 = a.narrow(1, k0, kc).to(at::kDouble);
    const at::Tensor b64 = b.narrow(0, k0, kc).to(at::kDouble);
    dev::gemm(out64, a64, b64, 1.f, accumulate || k0 > 0 ? 1.f : 0.f);
  }
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

// dE rows (sum, comp) += the target entries' rounding residuals times weight[target], for the
// rows whose target is in this weight block (comp nullptr: a plain fp32 add).
void launch_fix(const at::Tensor& w, int64_t n, int64_t vc, int64_t d, const at::Tensor& target,
                int64_t col_offset, int64_t ignore_index, const at::Tensor& resid,
                const float* inv_scale, float* sum, float* comp, DType dtype) {
  cuda::TargetFixParams fp{};
  fp.weight = w.data_ptr();
  fp.weight_row_stride = w.stride(0);
  fp.weight_col_stride = w.stride(1);
  fp.n = n;
  fp.v = vc;
  fp.d = d;
  fp.target = target.data_ptr<int64_t>();
  fp.target_stride = target.stride(0);
  fp.col_offset = col_offset;
  fp.ignore_index = ignore_index;
  fp.target_resid = resid.data_ptr<float>();
  fp.inv_scale = inv_scale;
  fp.sum = sum;
  fp.comp = comp;
  check_launch(cuda::launch_target_fix(fp, dtype, dev::stream()), "target_fix");
}

// The rows of a block of rows sorted by target (stable), for launch_target_rows.
TargetOrder sort_targets(const at::Tensor& target) {
  auto [sorted, order] = at::sort(target, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  return {sorted.contiguous(), order.contiguous()};
}

// dW rows of the targets in [col_offset, col_offset + out.size(0)): out (fp32) += the 16-bit
// tile's residuals of the rows' target entries times the rows of x (compute dtype, row-major).
// With `base` ([n, d] fp32, the full dW row of each sorted position's target), out is the
// 16-bit dW itself and those rows are stored as dtype(base + residuals) instead.
void add_target_rows(const at::Tensor& out, int64_t col_offset, const at::Tensor& x,
                     const TargetOrder& ord, const at::Tensor& resid, const float* inv_scale,
                     int64_t ignore_index, DType dtype, const at::Tensor& base) {
  cuda::TargetRowsParams tp{};
  if (base.defined()) {
    tp.base = base.data_ptr<float>();
    tp.store = out.data_ptr();
  } else {
    tp.out = out.data_ptr<float>();
  }
  tp.x = x.data_ptr();
  tp.x_stride = x.stride(0);
  tp.n = x.size(0);
  tp.d = x.size(1);
  tp.sorted_target = ord.sorted.data_ptr<int64_t>();
  tp.order = ord.order.data_ptr<int64_t>();
  tp.col_offset = col_offset;
  tp.rows = out.size(0);
  tp.ignore_index = ignore_index;
  tp.resid = resid.data_ptr<float>();
  tp.inv_scale = inv_scale;
  check_launch(cuda::launch_target_rows(tp, dtype, dev::stream()), "target_rows");
}

// ---------------------------------------------------------------------------------------------
// Backward with recomputed logit tiles.
// ---------------------------------------------------------------------------------------------
Tensor3 backward_cuda(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                      const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                      const std::optional<at::Tensor>& bias, const at::Tensor& stats,
                      int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                      double label_smoothing, double z_loss, double softcap,
                      std::array<bool, 3> output_mask,
                      const std::optional<at::Tensor>& grad_entropy, double temperature) {
  check_backward_args(grad_loss, grad_lse, input, weight, target, bias, stats, grad_entropy);
  check_device_tensor(input, input, "input");
  check_device_tensor(grad_loss, input, "grad_loss");
  check_device_tensor(stats, input, "stats");
  if (grad_lse) check_device_tensor(*grad_lse, input, "grad_lse");
  if (grad_entropy) check_device_tensor(*grad_entropy, input, "grad_entropy");
  const dev::Guard guard(input);
  const NvtxRange range("flce::backward");
  poll_target_checks();
  const bool need_e = output_mask[0], need_c = output_mask[1], need_b = output_mask[2] && bias;
  const int64_t n = input.size(0), v = weight.size(0), d = input.size(1);
  at::Tensor grad_e = need_e ? dev::empty({n, d}, input.options()) : input.new_empty({0});
  at::Tensor grad_c = need_c ? dev::empty({v, d}, weight.options()) : weight.new_empty({0});
  at::Tensor grad_b = need_b ? dev::empty({v}, bias->options()) : weight.new_empty({0});
  if ((!need_e && !need_c && !need_b) || n == 0 || v == 0) {
    if (need_e) grad_e.zero_();
    if (need_c) grad_c.zero_();
    if (need_b) grad_b.zero_();
    return {grad_e, grad_c, grad_b};
  }
  const cudaStream_t stream = dev::stream();
  const Prepared p = prepare(input, weight, bias);
  const auto f32 = f32_of(input);

  // Per-row coefficients, and for fp16 the power-of-two scale that keeps the stored gradient
  // tile (values down to p_j * g, g ~ 1/N) out of fp16's subnormal range: max |scale * dz| lies
  // in (2^13, 2^14]. bf16 has fp32's exponent range and needs none; fp32 neither.
  at::Tensor coef = dev::empty({n, 8}, f32), bound = dev::empty({n}, f32);
  launch_coef(target, stats, grad_loss.data_ptr<float>(), grad_loss.stride(0),
              grad_lse ? grad_lse->data_ptr<float>() : nullptr,
              grad_lse ? grad_lse->stride(0) : 0,
              grad_entropy ? grad_entropy->data_ptr<float>() : nullptr,
              grad_entropy ? grad_entropy->stride(0) : 0, ignore_index, label_smoothing, z_loss,
              softcap, temperature, vocab_size, coef.data_ptr<float>(), bound.data_ptr<float>());
  at::Tensor scale, inv_scale;
  if (p.compute == at::kHalf) {
    const at::Tensor mx = bound.amax();
    const at::Tensor e = at::clamp(14.0 - at::ceil(at::log2(mx)), -126.0, 126.0);
    scale = at::where(at::isfinite(mx) & (mx > 0), at::exp2(e), at::ones_like(mx)).contiguous();
    inv_scale = at::reciprocal(scale).contiguous();  // exact: a power of two
  }
  const float* inv_ptr = inv_scale.defined() ? inv_scale.data_ptr<float>() : nullptr;

  // fp32 grad_weight from 16-bit operands (master weights): the gradient tile goes to the dC
  // GEMM as hi + lo (two GEMMs), so that dC is not limited by the tile's 16-bit rounding, as the
  // CPU backend does. grad_input has the input's 16-bit dtype and uses hi alone.
  // FLCE_CUDA_SPLIT_GRAD=0 turns this off (one GEMM less).
  static const bool split_enabled = env_flag("FLCE_CUDA_SPLIT_GRAD", true);
  const bool split_c = split_enabled && need_c && p.compute != at::kFloat &&
                       grad_c.scalar_type() == at::kFloat;

  // Vocabulary chunk: the [n, chunk] gradient tile(s) fit the workspace budget.
  const cuda::TileShape ts = cuda::tile_shape(p.dtype);
  const int64_t elt = p.x.element_size() * (split_c ? 2 : 1);
  int64_t chunk = workspace_bytes() / std::max<int64_t>(1, n * elt);
  chunk = std::max<int64_t>(ts.block_v, chunk / ts.block_v * ts.block_v);
  chunk = std::min<int64_t>({chunk, ceil_div(v, ts.block_v) * ts.block_v,
                             int64_t{65535} * ts.block_v});
  const int64_t row_blocks = ceil_div(n, ts.block_n);
  at::Tensor dz = dev::empty({n * std::min(chunk, v)}, input.options().dtype(p.compute));
  at::Tensor dz_lo = split_c ? dev::empty({dz.numel()}, dz.options()) : at::Tensor();
  at::Tensor col_partials = need_b ? dev::empty({row_blocks * chunk}, f32) : at::Tensor();
  // 16-bit tiles: the rounding residual of each row's target entry, added back in fp32 to dE
  // (target_fix) and to a 16-bit dC's target rows before they are rounded (target_rows; with
  // the hi + lo split the tile is exact enough).
  const bool fix_c = need_c && p.compute != at::kFloat && !split_c;
  const bool fix_target = (need_e || fix_c) && p.compute != at::kFloat;
  at::Tensor target_resid = fix_target ? dev::empty({n}, f32) : at::Tensor();
  const TargetOrder order = fix_c ? sort_targets(target) : TargetOrder{};
  at::Tensor gb32 = need_b ? dev::empty({v}, f32) : at::Tensor();

  // fp32 with FLCE_CUDA_FP32_GRAD=fp64: dE summed over the chunks in double, each dC row in
  // double (in pieces of kF64Rows rows), rounded once.
  const bool f64 = p.compute == at::kFloat && fp32_grads_in_fp64();
  constexpr int64_t kF64Rows = 4096;
  at::Tensor sum_e64 = f64 && need_e ? dev::empty({n, d}, input.options().dtype(at::kDouble))
                                     : at::Tensor();
  at::Tensor tmp_c64 = f64 && need_c
                           ? dev::empty({std::min(chunk, kF64Rows), d},
                                        input.options().dtype(at::kDouble))
                           : at::Tensor();
  // dE = sum over chunks of dz_chunk @ W_chunk, each chunk's fp32 GEMM result Neumaier-added.
  at::Tensor sum_e, comp_e, tmp_e;
  if (need_e && !f64) {
    sum_e = dev::empty({n, d}, f32);
    comp_e = at::zeros({n, d}, f32);
  }
  const at::Tensor x_gemm = p.x.narrow(1, 0, d);  // the input in the compute dtype
  // dC rows of a chunk are complete after one GEMM (it sums over all n inside cuBLAS in fp32).
  // An fp32 dC from an fp32 tile goes straight into grad_c; a 16-bit tile's through an fp32
  // temporary that gets its target rows' residuals and loses the fp16 scale before the one
  // rounding to grad_c's dtype.
  at::Tensor tmp_c;

  for (int64_t v0 = 0; v0 < v; v0 += chunk) {
    const int64_t vc = std::min(chunk, v - v0);
    const at::Tensor w = p.operand(weight.narrow(0, v0, vc));
    at::Tensor g = dz.narrow(0, 0, n * vc).view({n, vc});
    at::Tensor g_lo = split_c ? dz_lo.narrow(0, 0, n * vc).view({n, vc}) : at::Tensor();
    cuda::GradParams gp{};
    gp.lin = linear_args(p, w, v0, target, vocab_start + v0, ignore_index, softcap, temperature);
    gp.coef = coef.data_ptr<float>();
    gp.scale = scale.defined() ? scale.data_ptr<float>() : nullptr;
    gp.grad_logits = g.data_ptr();
    gp.grad_logits_lo = split_c ? g_lo.data_ptr() : nullptr;
    gp.col_partials = need_b ? col_partials.data_ptr<float>() : nullptr;
    gp.target_resid = fix_target ? target_resid.data_ptr<float>() : nullptr;
    check_launch(cuda::launch_grad_logits(gp, p.dtype, stream), "grad_logits");

    if (need_e && f64) {
      gemm_f64(sum_e64, g, w.narrow(1, 0, d), v0 > 0);
    } else if (need_e) {
      const at::Tensor w_gemm = w.narrow(1, 0, d);
      if (v0 == 0) {
        // The first chunk is the sum so far (comp_e is zero: exact). With the fp16 scale it is
        // undone by a power of two (exact too); Kahan-adding it into sum_e instead would read
        // sum_e before anything wrote it.
        gemm_into(sum_e, g, w_gemm);
        if (inv_scale.defined()) sum_e.mul_(inv_scale);
      } else {
        if (!tmp_e.defined()) tmp_e = dev::empty({n, d}, f32);
        gemm_into(tmp_e, g, w_gemm);
        check_launch(cuda::launch_kahan_accumulate(sum_e.data_ptr<float>(),
                                                   comp_e.data_ptr<float>(),
                                                   tmp_e.data_ptr<float>(), n * d, inv_ptr,
                                                   stream),
                     "kahan_accumulate");
      }
      if (fix_target) {
        launch_fix(w, n, vc, d, target, vocab_start + v0, ignore_index, target_resid, inv_ptr,
                   sum_e.data_ptr<float>(), comp_e.data_ptr<float>(), p.dtype);
      }
    }
    if (need_c && f64) {
      for (int64_t r0 = 0; r0 < vc; r0 += kF64Rows) {
        const int64_t rc = std::min(kF64Rows, vc - r0);
        const at::Tensor t = tmp_c64.narrow(0, 0, rc);
        gemm_f64(t, g.narrow(1, r0, rc).t(), x_gemm, false);
        grad_c.narrow(0, v0 + r0, rc).copy_(t);
      }
    } else if (need_c) {
      at::Tensor out = grad_c.narrow(0, v0, vc);
      if (split_c) {
        // out (fp32) = (hi^T X + lo^T X) / scale
        gemm_into(out, g.t(), x_gemm);
        gemm_into(out, g_lo.t(), x_gemm, 1.f);
        if (inv_scale.defined()) out.mul_(inv_scale);
      } else if (!fix_c) {
        gemm_into(out, g.t(), x_gemm);
      } else {
        if (!tmp_c.defined()) tmp_c = dev::empty({chunk, d}, f32);
        at::Tensor t = tmp_c.narrow(0, 0, vc);
        gemm_into(t, g.t(), x_gemm);
        add_target_rows(t, vocab_start + v0, x_gemm, order, target_resid, nullptr, ignore_index,
                        p.dtype);
        check_launch(cuda::launch_scale_store(out.data_ptr(), to_dtype(grad_c.scalar_type()),
                                              t.data_ptr<float>(), vc * d, inv_ptr, stream),
                     "scale_store");
      }
    }
    if (need_b) {
      // col_partials holds [row_blocks, vc] for this chunk.
      check_launch(cuda::launch_column_sum(col_partials.data_ptr<float>(), row_blocks, vc,
                                           gb32.data_ptr<float>() + v0, stream),
                   "column_sum");
    }
  }
  if (need_e) grad_e.copy_(f64 ? sum_e64 : sum_e.add_(comp_e));
  if (need_b) grad_b.copy_(gb32);
  return {grad_e, grad_c, grad_b};
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
  m.impl("partial_stats", &binding::partial_stats_cuda);
  m.impl("combine", &binding::combine_cuda);
  m.impl("forward", &binding::forward_cuda);
  m.impl("backward", &binding::backward_cuda);
  m.impl("scale_grad", &binding::scale_grad_cuda);
  m.impl("scale_grad_", &binding::scale_grad_inplace_cuda);
}

}  // namespace flce
