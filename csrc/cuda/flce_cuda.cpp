// The CUDA backend of the flce ops: validation, operand preparation, workspace and the launch
// sequence. The kernels themselves live in the torch-free *.cu files of this directory (params.h
// is the whole interface), and every device facility goes through dev:: (device.h): the same
// source is built for a GPU and, with FLCE_CUDA_HOST, against the host emulation of the kernels
// (CPU tensors, test-only op namespace flce_cuda_host), so that CI runs this launch sequence.
//
//   forward        partial_stats kernel over (row blocks x vocab splits) -> [splits, N, 4]
//                  -> combine (finalize) -> loss, lse, stats        (no atomics: deterministic)
//   partial_stats  the same kernel, splits merged to [N, 4]
//   combine        merge of R ranks' partials, target validation
//   backward       row coefficients -> per vocab chunk: gradient tile kernel (dz into a bounded
//                  workspace) -> cuBLAS GEMMs with fp32 results -> Kahan accumulation of dE
//                  across chunks; dC chunks are disjoint rows; dbias from per-row-block partials.
//   sum_and_grad   the single pass (3 GEMMs, the training default): per group of rows, per
//                  sub-chunk: fp32 logits on cuBLAS -> row statistics -> combine -> row
//                  coefficients -> dz (compute dtype) into the group's gradient buffer; then
//                  dE = dz W and dW (+)= dz^T E on cuBLAS.
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

#include "cuda/device.h"
#include "cuda/params.h"
#include "flce_ops.h"

namespace flce {
namespace {

using cuda::DType;

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

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) : on_(nvtx_enabled()) {
    if (on_) nvtxRangePushA(name);
  }
  ~NvtxRange() {
    if (on_) nvtxRangePop();
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  bool on_;
};

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

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
}

at::TensorOptions f32_of(const at::Tensor& t) { return t.options().dtype(at::kFloat); }

// A float tensor that the kernels may read as float4/float2: contiguous and 16-byte aligned.
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
void poll_target_checks(bool wait_all = false) {
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
void gemm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               float beta = 0.f) {
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

// dE rows (sum, comp) += the target entries' rounding residuals times weight[target], for the
// rows whose target is in this weight block (comp nullptr: a plain fp32 add).
void launch_fix(const at::Tensor& w, int64_t n, int64_t vc, int64_t d, const at::Tensor& target,
                int64_t col_offset, int64_t ignore_index, const at::Tensor& resid,
                const float* inv_scale, float* sum, float* comp, DType dtype) {
  cuda::TargetFixParams fp{};
  fp.weight = w.data_ptr();
  fp.weight_row_stride = w.stride(0);
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
struct TargetOrder {
  at::Tensor sorted, order;
};

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
                     int64_t ignore_index, DType dtype, const at::Tensor& base = at::Tensor()) {
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

  // dE = sum over chunks of dz_chunk @ W_chunk, each chunk's fp32 GEMM result Neumaier-added.
  at::Tensor sum_e, comp_e, tmp_e;
  if (need_e) {
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

    if (need_e) {
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
    if (need_c) {
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
  if (need_e) grad_e.copy_(sum_e.add_(comp_e));
  if (need_b) grad_b.copy_(gb32);
  return {grad_e, grad_c, grad_b};
}

// ---------------------------------------------------------------------------------------------
// The single pass: loss and gradients with 3 GEMMs (no recompute).
//
// Rows are processed in groups of G rows, each in sub-chunks of S rows:
//   logits [S, V] fp32        = E_s W^T                      (cuBLAS, fp32 output)
//   partials [S, 5]           = row_stats(logits + bias, softcap, temperature)
//   loss, lse, stats          = combine(partials)            (math.h row_loss, target check)
//   coef [S, 8]               = row_coef(stats, g)           (g = 1, or 1 / count for the mean)
//   dz [S, V] compute dtype   = row_grad(logits, coef)       -> rows of the group buffer [G, V]
// then per group
//   dE [G, D] fp32            = dz W (+ the target entries' residual, 16-bit)
//   dW [V, D]                 = dz^T E (the first group), += for the next ones (fp32 accumulator)
// The logits never exist beyond one fp32 sub-chunk, and dz beyond one group, in the compute
// dtype. For 16-bit inputs the sub-chunk is a separate scratch; for fp32 the logits are computed
// into the group buffer and dz is written over them in place (same element size).
//
// Memory beyond inputs and outputs: the group buffer G * V * elt (twice for fp32 master weights:
// hi and lo) plus the sub-chunk S * V * 4, within the budget FLCE_CUDA_WORKSPACE_MB (default
// 1.5 GiB); dE in fp32 [N, D] until the backward; for a 16-bit weight an fp32 dW piece
// [2048, D], or with more than one group the fp32 dW accumulator [V, D] (rounded into the
// weight's dtype at the end of the forward). At N = 4096, V = 128256, D = 4096 bf16: one group
// (1.00 GiB) + a 256-row sub-chunk (0.12 GiB) + dE (64 MiB) + the dW piece (32 MiB) = 1.22 GiB;
// quack's chunked linear cross-entropy holds its 4096 x V bf16 logits, 0.98 GiB.
// ---------------------------------------------------------------------------------------------

// Vocab-parallel: every rank's [n, 5] partial statistics of the same rows, [ranks, n, 5] in rank
// order, by torch's functional all-gather over the named process group (on its stream; the
// wait makes the current stream wait for it, the host does not).
at::Tensor gather_partials(const at::Tensor& partials, const std::optional<std::string>& group,
                           int64_t group_size) {
  const int64_t n = partials.size(0);
  if (!group) return partials.view({1, n, cuda::kPartialCols});
  // (group_name is "Any" in the schema: a group's name or the group itself)
  static auto gather = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("_c10d_functional::all_gather_into_tensor", "")
                           .typed<at::Tensor(const at::Tensor&, int64_t, const c10::IValue&)>();
  static auto wait = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("_c10d_functional::wait_tensor", "")
                         .typed<at::Tensor(const at::Tensor&)>();
  at::Tensor all =
      wait.call(gather.call(partials.contiguous(), group_size, c10::IValue(*group)));
  return aligned_contiguous(all.view({group_size, n, cuda::kPartialCols}));
}

// Rows per single-pass group and per logits sub-chunk for this shape within the budget; 0 when
// not even kMinRows rows fit (then sum_and_grad falls back to forward + recompute backward).
struct SinglePassPlan {
  int64_t group_rows = 0, sub_rows = 0;
  bool in_place = false;  // fp32: logits computed into the group buffer, dz written over them
};

constexpr int64_t kMinRows = 64;

// Row stride of a chunk's fp32 logits, in floats: a multiple of 8 (32-byte rows).
int64_t logits_ld(int64_t v) { return ceil_div(std::max<int64_t>(v, 1), 8) * 8; }

// v: the vocabulary rows to plan for. Vocab-parallel ranks must walk the same sub-chunks (each
// one all-gathers), so they plan with the same v (the mean shard size) whatever their own.
SinglePassPlan plan_single_pass(int64_t n, int64_t v, at::ScalarType compute, bool split) {
  SinglePassPlan plan;
  const int64_t ld = logits_ld(v);
  const int64_t budget = workspace_bytes();
  auto round_rows = [](int64_t r) { return r / kMinRows * kMinRows; };
  if (compute == at::kFloat) {
    // fp32 dW sums a group's rows inside one cuBLAS GEMM (fp32 accumulation) and the groups with
    // Kahan compensation: groups of at most 1024 rows keep the first term small
    // (benchmarks/accumulation.py), and fp32 GEMMs are slow enough that the [V, D] compensated
    // add per group costs little beside them.
    plan.in_place = true;
    plan.group_rows = std::min<int64_t>(round_rows(budget / (4 * ld)),
                                        env_int("FLCE_CUDA_FP32_GROUP_ROWS", 1024));
    plan.sub_rows = plan.group_rows;
  } else {
    // The sub-chunk gets a twelfth of the budget (at most 128 MiB): 256 rows of a 128k
    // vocabulary, enough for the logits GEMM (M = S) to stay compute-bound while each sub-chunk
    // re-reads W.
    const int64_t scratch = std::min<int64_t>(budget / 12, int64_t{128} << 20);
    plan.sub_rows = round_rows(scratch / (4 * ld));
    const int64_t elt = 2 * (split ? 2 : 1);
    plan.group_rows = round_rows((budget - plan.sub_rows * ld * 4) / (elt * ld));
  }
  if (plan.sub_rows < kMinRows || plan.group_rows < kMinRows) return SinglePassPlan{};
  plan.group_rows = std::min(plan.group_rows, std::max<int64_t>(n, 1));
  plan.sub_rows = std::min(plan.sub_rows, plan.group_rows);
  return plan;
}

using Tensor5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The deferred gradients from forward + recompute backward, for the shapes and dtypes the single
// pass does not take (fp16, whose gradient tile needs a scale known only after every row's
// statistics; a vocabulary too large for the budget). Same outputs as the single pass.
struct Shard {
  int64_t vocab_start, vocab_size;
  std::optional<std::string> group;
  int64_t group_size;
};

Tensor5 sum_and_grad_recompute(const at::Tensor& input, const at::Tensor& weight,
                               const at::Tensor& target, const std::optional<at::Tensor>& bias,
                               int64_t ignore_index, double label_smoothing, double z_loss,
                               double softcap, double temperature, std::array<bool, 3> mask,
                               const at::Tensor& grad_scale, const at::Tensor& count, bool mean,
                               const Shard& shard) {
  const at::Tensor partials = partial_stats_cuda(input, weight, target, bias, shard.vocab_start,
                                                 ignore_index, softcap, temperature);
  auto [loss, lse, stats, entropy] =
      combine_impl(gather_partials(partials, shard.group, shard.group_size), target,
                   shard.vocab_size, ignore_index, label_smoothing, z_loss);
  const int64_t n = input.size(0);
  auto [ge, gc, gb] = backward_cuda(grad_scale.expand({n}), std::nullopt, input, weight, target,
                                    bias, stats, shard.vocab_start, shard.vocab_size,
                                    ignore_index, label_smoothing, z_loss, softcap, mask,
                                    std::nullopt, temperature);
  const at::Tensor total = loss.sum(at::kDouble);
  const at::Tensor reduced = (mean ? total / count.to(at::kDouble) : total).to(at::kFloat);
  const at::Tensor one = at::ones({}, input.options().dtype(at::kDouble));
  auto deferred = [](const at::Tensor& g, bool need, at::ScalarType dt) {
    return need ? g.to(dt).unsqueeze(0) : g.new_empty({0});
  };
  return {reduced, one, deferred(ge, mask[0], at::kFloat), deferred(gc, mask[1], weight.scalar_type()),
          deferred(gb, mask[2] && bias.has_value(), at::kFloat)};
}

Tensor5 sum_and_grad_cuda(const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& target, const std::optional<at::Tensor>& bias,
                          int64_t ignore_index, double label_smoothing, double z_loss,
                          double softcap, std::array<bool, 3> output_mask, bool mean,
                          int64_t vocab_start, int64_t vocab_size,
                          const std::optional<std::string>& group_name, int64_t group_size,
                          double temperature) {
  check_linear_args(input, weight, target, bias);
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
  const int64_t n = input.size(0), v = weight.size(0), d = input.size(1);
  const at::ScalarType compute = input.scalar_type();
  const DType dtype = to_dtype(compute);
  const auto f32 = f32_of(input);
  const cudaStream_t stream = dev::stream();

  // The upstream gradient of every row's loss: 1 (sum) or 1 / count (mean; 0 when every row is
  // ignored, whose gradients are then 0 rather than 0 * inf), on the device: no host sync.
  const at::Tensor count = (target != ignore_index).sum();
  const at::Tensor grad_scale =
      (mean ? at::where(count > 0, 1.0 / count.to(at::kDouble), at::zeros_like(count, at::kDouble))
            : at::ones({}, f32.dtype(at::kDouble)))
          .to(at::kFloat)
          .reshape({1})
          .contiguous();

  const bool split = need_c && compute != at::kFloat && weight.scalar_type() == at::kFloat &&
                     env_flag("FLCE_CUDA_SPLIT_GRAD", true);
  // Every rank of a vocab-parallel group takes the same branch and walks the same chunks.
  const SinglePassPlan plan = plan_single_pass(
      n, shard.group ? ceil_div(shard.vocab_size, shard.group_size) : v, compute, split);
  if (compute == at::kHalf || plan.group_rows == 0 || n == 0 || (v == 0 && !shard.group)) {
    return sum_and_grad_recompute(input, weight, target, bias, ignore_index, label_smoothing,
                                  z_loss, softcap, temperature, output_mask, grad_scale, count,
                                  mean, shard);
  }

  // GEMM operands in the compute dtype with a unit stride (cuBLAS takes any leading dimension).
  const at::Tensor x = input.stride(1) == 1 || input.stride(0) == 1 ? input : input.contiguous();
  const at::Tensor w = weight.scalar_type() == compute ? weight : weight.to(compute);
  const at::Tensor bias32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();

  at::Tensor loss_rows = dev::empty({n}, f32);
  at::Tensor ge = need_e ? dev::empty({1, n, d}, f32) : input.new_empty({0});
  at::Tensor gw = need_c ? dev::empty({1, v, d}, weight.options()) : weight.new_empty({0});
  at::Tensor gb = need_b ? dev::empty({1, v}, f32) : weight.new_empty({0});

  const int64_t G = plan.group_rows, S = plan.sub_rows, ld = logits_ld(v);
  const int64_t elt = input.element_size();
  // The group's gradient buffer: dz rows of G x V in the compute dtype (row stride gld
  // elements), and for master weights its residual; fp32: the logits themselves.
  const int64_t gld = plan.in_place ? ld : v;
  at::Tensor group = dev::empty({G * gld}, input.options());
  at::Tensor group_lo = split ? dev::empty({G * v}, input.options()) : at::Tensor();
  at::Tensor scratch = plan.in_place ? at::Tensor() : dev::empty({S * ld}, f32);
  // Column splits of the row kernels: about 8 CTAs per SM in flight (a sub-chunk's rows alone
  // are a few hundred CTAs), at most one per tile of the row.
  const int64_t row_tiles = std::max<int64_t>(ceil_div(v, cuda::kRowTileCols), 1);
  auto col_splits = [&](int64_t ctas) {
    return static_cast<int>(std::clamp<int64_t>(
        ceil_div(dev::sm_count() * 8, std::max<int64_t>(ctas, 1)), 1, row_tiles));
  };
  at::Tensor split_partials = dev::empty({col_splits(1) * S * cuda::kPartialCols}, f32);
  at::Tensor partials = dev::empty({S, cuda::kPartialCols}, f32), lse = dev::empty({S}, f32),
             stats = dev::empty({S, cuda::kStatsCols}, f32), coef = dev::empty({S, 8}, f32),
             bound = dev::empty({S}, f32);
  at::Tensor flag = at::zeros({1}, input.options().dtype(at::kInt));
  // dW: an fp32 weight (master weights, or fp32 training) is its own fp32 accumulator; a 16-bit
  // one goes through fp32 (the multi-group accumulator, or vocab pieces of one group) that gets
  // the target rows' residuals (target_rows) before the one rounding.
  const bool fp32_dw = weight.scalar_type() == at::kFloat;
  const bool fix_c = need_c && compute != at::kFloat && !fp32_dw;
  const bool fix_target = (need_e || fix_c) && compute != at::kFloat;
  at::Tensor resid = fix_target ? dev::empty({G}, f32) : at::Tensor();
  // Bias gradient: per 8-row CTA column sums of a sub-chunk, reduced in order, compensated
  // across sub-chunks.
  constexpr int kBiasRows = 8;
  at::Tensor col_partials = need_b ? dev::empty({ceil_div(S, kBiasRows) * v}, f32) : at::Tensor();
  at::Tensor gb_tmp, gb_comp;
  if (need_b) {
    gb_tmp = dev::empty({v}, f32);
    gb[0].zero_();
    gb_comp = at::zeros({v}, f32);
  }
  // fp32 inputs: dE sums over V in pieces of kPieceCols columns, Neumaier-added (one fp32 GEMM
  // over a whole 128k vocabulary would carry its k-loop's rounding; 16-bit inputs round dE to
  // 16 bits anyway).
  const int64_t kPieceCols = env_int("FLCE_CUDA_FP32_PIECE_COLS", 8192);
  const int64_t pieces = compute == at::kFloat ? ceil_div(v, kPieceCols) : 1;
  at::Tensor tmp_e = need_e && pieces > 1 ? dev::empty({G, d}, f32) : at::Tensor();
  at::Tensor comp_e = need_e && pieces > 1 ? dev::empty({G, d}, f32) : at::Tensor();
  const bool separate_acc = fix_c && G < n;
  // Vocabulary rows of one group's fp32 dW piece (fp32 training across groups): 32 MiB at
  // D = 4096, while the piece's GEMM (2048 x D x G) is still large enough for cuBLAS.
  constexpr int64_t kDwPiece = 2048;
  // dW's fp32 buffer: the weight itself (fp32), the accumulator of every group's dW (16-bit,
  // several groups) or the target rows' full fp32 dW rows (16-bit, one group: [G, D]).
  at::Tensor acc_w;
  if (need_c) {
    acc_w = fp32_dw ? gw[0] : dev::empty({separate_acc ? v : G, d}, f32);
  }
  // fp32 training, several groups: dW Kahan-compensated across them (pieces of kDwPiece rows).
  const bool kahan_dw = need_c && compute == at::kFloat && G < n;
  at::Tensor comp_w = kahan_dw ? at::zeros({v, d}, f32) : at::Tensor();
  at::Tensor tmp_w = kahan_dw ? dev::empty({std::min(v, kDwPiece), d}, f32) : at::Tensor();
  // x as target_rows reads it: row-major
  const at::Tensor x_rows = fix_c && x.stride(1) != 1 ? x.contiguous() : x;

  for (int64_t g0 = 0; g0 < n; g0 += G) {
    const int64_t gn = std::min(G, n - g0);
    const at::Tensor xg = x.narrow(0, g0, gn);
    for (int64_t s0 = g0; s0 < g0 + gn; s0 += S) {
      const int64_t sn = std::min(S, g0 + gn - s0);
      const at::Tensor ts = target.narrow(0, s0, sn);
      float* lp = plan.in_place ? group.data_ptr<float>() + (s0 - g0) * ld
                                : scratch.data_ptr<float>();
      const at::Tensor logits = at::from_blob(lp, {sn, v}, {ld, 1}, f32);
      gemm_into(logits, x.narrow(0, s0, sn), w.t());

      cuda::RowStatsParams rs{};
      rs.logits = lp;
      rs.n = sn;
      rs.v = v;
      rs.ld = ld;
      rs.bias = bias ? bias32.data_ptr<float>() : nullptr;
      rs.softcap = static_cast<float>(softcap);
      rs.temperature = static_cast<float>(temperature);
      rs.target = ts.data_ptr<int64_t>();
      rs.target_stride = ts.stride(0);
      rs.col_offset = shard.vocab_start;
      rs.ignore_index = ignore_index;
      rs.need_sum = label_smoothing != 0.0;
      rs.need_u = false;  // the single pass returns no entropy
      rs.splits = col_splits(sn);
      rs.partials = rs.splits > 1 ? split_partials.data_ptr<float>() : partials.data_ptr<float>();
      check_launch(cuda::launch_row_stats(rs, stream), "row_stats");
      if (rs.splits > 1) {
        merge_partials(split_partials.data_ptr<float>(), rs.splits, sn, partials.data_ptr<float>());
      }
      const at::Tensor part =
          gather_partials(partials.narrow(0, 0, sn), shard.group, shard.group_size);
      const at::Tensor st = stats.narrow(0, 0, sn);
      launch_finalize(part, ts, shard.vocab_size, ignore_index, label_smoothing, z_loss,
                      loss_rows.data_ptr<float>() + s0, lse.data_ptr<float>(), nullptr,
                      st.data_ptr<float>(), flag.data_ptr<int>());
      launch_coef(ts, st, grad_scale.data_ptr<float>(), 0, nullptr, 0, nullptr, 0, ignore_index,
                  label_smoothing, z_loss, softcap, temperature, shard.vocab_size,
                  coef.data_ptr<float>(),
                  bound.data_ptr<float>());

      cuda::RowGradParams rg{};
      rg.logits = lp;
      rg.n = sn;
      rg.v = v;
      rg.ld = ld;
      rg.bias = rs.bias;
      rg.softcap = rs.softcap;
      rg.temperature = rs.temperature;
      rg.target = rs.target;
      rg.target_stride = rs.target_stride;
      rg.col_offset = shard.vocab_start;
      rg.ignore_index = ignore_index;
      rg.coef = coef.data_ptr<float>();
      rg.grad = static_cast<char*>(group.data_ptr()) + (s0 - g0) * gld * elt;
      rg.grad_ld = gld;
      rg.grad_lo = split ? static_cast<char*>(group_lo.data_ptr()) + (s0 - g0) * v * elt : nullptr;
      rg.grad_lo_ld = v;
      rg.target_resid = fix_target ? resid.data_ptr<float>() + (s0 - g0) : nullptr;
      rg.col_partials = need_b && v > 0 ? col_partials.data_ptr<float>() : nullptr;
      rg.rows_per_cta = rg.col_partials != nullptr ? kBiasRows : 1;
      // (a 16-bit tile never aliases the logits here: in place is fp32 only)
      rg.col_splits = col_splits(ceil_div(sn, rg.rows_per_cta));
      check_launch(cuda::launch_row_grad(rg, dtype, stream), "row_grad");
      if (need_b) {
        check_launch(cuda::launch_column_sum(col_partials.data_ptr<float>(),
                                             ceil_div(sn, kBiasRows), v,
                                             gb_tmp.data_ptr<float>(), stream),
                     "column_sum");
        check_launch(cuda::launch_kahan_accumulate(gb.data_ptr<float>(), gb_comp.data_ptr<float>(),
                                                   gb_tmp.data_ptr<float>(), v, nullptr, stream),
                     "kahan_accumulate");
      }
    }
    const at::Tensor dz = at::from_blob(group.data_ptr(), {gn, v}, {gld, 1}, input.options());
    if (need_e) {
      const at::Tensor out = ge[0].narrow(0, g0, gn);
      if (v == 0) out.zero_();  // an empty vocab-parallel shard adds nothing
      for (int64_t p0 = 0; p0 < v; p0 += kPieceCols) {
        const int64_t pc = pieces > 1 ? std::min(kPieceCols, v - p0) : v;
        const at::Tensor a = dz.narrow(1, p0, pc), b = w.narrow(0, p0, pc);
        if (p0 == 0) {
          gemm_into(out, a, b);
          if (pieces > 1) comp_e.narrow(0, 0, gn).zero_();
        } else {
          at::Tensor t = tmp_e.narrow(0, 0, gn);
          gemm_into(t, a, b);
          check_launch(cuda::launch_kahan_accumulate(out.data_ptr<float>(),
                                                     comp_e.data_ptr<float>(), t.data_ptr<float>(),
                                                     gn * d, nullptr, stream),
                       "kahan_accumulate");
        }
        if (pieces == 1) break;
      }
      if (pieces > 1) out.add_(comp_e.narrow(0, 0, gn));
      if (fix_target) {
        launch_fix(w, gn, v, d, target.narrow(0, g0, gn), shard.vocab_start, ignore_index,
                   resid.narrow(0, 0, gn), nullptr, out.data_ptr<float>(), nullptr, dtype);
      }
    }
    if (need_c) {
      const float beta = g0 == 0 ? 0.f : 1.f;
      if (kahan_dw && g0 > 0) {
        for (int64_t p0 = 0; p0 < v; p0 += kDwPiece) {
          const int64_t pc = std::min(kDwPiece, v - p0);
          const at::Tensor t = tmp_w.narrow(0, 0, pc);
          gemm_into(t, dz.narrow(1, p0, pc).t(), xg);
          check_launch(cuda::launch_kahan_accumulate(acc_w.narrow(0, p0, pc).data_ptr<float>(),
                                                     comp_w.narrow(0, p0, pc).data_ptr<float>(),
                                                     t.data_ptr<float>(), pc * d, nullptr,
                                                     stream),
                       "kahan_accumulate");
        }
      } else if (!fix_c) {
        gemm_into(acc_w, dz.t(), xg, beta);
        if (split) {
          const at::Tensor lo =
              at::from_blob(group_lo.data_ptr(), {gn, v}, {v, 1}, input.options());
          gemm_into(acc_w, lo.t(), xg, 1.f);
        }
      } else {
        const TargetOrder order = sort_targets(target.narrow(0, g0, gn));
        const at::Tensor xr = x_rows.narrow(0, g0, gn);
        const at::Tensor rs = resid.narrow(0, 0, gn);
        if (separate_acc) {
          gemm_into(acc_w, dz.t(), xg, beta);
          add_target_rows(acc_w, shard.vocab_start, xr, order, rs, nullptr, ignore_index, dtype);
        } else {
          // One group: dW straight in the weight's dtype (cuBLAS rounds each fp32 sum once),
          // then the rows that are some row's target again in fp32, from the dz columns of the
          // sorted targets (every position, duplicates and ignored ones included: a fixed size,
          // no host sync), with their residuals added before the one rounding. In place of
          // fp32 pieces of dW, each stored and patched: 63 of them cost 2.8 ms per step at
          // N = 4096, V = 128256 on the H200 (docs/perf-notes.md).
          gemm_into(gw[0], dz.t(), xg);
          if (v > 0) {
            const at::Tensor cols = (order.sorted - shard.vocab_start).clamp(0, v - 1);
            const at::Tensor target_cols = dz.index_select(1, cols);  // [gn rows, gn positions]
            const at::Tensor base = acc_w.narrow(0, 0, gn);           // [gn positions, d] fp32
            gemm_into(base, target_cols.t(), xg);
            add_target_rows(gw[0], shard.vocab_start, xr, order, rs, nullptr, ignore_index, dtype,
                            base);
          }
        }
      }
    }
  }
  if (kahan_dw) acc_w.add_(comp_w);
  if (separate_acc) {
    check_launch(cuda::launch_scale_store(gw.data_ptr(), to_dtype(weight.scalar_type()),
                                          acc_w.data_ptr<float>(), v * d, nullptr, stream),
                 "scale_store");
  }
  if (need_b) gb[0].add_(gb_comp);
  check_targets(flag, target, shard.vocab_size, ignore_index);
  const at::Tensor total = loss_rows.sum(at::kDouble);
  const at::Tensor reduced = (mean ? total / count.to(at::kDouble) : total).to(at::kFloat);
  return {reduced, at::ones({}, input.options().dtype(at::kDouble)), ge, gw, gb};
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

}  // namespace

// The CUDA dispatch key of `flce`, or (host emulation) the CPU key of the test-only namespace
// that csrc/cuda/emulated/ defines with the same schemas.
#if defined(FLCE_CUDA_HOST)
#define FLCE_CUDA_IMPL(m) TORCH_LIBRARY_IMPL(flce_cuda_host, CPU, m)
#else
#define FLCE_CUDA_IMPL(m) TORCH_LIBRARY_IMPL(flce, CUDA, m)
#endif

FLCE_CUDA_IMPL(m) {
  m.impl("partial_stats", &partial_stats_cuda);
  m.impl("combine", &combine_cuda);
  m.impl("forward", &forward_cuda);
  m.impl("backward", &backward_cuda);
  m.impl("sum_and_grad", &sum_and_grad_cuda);
  m.impl("scale_grad", &scale_grad_cuda);
}

}  // namespace flce
