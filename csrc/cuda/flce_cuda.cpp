// The CUDA backend of the flce ops: validation, operand preparation, workspace and the launch
// sequence. The kernels themselves live in the torch-free *.cu files of this directory (params.h
// is the whole interface), which keeps their compile time low.
//
//   forward        partial_stats kernel over (row blocks x vocab splits) -> [splits, N, 4]
//                  -> combine (finalize) -> loss, lse, stats        (no atomics: deterministic)
//   partial_stats  the same kernel, splits merged to [N, 4]
//   combine        merge of R ranks' partials, target validation
//   backward       row coefficients -> per vocab chunk: gradient tile kernel (dz into a bounded
//                  workspace) -> cuBLAS GEMMs with fp32 results -> Kahan accumulation of dE
//                  across chunks; dC chunks are disjoint rows; dbias from per-row-block partials.
// See docs/cuda.md.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

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

void check_cuda_tensor(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == ref.device(), "flce: ", name, " must be on ",
                    ref.device(), ", got ", t.device());
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
}

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

struct Prepared {
  at::ScalarType compute;
  DType dtype;        // tile kind
  int64_t chunk;      // elements per 16-byte cp.async chunk; 0 for the SIMT tile
  at::Tensor x;       // [n, d_pad] tile operand
  at::Tensor bias32;  // [v] fp32 contiguous, or undefined
  int64_t n, v, d, d_pad;

  at::Tensor operand(const at::Tensor& t) const { return tile_operand(t, compute, d_pad, chunk); }
};

// fp32 runs on TF32 tensor cores when torch allows TF32 for fp32 matmuls
// (torch.set_float32_matmul_precision("high" | "medium")), else on the exact SIMT tile.
bool fp32_uses_tf32() {
  return at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST;
}

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
                             double softcap) {
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
  return a;
}

// [splits, n, 4] partial statistics of the whole weight (vocabulary ids from vocab_start).
at::Tensor run_partials(const at::Tensor& input, const at::Tensor& weight,
                        const at::Tensor& target, const std::optional<at::Tensor>& bias,
                        int64_t vocab_start, int64_t ignore_index, double softcap) {
  const auto f32 = input.options().dtype(at::kFloat);
  const int64_t n = input.size(0), v = weight.size(0);
  if (n == 0) return at::empty({1, 0, 4}, f32);
  if (v == 0) {
    // An empty shard: the empty state for every row.
    const float inf = std::numeric_limits<float>::infinity();
    return at::tensor({-inf, 0.f, -inf, 0.f}, f32).expand({1, n, 4}).contiguous();
  }
  const Prepared p = prepare(input, weight, bias);
  const at::Tensor w = p.operand(weight);
  const cuda::TileShape ts = cuda::tile_shape(p.dtype);
  const int64_t row_blocks = ceil_div(n, ts.block_n);
  const int64_t vtiles = ceil_div(v, ts.block_v);
  // Enough CTAs for ~16 waves at 2 CTAs per SM, so that the last (partial) wave costs little;
  // each split adds only one [n, 4] partial.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t splits = std::clamp<int64_t>(ceil_div(sms * 32, row_blocks), 1,
                                       std::min<int64_t>(vtiles, 65535));
  const int64_t tiles_per_split = ceil_div(vtiles, splits);
  splits = ceil_div(vtiles, tiles_per_split);  // no empty split

  at::Tensor partials = at::empty({splits, n, 4}, f32);
  cuda::StatsParams sp{};
  sp.lin = linear_args(p, w, 0, target, vocab_start, ignore_index, softcap);
  sp.partials = partials.data_ptr<float>();
  sp.splits = static_cast<int>(splits);
  sp.tiles_per_split = tiles_per_split;
  check_launch(cuda::launch_partial_stats(sp, p.dtype, at::cuda::getCurrentCUDAStream()),
               "partial_stats");
  return partials;
}

// FLCE_CHECK_TARGETS=0 skips the host read of the out-of-range flag (one device sync per
// forward). It is skipped anyway while a CUDA graph is being captured.
void check_targets(const at::Tensor& flag, const at::Tensor& target, int64_t vocab_size,
                   int64_t ignore_index) {
  static const bool enabled = env_flag("FLCE_CHECK_TARGETS", true);
  if (!enabled) return;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return;
  if (flag.item<int>() == 0) return;
  // Error path only: find the first offending target for the message.
  const at::Tensor bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size));
  const int64_t i = bad.nonzero().select(1, 0)[0].item<int64_t>();
  const int64_t t = target[i].item<int64_t>();
  TORCH_CHECK_INDEX(false, "flce: target[", i, "] = ", t, " is out of range for a vocabulary of ",
                    vocab_size, " (and is not ignore_index = ", ignore_index, ")");
}

Tensor3 combine_impl(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                     int64_t ignore_index, double label_smoothing, double z_loss) {
  const at::Tensor p = aligned_contiguous(partials);
  const int64_t n = p.size(1);
  const auto f32 = p.options();
  at::Tensor loss = at::empty({n}, f32), lse = at::empty({n}, f32), stats = at::empty({n, 2}, f32);
  at::Tensor flag = at::zeros({1}, p.options().dtype(at::kInt));
  cuda::CombineParams cp{};
  cp.partials = p.data_ptr<float>();
  cp.ranks = p.size(0);
  cp.n = n;
  cp.target = target.data_ptr<int64_t>();
  cp.target_stride = target.stride(0);
  cp.vocab_size = vocab_size;
  cp.ignore_index = ignore_index;
  cp.label_smoothing = static_cast<float>(label_smoothing);
  cp.z_loss = static_cast<float>(z_loss);
  cp.loss = loss.data_ptr<float>();
  cp.lse = lse.data_ptr<float>();
  cp.stats = stats.data_ptr<float>();
  cp.error_flag = flag.data_ptr<int>();
  check_launch(cuda::launch_combine(cp, true, at::cuda::getCurrentCUDAStream()), "combine");
  check_targets(flag, target, vocab_size, ignore_index);
  return {loss, lse, stats};
}

at::Tensor partial_stats_cuda(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& target, const std::optional<at::Tensor>& bias,
                              int64_t vocab_start, int64_t ignore_index, double softcap) {
  check_linear_args(input, weight, target, bias);
  const c10::cuda::CUDAGuard guard(input.device());
  const NvtxRange range("flce::partial_stats");
  at::Tensor partials =
      run_partials(input, weight, target, bias, vocab_start, ignore_index, softcap);
  if (partials.size(0) == 1) return partials.select(0, 0);
  at::Tensor merged = at::empty({input.size(0), 4}, partials.options());
  cuda::CombineParams cp{};
  cp.partials = partials.data_ptr<float>();
  cp.ranks = partials.size(0);
  cp.n = input.size(0);
  cp.merged = merged.data_ptr<float>();
  check_launch(cuda::launch_combine(cp, false, at::cuda::getCurrentCUDAStream()), "merge");
  return merged;
}

Tensor3 combine_cuda(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                     int64_t ignore_index, double label_smoothing, double z_loss) {
  check_combine_args(partials, target);
  TORCH_CHECK_VALUE(partials.is_cuda(), "flce: partials must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(partials.device());
  const NvtxRange range("flce::combine");
  return combine_impl(partials, target, vocab_size, ignore_index, label_smoothing, z_loss);
}

Tensor3 forward_cuda(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index,
                     double label_smoothing, double z_loss, double softcap) {
  check_linear_args(input, weight, target, bias);
  const c10::cuda::CUDAGuard guard(input.device());
  const NvtxRange range("flce::forward");
  const at::Tensor partials = run_partials(input, weight, target, bias, 0, ignore_index, softcap);
  return combine_impl(partials, target, weight.size(0), ignore_index, label_smoothing, z_loss);
}

// Bytes of the gradient-tile workspace [n, chunk] (FLCE_CUDA_WORKSPACE_MB, default 512 MiB).
int64_t workspace_bytes() {
  static const int64_t mb = [] {
    const char* s = std::getenv("FLCE_CUDA_WORKSPACE_MB");
    const long long v = s != nullptr ? std::atoll(s) : 0;
    return v > 0 ? static_cast<int64_t>(v) : int64_t{512};
  }();
  return mb << 20;
}

// out [m, k] fp32 = a [m, j] @ b [j, k] on cuBLAS (fp32 accumulation; an fp32 a follows torch's
// float32 matmul precision setting).
void gemm_f32(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kFloat) {
    at::mm_out(out, a, b);
  } else {
    at::mm_out(out, a, b, at::kFloat);
  }
}

Tensor3 backward_cuda(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                      const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                      const std::optional<at::Tensor>& bias, const at::Tensor& stats,
                      int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                      double label_smoothing, double z_loss, double softcap,
                      std::array<bool, 3> output_mask) {
  check_backward_args(grad_loss, grad_lse, input, weight, target, bias, stats);
  check_cuda_tensor(grad_loss, input, "grad_loss");
  check_cuda_tensor(stats, input, "stats");
  if (grad_lse) check_cuda_tensor(*grad_lse, input, "grad_lse");
  const c10::cuda::CUDAGuard guard(input.device());
  const NvtxRange range("flce::backward");
  const bool need_e = output_mask[0], need_c = output_mask[1], need_b = output_mask[2] && bias;
  const int64_t n = input.size(0), v = weight.size(0), d = input.size(1);
  at::Tensor grad_e = need_e ? at::empty({n, d}, input.options()) : input.new_empty({0});
  at::Tensor grad_c = need_c ? at::empty({v, d}, weight.options()) : weight.new_empty({0});
  at::Tensor grad_b = need_b ? at::empty({v}, bias->options()) : weight.new_empty({0});
  if ((!need_e && !need_c && !need_b) || n == 0 || v == 0) {
    if (need_e) grad_e.zero_();
    if (need_c) grad_c.zero_();
    if (need_b) grad_b.zero_();
    return {grad_e, grad_c, grad_b};
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const Prepared p = prepare(input, weight, bias);
  const auto f32 = input.options().dtype(at::kFloat);

  // Per-row coefficients, and for fp16 the power-of-two scale that keeps the stored gradient
  // tile (values down to p_j * g, g ~ 1/N) out of fp16's subnormal range: max |scale * dz| lies
  // in (2^13, 2^14]. bf16 has fp32's exponent range and needs none; fp32 neither.
  at::Tensor coef = at::empty({n, 4}, f32), bound = at::empty({n}, f32);
  {
    cuda::RowCoefParams rp{};
    rp.n = n;
    rp.target = target.data_ptr<int64_t>();
    rp.target_stride = target.stride(0);
    rp.stats = stats.data_ptr<float>();
    rp.stats_row_stride = stats.stride(0);
    rp.stats_col_stride = stats.stride(1);
    rp.grad_loss = grad_loss.data_ptr<float>();
    rp.grad_loss_stride = grad_loss.stride(0);
    rp.grad_lse = grad_lse ? grad_lse->data_ptr<float>() : nullptr;
    rp.grad_lse_stride = grad_lse ? grad_lse->stride(0) : 0;
    rp.ignore_index = ignore_index;
    rp.label_smoothing = static_cast<float>(label_smoothing);
    rp.z_loss = static_cast<float>(z_loss);
    rp.softcap = static_cast<float>(softcap);
    rp.vocab_size = vocab_size;
    rp.coef = coef.data_ptr<float>();
    rp.bound = bound.data_ptr<float>();
    check_launch(cuda::launch_row_coef(rp, stream), "row_coef");
  }
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
  at::Tensor dz = at::empty({n * std::min(chunk, v)}, input.options().dtype(p.compute));
  at::Tensor dz_lo = split_c ? at::empty_like(dz) : at::Tensor();
  at::Tensor col_partials = need_b ? at::empty({row_blocks * chunk}, f32) : at::Tensor();
  // 16-bit tiles: the rounding residual of each row's target entry, added back to dE in fp32.
  const bool fix_target = need_e && p.compute != at::kFloat;
  at::Tensor target_resid = fix_target ? at::empty({n}, f32) : at::Tensor();
  at::Tensor gb32 = need_b ? at::empty({v}, f32) : at::Tensor();

  // dE = sum over chunks of dz_chunk @ W_chunk, each chunk's fp32 GEMM result Neumaier-added.
  at::Tensor sum_e, comp_e, tmp_e;
  if (need_e) {
    sum_e = at::empty({n, d}, f32);
    comp_e = at::zeros({n, d}, f32);
  }
  const at::Tensor x_gemm = p.x.narrow(1, 0, d);  // the input in the compute dtype
  // dC rows of a chunk are complete after one GEMM (it sums over all n inside cuBLAS in fp32).
  // It goes straight into grad_c unless the fp16 scale has to be undone first.
  const bool direct_c = !inv_scale.defined() &&
                        (grad_c.scalar_type() == p.compute || grad_c.scalar_type() == at::kFloat);
  at::Tensor tmp_c;

  for (int64_t v0 = 0; v0 < v; v0 += chunk) {
    const int64_t vc = std::min(chunk, v - v0);
    const at::Tensor w = p.operand(weight.narrow(0, v0, vc));
    at::Tensor g = dz.narrow(0, 0, n * vc).view({n, vc});
    at::Tensor g_lo = split_c ? dz_lo.narrow(0, 0, n * vc).view({n, vc}) : at::Tensor();
    cuda::GradParams gp{};
    gp.lin = linear_args(p, w, v0, target, vocab_start + v0, ignore_index, softcap);
    gp.coef = coef.data_ptr<float>();
    gp.scale = scale.defined() ? scale.data_ptr<float>() : nullptr;
    gp.grad_logits = g.data_ptr();
    gp.grad_logits_lo = split_c ? g_lo.data_ptr() : nullptr;
    gp.col_partials = need_b ? col_partials.data_ptr<float>() : nullptr;
    gp.target_resid = fix_target ? target_resid.data_ptr<float>() : nullptr;
    check_launch(cuda::launch_grad_logits(gp, p.dtype, stream), "grad_logits");

    if (need_e) {
      const at::Tensor w_gemm = w.narrow(1, 0, d);
      if (v0 == 0 && inv_ptr == nullptr) {
        gemm_f32(sum_e, g, w_gemm);  // comp_e is zero: the first add is exact
      } else {
        if (!tmp_e.defined()) tmp_e = at::empty({n, d}, f32);
        gemm_f32(tmp_e, g, w_gemm);
        check_launch(cuda::launch_kahan_accumulate(sum_e.data_ptr<float>(),
                                                   comp_e.data_ptr<float>(),
                                                   tmp_e.data_ptr<float>(), n * d, inv_ptr,
                                                   stream),
                     "kahan_accumulate");
      }
      if (fix_target) {
        cuda::TargetFixParams fp{};
        fp.weight = w.data_ptr();
        fp.weight_row_stride = w.stride(0);
        fp.n = n;
        fp.v = vc;
        fp.d = d;
        fp.target = target.data_ptr<int64_t>();
        fp.target_stride = target.stride(0);
        fp.col_offset = vocab_start + v0;
        fp.ignore_index = ignore_index;
        fp.target_resid = target_resid.data_ptr<float>();
        fp.inv_scale = inv_ptr;
        fp.sum = sum_e.data_ptr<float>();
        fp.comp = comp_e.data_ptr<float>();
        check_launch(cuda::launch_target_fix(fp, p.dtype, stream), "target_fix");
      }
    }
    if (need_c) {
      at::Tensor out = grad_c.narrow(0, v0, vc);
      if (split_c) {
        // out (fp32) = (hi^T X + lo^T X) / scale
        if (!tmp_c.defined()) tmp_c = at::empty({chunk, d}, f32);
        at::Tensor t = tmp_c.narrow(0, 0, vc);
        gemm_f32(out, g.t(), x_gemm);
        gemm_f32(t, g_lo.t(), x_gemm);
        out.add_(t);
        if (inv_scale.defined()) out.mul_(inv_scale);
      } else if (direct_c) {
        if (grad_c.scalar_type() == p.compute) {
          at::mm_out(out, g.t(), x_gemm);
        } else {
          gemm_f32(out, g.t(), x_gemm);
        }
      } else {
        if (!tmp_c.defined()) tmp_c = at::empty({chunk, d}, f32);
        at::Tensor t = tmp_c.narrow(0, 0, vc);
        gemm_f32(t, g.t(), x_gemm);
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

}  // namespace

TORCH_LIBRARY_IMPL(flce, CUDA, m) {
  m.impl("partial_stats", &partial_stats_cuda);
  m.impl("combine", &combine_cuda);
  m.impl("forward", &forward_cuda);
  m.impl("backward", &backward_cuda);
}

}  // namespace flce
