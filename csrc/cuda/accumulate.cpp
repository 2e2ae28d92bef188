// The gradient accumulator of the row-chunk driver (GradAccumulator, binding.h): dE, dW and db
// from each group's dz, every accumulation mode written once. grad_chunks (chunks.cpp) hands it
// one group of dz rows at a time; nothing here knows how dz was made.
//
// Modes, by compute dtype (the input's) and the weight's dtype:
//   dE  16-bit: one GEMM per group over the whole vocabulary (fp32 accumulation in cuBLAS), plus
//               the target entries' rounding residuals (target_fix: the dominant target column's
//               gradient is not limited by the 16-bit tile);
//       fp32:   pieces of kFp32PieceCols columns Neumaier-added (one fp32 GEMM over a 128k
//               vocabulary would carry its k-loop's rounding), or FLCE_CUDA_OPT_IN=fp64_grad.
//   dW  fp32 weight (master weights, fp32 training): its own fp32 accumulator, groups added by
//               the GEMM's beta (16-bit tile; master weights take the tile as hi + lo, two GEMMs)
//               or Neumaier-added in pieces (fp32 tile, several groups);
//       16-bit weight: one group straight in the weight's dtype, the target rows again in fp32
//               with their residuals (target_rows, `base`); several groups, or the fp16 scale,
//               through fp32 (a [V, D] accumulator, or pieces of kDwPiece rows) rounded once.
//   db  per 8-row CTA column sums of each sub-chunk (row_grad), reduced in order and
//       Neumaier-added across sub-chunks.
//   fp16: dz is stored times a power-of-two scale (grad_chunks folds it into the coefficients);
//         every result is multiplied by its inverse here (exact).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "cuda/heuristics.h"
#include "cuda/params.h"

namespace flce {
namespace binding {
namespace {

using heuristics::kBiasRows;
using heuristics::kDwPiece;

// FLCE_CUDA_OPT_IN=fp64_grad (read at every call): fp32 inputs' gradient GEMMs in float64, the
// products exact and the sums over rows and vocabulary in double, rounded once (opt-in: not yet
// run on a GPU). Default: cuBLAS SGEMMs, compensated across pieces and groups. The variable is a
// comma-separated list of the CUDA paths that have not run on a GPU; its other names,
// `distributions` and `distill`, are Python's (flce/_common.py cuda_opt_in, the list's one
// definition there).
bool fp32_grads_in_fp64() {
  const char* s = std::getenv("FLCE_CUDA_OPT_IN");
  bool fp64 = false;
  for (std::string_view rest = s ? s : ""; !rest.empty();) {
    const size_t comma = rest.find(',');
    std::string_view name = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
    while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
    TORCH_CHECK_VALUE(name.empty() || name == "fp64_grad" || name == "distributions" ||
                          name == "distill",
                      "flce: FLCE_CUDA_OPT_IN is a comma-separated list of fp64_grad, "
                      "distributions and distill, got '", s, "'");
    fp64 = fp64 || name == "fp64_grad";
  }
  return fp64;
}

// out64 [m, n] float64 = a [m, k] @ b [k, n] for fp32 a and b (any strides), in float64: pieces
// of kDwPiece along k widened to double, DGEMMs adding in double.
void gemm_f64(const at::Tensor& out64, const at::Tensor& a, const at::Tensor& b) {
  const int64_t k = a.size(1);
  if (k == 0) out64.zero_();
  for (int64_t k0 = 0; k0 < k; k0 += kDwPiece) {
    const int64_t kc = std::min(kDwPiece, k - k0);
    dev::gemm(out64, a.narrow(1, k0, kc).to(at::kDouble), b.narrow(0, k0, kc).to(at::kDouble),
              1.f, k0 > 0 ? 1.f : 0.f);
  }
}

// (sum, comp) += x * inv_scale, count elements, Neumaier-compensated.
void kahan_add(const at::Tensor& sum, const at::Tensor& comp, const at::Tensor& x,
               const float* inv_scale = nullptr) {
  check_launch(cuda::launch_kahan_accumulate(sum.data_ptr<float>(), comp.data_ptr<float>(),
                                             x.data_ptr<float>(), x.numel(), inv_scale,
                                             dev::stream()),
               "kahan_accumulate");
}

// out (the weight's dtype) = x * inv_scale, rounded once.
void scale_store(const at::Tensor& out, const at::Tensor& x, const float* inv_scale) {
  check_launch(cuda::launch_scale_store(out.data_ptr(), to_dtype(out.scalar_type()),
                                        x.data_ptr<float>(), x.numel(), inv_scale, dev::stream()),
               "scale_store");
}

// The rows of a group sorted by target (stable), for add_target_rows.
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
                     const TargetOrder& ord, const at::Tensor& resid, int64_t ignore_index,
                     DType dtype, const at::Tensor& base = at::Tensor()) {
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
  check_launch(cuda::launch_target_rows(tp, dtype, dev::stream()), "target_rows");
}

}  // namespace

GradAccumulator::GradAccumulator(const LinearJob& job, std::array<bool, 3> mask,
                                 int64_t group_rows, int64_t sub_rows, const at::Tensor& x,
                                 const at::Tensor& w, const at::Tensor& inv_scale)
    : job_(job), x_(x), w_(w), inv_scale_(inv_scale) {
  const at::Tensor& input = job.input;
  const at::Tensor& weight = job.weight;
  const int64_t n = input.size(0), v = weight.size(0), d = input.size(1), G = group_rows;
  const at::ScalarType compute = input.scalar_type();
  const auto f32 = f32_of(input);
  const bool fp32 = compute == at::kFloat, fp64 = fp32 && fp32_grads_in_fp64();
  if (mask[0]) de_mode_ = !fp32 ? DeMode::kTile : fp64 ? DeMode::kFloat64 : DeMode::kPieces;
  // dW: an fp32 weight (master weights, or fp32 training) is its own fp32 accumulator; a 16-bit
  // one goes through fp32 (the multi-group accumulator, or vocab pieces of one group) that gets
  // the target rows' residuals (target_rows) before the one rounding.
  if (mask[1]) {
    dw_mode_ = fp64                                  ? DwMode::kFloat64
               : weight.scalar_type() == at::kFloat ? DwMode::kInWeight
               : G < n                              ? DwMode::kAccumulator
               : inv_scale.defined()                ? DwMode::kScaledPieces
                                                    : DwMode::kOneGroup;
  }
  const bool need_e = de_mode_ != DeMode::kNone, need_c = dw_mode_ != DwMode::kNone;
  const bool fix_c = dw_mode_ == DwMode::kOneGroup || dw_mode_ == DwMode::kScaledPieces ||
                     dw_mode_ == DwMode::kAccumulator;
  need_b_ = mask[2] && job.bias.has_value();
  fix_target_ = (need_e || fix_c) && !fp32;
  kahan_dw_ = need_c && fp32 && G < n;
  dtype_ = to_dtype(compute);
  inv_ptr_ = inv_scale.defined() ? inv_scale.data_ptr<float>() : nullptr;
  if (need_e) ge_ = dev::empty({n, d}, f32);
  if (need_c) gw_ = dev::empty({v, d}, weight.options());
  if (need_b_) {
    gb_ = at::zeros({v}, f32);
    gb_comp_ = at::zeros({v}, f32);
    gb_tmp_ = dev::empty({v}, f32);
    col_partials_ = dev::empty({ceil_div(sub_rows, kBiasRows) * v}, f32);
  }
  if (fix_target_) resid_ = dev::empty({G}, f32);
  if (de_mode_ == DeMode::kPieces) pieces_ = ceil_div(v, heuristics::kFp32PieceCols);
  if (pieces_ > 1) {
    tmp_e_ = dev::empty({G, d}, f32);
    comp_e_ = dev::empty({G, d}, f32);
  }
  const auto f64_opts = input.options().dtype(at::kDouble);
  if (de_mode_ == DeMode::kFloat64) e64_ = dev::empty({G, d}, f64_opts);
  if (dw_mode_ == DwMode::kFloat64) w64_ = dev::empty({std::min(v, kDwPiece), d}, f64_opts);
  // dW's fp32 buffer: the weight's own (fp32), the accumulator of every group's dW (16-bit,
  // several groups) or the target rows' full fp32 dW rows (16-bit, one group: [G, D]).
  if (dw_mode_ == DwMode::kInWeight || dw_mode_ == DwMode::kFloat64) acc_w_ = gw_;
  if (dw_mode_ == DwMode::kAccumulator) acc_w_ = dev::empty({v, d}, f32);
  if (dw_mode_ == DwMode::kOneGroup) acc_w_ = dev::empty({G, d}, f32);
  // fp32 training, several groups: dW Kahan-compensated across them (pieces of kDwPiece rows).
  if (kahan_dw_) comp_w_ = at::zeros({v, d}, f32);
  if (kahan_dw_ || dw_mode_ == DwMode::kScaledPieces) {
    tmp_w_ = dev::empty({std::min(v, kDwPiece), d}, f32);
  }
  // x as target_rows reads it: row-major
  x_rows_ = fix_c && x.stride(1) != 1 ? x.contiguous() : x;
}

float* GradAccumulator::target_resid(int64_t row_in_group) const {
  return fix_target_ ? resid_.data_ptr<float>() + row_in_group : nullptr;
}

float* GradAccumulator::bias_partials() const {
  return need_b_ && job_.weight.size(0) > 0 ? col_partials_.data_ptr<float>() : nullptr;
}

void GradAccumulator::add_bias(int64_t rows) {
  if (!need_b_) return;
  check_launch(cuda::launch_column_sum(col_partials_.data_ptr<float>(), ceil_div(rows, kBiasRows),
                                       gb_.size(0), gb_tmp_.data_ptr<float>(), dev::stream()),
               "column_sum");
  kahan_add(gb_, gb_comp_, gb_tmp_);
}

void GradAccumulator::add_group(const at::Tensor& dz, const at::Tensor& dz_lo, int64_t g0) {
  const int64_t gn = dz.size(0);
  const at::Tensor tg = job_.target.narrow(0, g0, gn);
  if (de_mode_ != DeMode::kNone) add_de(dz, tg, g0);
  if (dw_mode_ != DwMode::kNone) add_dw(dz, dz_lo, tg, g0);
  groups_ += 1;
}

// dE rows [g0, g0 + gn) = dz W (fp32 pieces Neumaier-added, or float64), then the target fix.
void GradAccumulator::add_de(const at::Tensor& dz, const at::Tensor& tg, int64_t g0) {
  const int64_t gn = dz.size(0), v = dz.size(1);
  const at::Tensor ge = ge_.narrow(0, g0, gn);
  if (de_mode_ == DeMode::kFloat64) {
    const at::Tensor t = e64_.narrow(0, 0, gn);
    gemm_f64(t, dz, w_);
    ge.copy_(t);
    return;
  }
  if (v == 0) ge.zero_();  // an empty vocab-parallel shard adds nothing
  const int64_t piece = heuristics::kFp32PieceCols;
  for (int64_t p0 = 0; p0 < v; p0 += piece) {
    const int64_t pc = pieces_ > 1 ? std::min(piece, v - p0) : v;
    const at::Tensor a = dz.narrow(1, p0, pc), b = w_.narrow(0, p0, pc);
    if (p0 == 0) {
      gemm_into(ge, a, b);
      if (pieces_ > 1) comp_e_.narrow(0, 0, gn).zero_();
    } else {
      const at::Tensor t = tmp_e_.narrow(0, 0, gn);
      gemm_into(t, a, b);
      kahan_add(ge, comp_e_.narrow(0, 0, gn), t);
    }
    if (pieces_ == 1) break;
  }
  if (pieces_ > 1) ge.add_(comp_e_.narrow(0, 0, gn));
  if (inv_scale_.defined()) ge.mul_(inv_scale_);
  if (!fix_target_) return;
  cuda::TargetFixParams fp{};
  fp.weight = w_.data_ptr();
  fp.weight_row_stride = w_.stride(0);
  fp.weight_col_stride = w_.stride(1);
  fp.n = gn;
  fp.v = v;
  fp.d = ge.size(1);
  fp.target = tg.data_ptr<int64_t>();
  fp.target_stride = tg.stride(0);
  fp.col_offset = job_.shard.vocab_start;
  fp.ignore_index = job_.ignore_index;
  fp.target_resid = resid_.data_ptr<float>();
  fp.inv_scale = inv_ptr_;
  fp.sum = ge.data_ptr<float>();
  check_launch(cuda::launch_target_fix(fp, dtype_, dev::stream()), "target_fix");
}

// dW (+)= dz^T X_g in the mode of the weight's dtype (see the top of this file).
void GradAccumulator::add_dw(const at::Tensor& dz, const at::Tensor& dz_lo, const at::Tensor& tg,
                             int64_t g0) {
  const int64_t gn = dz.size(0), v = dz.size(1);
  const at::Tensor xg = x_.narrow(0, g0, gn);
  const bool f64 = dw_mode_ == DwMode::kFloat64;
  if (f64 || (kahan_dw_ && g0 > 0)) {
    // Each vocabulary piece of this group's dW (in double, rounded once, or fp32); the first
    // group is dW so far, the next ones Kahan-added to it.
    for (int64_t p0 = 0; p0 < v; p0 += kDwPiece) {
      const int64_t pc = std::min(kDwPiece, v - p0);
      const at::Tensor t = (f64 ? w64_ : tmp_w_).narrow(0, 0, pc);
      if (f64) {
        gemm_f64(t, dz.narrow(1, p0, pc).t(), xg);
      } else {
        gemm_into(t, dz.narrow(1, p0, pc).t(), xg);
      }
      if (g0 == 0) {
        acc_w_.narrow(0, p0, pc).copy_(t);
        continue;
      }
      const at::Tensor t32 = tmp_w_.narrow(0, 0, pc);
      if (f64) t32.copy_(t);
      kahan_add(acc_w_.narrow(0, p0, pc), comp_w_.narrow(0, p0, pc), t32);
    }
    return;
  }
  const float beta = g0 == 0 ? 0.f : 1.f;
  if (dw_mode_ == DwMode::kInWeight) {
    gemm_into(acc_w_, dz.t(), xg, beta);
    if (dz_lo.defined()) gemm_into(acc_w_, dz_lo.t(), xg, 1.f);
    return;
  }
  const TargetOrder order = sort_targets(tg);
  const at::Tensor xr = x_rows_.narrow(0, g0, gn);
  const at::Tensor rs = resid_.narrow(0, 0, gn);
  const int64_t v0 = job_.shard.vocab_start;
  if (dw_mode_ == DwMode::kAccumulator) {
    gemm_into(acc_w_, dz.t(), xg, beta);
    add_target_rows(acc_w_, v0, xr, order, rs, job_.ignore_index, dtype_);
  } else if (dw_mode_ == DwMode::kScaledPieces) {
    // fp16: each piece's fp32 dW gets its target rows' residuals, then loses the scale in its
    // one rounding (scaled, a 16-bit dW could overflow).
    for (int64_t p0 = 0; p0 < v; p0 += kDwPiece) {
      const int64_t pc = std::min(kDwPiece, v - p0);
      const at::Tensor t = tmp_w_.narrow(0, 0, pc);
      gemm_into(t, dz.narrow(1, p0, pc).t(), xg);
      add_target_rows(t, v0 + p0, xr, order, rs, job_.ignore_index, dtype_);
      scale_store(gw_.narrow(0, p0, pc), t, inv_ptr_);
    }
  } else {
    // One group: dW straight in the weight's dtype (cuBLAS rounds each fp32 sum once), then the
    // rows that are some row's target again in fp32, from the dz columns of the sorted targets
    // (every position, duplicates and ignored ones included: a fixed size, no host sync), with
    // their residuals added before the one rounding. Fp32 pieces of dW, each stored, patched and
    // then rounded, would write and read all of dW in fp32 once more per step.
    gemm_into(gw_, dz.t(), xg);
    if (v == 0) return;
    const at::Tensor cols = (order.sorted - v0).clamp(0, v - 1);
    const at::Tensor target_cols = dz.index_select(1, cols);  // [gn rows, gn positions]
    const at::Tensor base = acc_w_.narrow(0, 0, gn);           // [gn positions, d] fp32
    gemm_into(base, target_cols.t(), xg);
    add_target_rows(gw_, v0, xr, order, rs, job_.ignore_index, dtype_, base);
  }
}

void GradAccumulator::finish(GradOut& out) {
  if (dw_mode_ != DwMode::kNone && groups_ == 0) gw_.zero_();  // no rows: nothing was added
  if (kahan_dw_) acc_w_.add_(comp_w_);
  if (dw_mode_ == DwMode::kAccumulator) scale_store(gw_, acc_w_, inv_ptr_);
  if (dw_mode_ == DwMode::kInWeight && inv_scale_.defined()) gw_.mul_(inv_scale_);
  if (need_b_) {
    gb_.add_(gb_comp_);
    if (inv_scale_.defined()) gb_.mul_(inv_scale_);
  }
  out.ge = ge_;
  out.gw = gw_;
  out.gb = gb_;
}

}  // namespace binding
}  // namespace flce
