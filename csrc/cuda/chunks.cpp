// The row-chunk driver of the CUDA backend. Every launch sequence of the linear ops (forward,
// partial_stats, the recompute backward, the single pass, vocab-parallel) is one of two loops
// over chunks of rows, each chunk's logits from one library GEMM (cuBLAS with an fp32 output, or
// the CUTLASS fused epilogue where it is enabled) and the row kernels of flce_rows.cu:
//
//   stats_chunks  rows in sub-chunks of S, S x V fp32 logits filling the workspace:
//                   logits [S, V] = X_s W^T                       (cuBLAS)
//                   partials [S, 5] = row_stats(logits, bias, softcap, 1/T)  (column splits,
//                                                                  merged in order)
//   grad_chunks   rows in groups of G, each in sub-chunks of S:
//                   logits [S, V] = X_s W^T
//                   statistics: row_stats -> all-gather (ranks) -> finalize   (single pass), or
//                               the forward's, given                          (recompute)
//                   coef [S, 8] = row_coef(statistics, upstream gradients)
//                   dz rows of the group buffer [G, V] = row_grad(logits, coef)
//                 then per group: dE rows = dz W, dW (+)= dz^T X_g, db += column sums of dz,
//                 with every accumulation mode (below) written once, here.
// The logits never exist beyond one fp32 sub-chunk, dz beyond one group (in the compute dtype).
// There is no other logits GEMM: forward and backward run at the library GEMM's rate plus the
// row kernels' passes over the fp32 sub-chunk.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "cuda/heuristics.h"
#include "cuda/params.h"

namespace flce {
namespace binding {
namespace {

using heuristics::kBiasRows;
using heuristics::kDwPiece;
using heuristics::kMinRows;

// Row stride of a chunk's fp32 logits, in floats: a multiple of 8 (32-byte rows).
int64_t logits_ld(int64_t v) { return ceil_div(std::max<int64_t>(v, 1), 8) * 8; }

// The GEMM operands in the compute dtype with a unit stride (cuBLAS takes any leading dimension).
at::Tensor gemm_input(const at::Tensor& input) {
  return input.stride(1) == 1 || input.stride(0) == 1 ? input : input.contiguous();
}
at::Tensor gemm_weight(const at::Tensor& weight, at::ScalarType compute) {
  return weight.scalar_type() == compute ? weight : weight.to(compute);
}

// The row kernels' view of sub-chunk [s0, s0 + sn) of the fp32 logits at lp (row stride ld).
cuda::RowOperands chunk_operands(const LinearJob& job, const float* lp, int64_t s0, int64_t sn,
                                 int64_t ld, const at::Tensor& bias32) {
  // (soft statistics have no target: their rows' weights come from job.soft)
  const at::Tensor ts = job.target.defined() ? job.target.narrow(0, s0, sn) : at::Tensor();
  cuda::RowOperands r{};
  r.logits = lp;
  r.logits_dtype = DType::kFloat32;
  r.n = sn;
  r.v = job.weight.size(0);
  r.ld = ld;
  r.bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  r.softcap = static_cast<float>(job.softcap);
  r.temperature = static_cast<float>(job.temperature);
  r.target = ts.defined() ? ts.data_ptr<int64_t>() : nullptr;
  r.target_stride = ts.defined() ? ts.stride(0) : 0;
  r.col_offset = job.shard.vocab_start;
  r.ignore_index = job.ignore_index;
  return r;
}

// The soft mode of a row kernel's parameters for rows [s0, ...) of the job (none: plain).
cuda::SoftMode soft_mode(const LinearJob& job, int64_t s0) {
  cuda::SoftMode m;
  if (job.soft) {
    m.soft = true;
    m.y = soft_rows(*job.soft, s0);
  }
  return m;
}

}  // namespace

void row_stats_into(cuda::RowStatsParams rs, float* out, float* split_buffer,
                    const cuda::SoftTargetParams* soft, int64_t* pivot, int64_t* split_pivots) {
  if (soft != nullptr) {
    TORCH_CHECK(pivot != nullptr && split_pivots != nullptr,
                "flce: soft row_stats needs pivot buffers");
    cuda::SoftStatsParams ss{};
    static_cast<cuda::RowStatsParams&>(ss) = rs;
    ss.y = *soft;
    ss.splits = cuda::soft_stats_splits(ss, static_cast<int>(dev::sm_count()));
    ss.partials = ss.splits > 1 ? split_buffer : out;
    ss.pivots = ss.splits > 1 ? split_pivots : pivot;
    check_launch(cuda::launch_soft_stats(ss, dev::stream()), "soft_stats");
    if (ss.splits > 1) launch_soft_merge(split_buffer, split_pivots, ss.splits, ss.n, out, pivot);
    return;
  }
  rs.splits = cuda::row_stats_splits(rs, static_cast<int>(dev::sm_count()));
  rs.partials = rs.splits > 1 ? split_buffer : out;
  check_launch(cuda::launch_row_stats(rs, dev::stream()), "row_stats");
  if (rs.splits > 1) merge_partials(split_buffer, rs.splits, rs.n, out);
}

int64_t max_row_splits(int64_t v) { return std::max<int64_t>(ceil_div(v, cuda::kRowTileCols), 1); }

at::Tensor empty_partials(int64_t n, const at::TensorOptions& f32) {
  const float inf = std::numeric_limits<float>::infinity();
  return at::tensor({-inf, 0.f, -inf, 0.f, 0.f}, f32).expand({n, cuda::kPartialCols}).contiguous();
}

at::Tensor empty_soft_partials(int64_t n, const at::TensorOptions& f32, at::Tensor* pivot) {
  const float inf = std::numeric_limits<float>::infinity();
  *pivot = at::full({n}, -1, f32.dtype(at::kLong));
  return at::tensor({-inf, 0.f, -inf, 0.f, 0.f, 0.f, 0.f}, f32)
      .expand({n, cuda::kSoftCols})
      .contiguous();
}

at::Tensor gather_partials(const at::Tensor& partials, const Shard& shard) {
  const int64_t n = partials.size(0);
  if (!shard.group) return partials.view({1, n, cuda::kPartialCols});
  // (group_name is "Any" in the schema: a group's name or the group itself)
  static auto gather = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("_c10d_functional::all_gather_into_tensor", "")
                           .typed<at::Tensor(const at::Tensor&, int64_t, const c10::IValue&)>();
  static auto wait = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("_c10d_functional::wait_tensor", "")
                         .typed<at::Tensor(const at::Tensor&)>();
  at::Tensor all =
      wait.call(gather.call(partials.contiguous(), shard.group_size, c10::IValue(*shard.group)));
  return aligned_contiguous(all.view({shard.group_size, n, cuda::kPartialCols}));
}

ChunkPlan plan_chunks(int64_t n, int64_t v, at::ScalarType compute, bool split, bool must) {
  ChunkPlan plan;
  const int64_t ld = logits_ld(v);
  const int64_t budget = workspace_bytes();
  auto rows = [must](int64_t r) {
    if (r >= kMinRows) return r / kMinRows * kMinRows;
    return must ? std::max<int64_t>(r, 1) : int64_t{0};
  };
  if (compute == at::kFloat) {
    plan.in_place = true;  // the fp32 logits are the group buffer; dz is written over them
    plan.group_rows = std::min(rows(budget / (4 * ld)), heuristics::kFp32GroupRows);
    plan.sub_rows = plan.group_rows;
  } else {
    const int64_t scratch =
        std::min(budget / heuristics::kSubChunkShare, heuristics::kSubChunkMaxBytes);
    plan.sub_rows = rows(scratch / (4 * ld));
    const int64_t elt = 2 * (split ? 2 : 1);
    plan.group_rows = rows(std::max<int64_t>(budget - plan.sub_rows * ld * 4, 0) / (elt * ld));
  }
  if (plan.sub_rows < 1 || plan.group_rows < 1) return ChunkPlan{};
  plan.group_rows = std::min(plan.group_rows, std::max<int64_t>(n, 1));
  plan.sub_rows = std::min(plan.sub_rows, plan.group_rows);
  return plan;
}

bool split_grad(const LinearJob& job, bool need_c) {
  return need_c && job.input.scalar_type() != at::kFloat &&
         job.weight.scalar_type() == at::kFloat && env_flag("FLCE_CUDA_SPLIT_GRAD", true);
}

// ---------------------------------------------------------------------------------------------
// stats_chunks: the merged [n, 5] partial statistics of the shard's columns.
// ---------------------------------------------------------------------------------------------
at::Tensor stats_chunks(const LinearJob& job, bool need_sum, bool need_u, at::Tensor* pivot) {
  const int64_t n = job.input.size(0), v = job.weight.size(0);
  const auto f32 = f32_of(job.input);
  TORCH_CHECK(!job.soft || pivot != nullptr, "flce: soft stats_chunks needs a pivot output");
  // (soft mode: SoftRow states and their pivots)
  const int64_t cols = job.soft ? cuda::kSoftCols : cuda::kPartialCols;
  if (job.soft && (n == 0 || v == 0)) return empty_soft_partials(n, f32, pivot);
  if (n == 0) return dev::empty({0, cuda::kPartialCols}, f32);
  if (v == 0) return empty_partials(n, f32);  // an empty shard: the empty state per row
  const at::Tensor x = gemm_input(job.input);
  const at::Tensor w = gemm_weight(job.weight, job.input.scalar_type());
  const at::Tensor bias32 = job.bias ? job.bias->to(at::kFloat).contiguous() : at::Tensor();
  // The whole workspace for the fp32 logits; chunks of equal size (a multiple of kMinRows rows
  // where there are that many), so that the last GEMM is not a sliver.
  const int64_t ld = logits_ld(v);
  const int64_t fit = std::max<int64_t>(workspace_bytes() / (4 * ld), 1);
  const int64_t chunks = ceil_div(n, fit);
  int64_t S = ceil_div(n, chunks);
  if (S > kMinRows) S = std::min(fit, ceil_div(S, kMinRows) * kMinRows);
  at::Tensor logits = dev::empty({S * ld}, f32);
  at::Tensor split_buffer = dev::empty({max_row_splits(v) * S * cols}, f32);
  at::Tensor out = dev::empty({n, cols}, f32);
  at::Tensor split_pivots;
  if (job.soft) {
    *pivot = dev::empty({n}, job.input.options().dtype(at::kLong));
    split_pivots = dev::empty({max_row_splits(v) * S}, job.input.options().dtype(at::kLong));
  }
  for (int64_t s0 = 0; s0 < n; s0 += S) {
    const int64_t sn = std::min(S, n - s0);
    gemm_into(at::from_blob(logits.data_ptr<float>(), {sn, v}, {ld, 1}, f32),
              x.narrow(0, s0, sn), w.t());
    cuda::RowStatsParams rs{};
    static_cast<cuda::RowOperands&>(rs) =
        chunk_operands(job, logits.data_ptr<float>(), s0, sn, ld, bias32);
    rs.need_sum = need_sum;
    rs.need_u = need_u;
    const cuda::SoftMode mode = soft_mode(job, s0);
    row_stats_into(rs, out.data_ptr<float>() + s0 * cols, split_buffer.data_ptr<float>(),
                   mode.soft ? &mode.y : nullptr,
                   job.soft ? pivot->data_ptr<int64_t>() + s0 : nullptr,
                   job.soft ? split_pivots.data_ptr<int64_t>() : nullptr);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// grad_chunks: the gradients (and, computing the statistics, the loss rows).
//
// Accumulation modes, by compute dtype (the input's) and the weight's dtype:
//   dE  16-bit: one GEMM per group over the whole vocabulary (fp32 accumulation in cuBLAS), plus
//               the target entries' rounding residuals (target_fix: the dominant target column's
//               gradient is not limited by the 16-bit tile);
//       fp32:   pieces of kPieceCols columns Neumaier-added (one fp32 GEMM over a 128k
//               vocabulary would carry its k-loop's rounding), or FLCE_CUDA_FP32_GRAD=fp64.
//   dW  fp32 weight (master weights, fp32 training): its own fp32 accumulator, groups added by
//               the GEMM's beta (16-bit tile; master weights take the tile as hi + lo, two GEMMs)
//               or Neumaier-added in pieces (fp32 tile, several groups);
//       16-bit weight: one group straight in the weight's dtype, the target rows again in fp32
//               with their residuals (target_rows, `base`); several groups, or the fp16 scale,
//               through fp32 (a [V, D] accumulator, or pieces of kDwPiece rows) rounded once.
//   fp16: dz is stored times a power-of-two scale from every row's |dz| bound (so that p_j * g,
//         g ~ 1/N, stays out of fp16's subnormals), folded into the coefficients; the results
//         are multiplied by its inverse (exact). It needs every row's statistics first: given
//         statistics only (the single pass of fp16 is forward + recompute backward).
// ---------------------------------------------------------------------------------------------
GradOut grad_chunks(const LinearJob& job, const GradJob& gj, const ChunkPlan& plan) {
  const at::Tensor& input = job.input;
  const at::Tensor& weight = job.weight;
  const at::Tensor& target = job.target;
  const Shard& shard = job.shard;
  const bool given = gj.stats.defined();
  const bool need_e = gj.mask[0], need_c = gj.mask[1], need_b = gj.mask[2] && job.bias;
  const int64_t n = input.size(0), v = weight.size(0), d = input.size(1);
  const at::ScalarType compute = input.scalar_type();
  const DType dtype = to_dtype(compute);
  const auto f32 = f32_of(input);
  const cudaStream_t stream = dev::stream();
  TORCH_CHECK(given || (!gj.grad_lse && !gj.grad_entropy && compute != at::kHalf),
              "flce: grad_chunks computes the statistics only for a plain loss gradient");
  TORCH_CHECK(given || !job.soft, "flce: soft grad_chunks reads given statistics");
  const bool split = split_grad(job, need_c);
  const int64_t G = plan.group_rows;

  const at::Tensor x = gemm_input(input);
  const at::Tensor w = gemm_weight(weight, compute);
  const at::Tensor bias32 = job.bias ? job.bias->to(at::kFloat).contiguous() : at::Tensor();

  // The fused logits path (FLCE_CUDA_FUSED_LOGITS=1, opt-in until a GPU has run it; docs/cuda.md
  // "Fused logits"): the logits GEMM's epilogue stores E softcap'(z), E = exp(z - r_tile), in
  // bf16 where the group's dz will be, with a partial per (row, tile), and dz is computed over
  // it in place. For bf16 inputs and weight whose gradient meets its bound from the stored
  // values (tile_epilogue.h): no label smoothing (cancellation); statistics computed here.
  const bool fused = !given && !job.soft && env_flag("FLCE_CUDA_FUSED_LOGITS", false) &&
                     compute == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                     job.label_smoothing == 0.0 && v > 0;
  // Its GEMM (CUTLASS, sm_90a or sm_100a) where it takes the operands: x row-major (TMA; a
  // column-major x is copied once the GEMM is sure to run), every sub-chunk the whole group (no
  // fp32 scratch to bound it; vocab-parallel ranks keep the common plan).
  const bool x_row_major = x.stride(1) == 1;
  cuda::FusedLogitsParams fused_base{};
  if (fused) {
    fused_base.x = x_row_major ? x.data_ptr() : nullptr;  // (a fresh copy: aligned)
    fused_base.x_ld = x_row_major ? x.stride(0) : d;
    fused_base.w = w.data_ptr();
    fused_base.w_ld = w.stride(0);
    fused_base.n = n;
    fused_base.v = v;
    fused_base.d = d;
    fused_base.bias = job.bias ? bias32.data_ptr<float>() : nullptr;
    fused_base.softcap = static_cast<float>(job.softcap);
    fused_base.temperature = static_cast<float>(job.temperature);
    fused_base.col_offset = shard.vocab_start;
    fused_base.ignore_index = job.ignore_index;
    fused_base.e_ld = logits_ld(v);
  }
  // (FLCE_CUDA_FUSED_GEMM=0: the stand-in everywhere, to compare the two on a GPU)
  const bool try_gemm = fused && w.stride(1) == 1 && env_flag("FLCE_CUDA_FUSED_GEMM", true);
  const bool gemm_sm90 = try_gemm && cuda::fused_logits_sm90_supported(fused_base);
  const bool gemm_sm100 = try_gemm && !gemm_sm90 && cuda::fused_logits_sm100_supported(fused_base);
  const bool fused_gemm = gemm_sm90 || gemm_sm100;
  const at::Tensor xf = fused_gemm && !x_row_major ? x.contiguous() : x;
  fused_base.x = xf.data_ptr();
  fused_base.x_ld = xf.stride(0);

  GradOut out;
  if (!given) {
    out.loss_rows = dev::empty({n}, f32);
    out.flag = at::zeros({1}, input.options().dtype(at::kInt));
  }
  if (need_e) out.ge = dev::empty({n, d}, f32);
  if (need_c) out.gw = dev::empty({v, d}, weight.options());
  if (need_b) out.gb = dev::empty({v}, f32);
  if (n == 0) {
    if (need_c) out.gw.zero_();
    if (need_b) out.gb.zero_();
    return out;
  }

  const int64_t ld = logits_ld(v);
  const int64_t S = fused_gemm && !shard.group ? G : plan.sub_rows;
  const int64_t elt = input.element_size();
  // The group's gradient buffer: dz rows of G x V in the compute dtype (row stride gld
  // elements), and for master weights its residual; fp32: the logits themselves; fused: E, then
  // dz (16-byte rows for the fused GEMM's stores).
  const int64_t gld = plan.in_place || fused ? ld : v;
  at::Tensor group = dev::empty({G * gld}, input.options());
  at::Tensor group_lo = split ? dev::empty({G * v}, input.options()) : at::Tensor();
  at::Tensor scratch = plan.in_place || fused_gemm ? at::Tensor() : dev::empty({S * ld}, f32);
  // fused: a partial per (row, tile) of a sub-chunk
  const int64_t fused_tiles = ceil_div(v, cuda::kFusedTileCols);
  at::Tensor tile_partials =
      fused ? dev::empty({S * fused_tiles * cuda::kPartialCols}, f32) : at::Tensor();
  at::Tensor split_partials =
      given || fused ? at::Tensor() : dev::empty({max_row_splits(v) * S * cuda::kPartialCols}, f32);
  at::Tensor partials, lse, stats;
  if (!given) {
    partials = dev::empty({S, cuda::kPartialCols}, f32);
    lse = dev::empty({S}, f32);
    stats = dev::empty({S, cuda::kStatsCols}, f32);
  }
  // The row coefficients: every row's at once from given statistics, else a sub-chunk's.
  at::Tensor coef = dev::empty({given ? n : S, 8}, f32), bound = dev::empty({given ? n : S}, f32);
  at::Tensor scale, inv_scale;
  if (given && job.soft) {
    launch_soft_coef(n, gj.stats, gj.grad_loss, gj.grad_lse, gj.grad_entropy, gj.z_weight,
                     job.z_loss, job.temperature, coef.data_ptr<float>(), bound.data_ptr<float>());
  } else if (given) {
    launch_coef(target, gj.stats, gj.grad_loss.data_ptr<float>(), gj.grad_loss.stride(0),
                gj.grad_lse ? gj.grad_lse->data_ptr<float>() : nullptr,
                gj.grad_lse ? gj.grad_lse->stride(0) : 0,
                gj.grad_entropy ? gj.grad_entropy->data_ptr<float>() : nullptr,
                gj.grad_entropy ? gj.grad_entropy->stride(0) : 0, job.ignore_index,
                job.label_smoothing, job.z_loss, job.softcap, job.temperature, shard.vocab_size,
                coef.data_ptr<float>(), bound.data_ptr<float>());
    if (compute == at::kHalf) {
      // max |scale * dz| in (2^13, 2^14]; dz is linear in (a, u, dz_t, h) (math.h RowGrad).
      const at::Tensor mx = bound.amax();
      const at::Tensor e = at::clamp(14.0 - at::ceil(at::log2(mx)), -126.0, 126.0);
      scale = at::where(at::isfinite(mx) & (mx > 0), at::exp2(e), at::ones_like(mx))
                  .reshape({1})
                  .contiguous();
      inv_scale = at::reciprocal(scale).contiguous();  // exact: a power of two
      coef.narrow(1, 1, 3).mul_(scale);
      coef.select(1, 5).mul_(scale);
    }
  }
  const float* inv_ptr = inv_scale.defined() ? inv_scale.data_ptr<float>() : nullptr;

  // dW: an fp32 weight (master weights, or fp32 training) is its own fp32 accumulator; a 16-bit
  // one goes through fp32 (the multi-group accumulator, or vocab pieces of one group) that gets
  // the target rows' residuals (target_rows) before the one rounding.
  const bool fp32_dw = weight.scalar_type() == at::kFloat;
  const bool fix_c = need_c && compute != at::kFloat && !fp32_dw;
  const bool fix_target = (need_e || fix_c) && compute != at::kFloat;
  at::Tensor resid = fix_target ? dev::empty({G}, f32) : at::Tensor();
  // Bias gradient: per 8-row CTA column sums of a sub-chunk, reduced in order, compensated
  // across sub-chunks.
  at::Tensor col_partials = need_b ? dev::empty({ceil_div(S, kBiasRows) * v}, f32) : at::Tensor();
  at::Tensor gb_tmp, gb_comp;
  if (need_b) {
    gb_tmp = dev::empty({v}, f32);
    out.gb.zero_();
    gb_comp = at::zeros({v}, f32);
  }
  const int64_t kPieceCols = heuristics::kFp32PieceCols;
  // FLCE_CUDA_FP32_GRAD=fp64: dE and each group's dW in float64 (gemm_f64: the products exact,
  // the sums in double), rounded once; dW's groups still Kahan-added in fp32.
  const bool f64 = compute == at::kFloat && fp32_grads_in_fp64();
  const int64_t pieces = compute == at::kFloat && !f64 ? ceil_div(v, kPieceCols) : 1;
  at::Tensor tmp_e = need_e && pieces > 1 ? dev::empty({G, d}, f32) : at::Tensor();
  at::Tensor comp_e = need_e && pieces > 1 ? dev::empty({G, d}, f32) : at::Tensor();
  const auto f64_opts = input.options().dtype(at::kDouble);
  at::Tensor e64 = f64 && need_e ? dev::empty({G, d}, f64_opts) : at::Tensor();
  const bool separate_acc = fix_c && G < n;
  // One group of a 16-bit weight with the fp16 scale: dW in fp32 pieces, each rounded once.
  const bool dw_pieces = fix_c && !separate_acc && scale.defined();
  // dW's fp32 buffer: the weight's own (fp32), the accumulator of every group's dW (16-bit,
  // several groups) or the target rows' full fp32 dW rows (16-bit, one group: [G, D]).
  at::Tensor acc_w;
  if (need_c && !dw_pieces) acc_w = fp32_dw ? out.gw : dev::empty({separate_acc ? v : G, d}, f32);
  // fp32 training, several groups: dW Kahan-compensated across them (pieces of kDwPiece rows).
  const bool kahan_dw = need_c && compute == at::kFloat && G < n;
  at::Tensor comp_w = kahan_dw ? at::zeros({v, d}, f32) : at::Tensor();
  at::Tensor tmp_w = kahan_dw || dw_pieces ? dev::empty({std::min(v, kDwPiece), d}, f32)
                                           : at::Tensor();
  at::Tensor w64 = f64 && need_c ? dev::empty({std::min(v, kDwPiece), d}, f64_opts) : at::Tensor();
  // x as target_rows reads it: row-major
  const at::Tensor x_rows = fix_c && x.stride(1) != 1 ? x.contiguous() : x;

  for (int64_t g0 = 0; g0 < n; g0 += G) {
    const int64_t gn = std::min(G, n - g0);
    const at::Tensor xg = x.narrow(0, g0, gn);
    for (int64_t s0 = g0; s0 < g0 + gn; s0 += S) {
      const int64_t sn = std::min(S, g0 + gn - s0);
      const at::Tensor ts = target.narrow(0, s0, sn);
      char* dz_rows = static_cast<char*>(group.data_ptr()) + (s0 - g0) * gld * elt;
      if (fused) {
        cuda::FusedLogitsParams fp = fused_base;
        fp.x = static_cast<const char*>(xf.data_ptr()) + s0 * xf.stride(0) * elt;
        fp.n = sn;
        fp.target = ts.data_ptr<int64_t>();
        fp.target_stride = ts.stride(0);
        fp.e = dz_rows;
        fp.partials = tile_partials.data_ptr<float>();
        if (gemm_sm90) {
          check_launch(cuda::launch_fused_logits_sm90(fp, stream), "fused_logits_sm90");
        } else if (gemm_sm100) {
          check_launch(cuda::launch_fused_logits_sm100(fp, stream), "fused_logits_sm100");
        } else {
          gemm_into(at::from_blob(scratch.data_ptr<float>(), {sn, v}, {ld, 1}, f32),
                    x.narrow(0, s0, sn), w.t());
          fp.logits = scratch.data_ptr<float>();
          fp.logits_ld = ld;
          check_launch(cuda::launch_logits_epilogue(fp, stream), "logits_epilogue");
        }
        check_launch(cuda::launch_fused_merge(tile_partials.data_ptr<float>(), sn, fused_tiles,
                                              partials.data_ptr<float>(), stream),
                     "fused_merge");
      }
      float* lp = plan.in_place ? reinterpret_cast<float*>(dz_rows)
                                : (scratch.defined() ? scratch.data_ptr<float>() : nullptr);
      if (!fused) {
        gemm_into(at::from_blob(lp, {sn, v}, {ld, 1}, f32), x.narrow(0, s0, sn), w.t());
      }
      const cuda::RowOperands ops = chunk_operands(job, lp, s0, sn, ld, bias32);
      float* sub_coef = coef.data_ptr<float>() + (given ? s0 * 8 : 0);
      at::Tensor st;
      if (!given) {
        if (!fused) {
          cuda::RowStatsParams rs{};
          static_cast<cuda::RowOperands&>(rs) = ops;
          rs.need_sum = job.label_smoothing != 0.0;
          rs.need_u = false;  // no entropy: the single pass returns none
          row_stats_into(rs, partials.data_ptr<float>(), split_partials.data_ptr<float>());
        }
        st = stats.narrow(0, 0, sn);
        launch_finalize(gather_partials(partials.narrow(0, 0, sn), shard), ts, shard.vocab_size,
                        job.ignore_index, job.label_smoothing, job.z_loss,
                        out.loss_rows.data_ptr<float>() + s0, lse.data_ptr<float>(), nullptr,
                        st.data_ptr<float>(), out.flag.data_ptr<int>());
        launch_coef(ts, st, gj.grad_loss.data_ptr<float>() + s0 * gj.grad_loss.stride(0),
                    gj.grad_loss.stride(0), nullptr, 0, nullptr, 0, job.ignore_index,
                    job.label_smoothing, job.z_loss, job.softcap, job.temperature,
                    shard.vocab_size, sub_coef, bound.data_ptr<float>());
      }
      if (fused) {
        cuda::FusedGradParams fg{};
        fg.e = dz_rows;
        fg.e_ld = gld;
        fg.partials = tile_partials.data_ptr<float>();
        fg.coef = sub_coef;
        fg.stats = st.data_ptr<float>();
        fg.n = sn;
        fg.v = v;
        fg.softcap = static_cast<float>(job.softcap);
        fg.temperature = static_cast<float>(job.temperature);
        fg.target = ts.data_ptr<int64_t>();
        fg.target_stride = ts.stride(0);
        fg.col_offset = shard.vocab_start;
        fg.ignore_index = job.ignore_index;
        fg.target_resid = fix_target ? resid.data_ptr<float>() + (s0 - g0) : nullptr;
        fg.col_partials = need_b ? col_partials.data_ptr<float>() : nullptr;
        fg.rows_per_block = kBiasRows;
        check_launch(cuda::launch_fused_grad(fg, stream), "fused_grad");
      } else {
        cuda::RowGradParams rg{};
        static_cast<cuda::RowOperands&>(rg) = ops;
        rg.mode = soft_mode(job, s0);
        rg.coef = sub_coef;
        rg.grad = dz_rows;
        rg.grad_ld = gld;
        rg.grad_lo =
            split ? static_cast<char*>(group_lo.data_ptr()) + (s0 - g0) * v * elt : nullptr;
        rg.grad_lo_ld = v;
        rg.target_resid = fix_target ? resid.data_ptr<float>() + (s0 - g0) : nullptr;
        rg.col_partials = need_b && v > 0 ? col_partials.data_ptr<float>() : nullptr;
        rg.rows_per_cta = rg.col_partials != nullptr ? kBiasRows : 1;
        // (a 16-bit tile never aliases the logits here: in place is fp32 only)
        rg.entropy = gj.grad_entropy.has_value();
        rg.col_splits = cuda::row_grad_splits(rg, dtype, static_cast<int>(dev::sm_count()));
        check_launch(cuda::launch_row_grad(rg, dtype, stream), "row_grad");
      }
      if (need_b) {
        check_launch(cuda::launch_column_sum(col_partials.data_ptr<float>(),
                                             ceil_div(sn, kBiasRows), v,
                                             gb_tmp.data_ptr<float>(), stream),
                     "column_sum");
        check_launch(cuda::launch_kahan_accumulate(out.gb.data_ptr<float>(),
                                                   gb_comp.data_ptr<float>(),
                                                   gb_tmp.data_ptr<float>(), v, nullptr, stream),
                     "kahan_accumulate");
      }
    }
    const at::Tensor dz = at::from_blob(group.data_ptr(), {gn, v}, {gld, 1}, input.options());
    const at::Tensor tg = target.narrow(0, g0, gn);
    if (need_e && f64) {
      const at::Tensor t = e64.narrow(0, 0, gn);
      gemm_f64(t, dz, w, false);
      out.ge.narrow(0, g0, gn).copy_(t);
    } else if (need_e) {
      const at::Tensor ge = out.ge.narrow(0, g0, gn);
      if (v == 0) ge.zero_();  // an empty vocab-parallel shard adds nothing
      for (int64_t p0 = 0; p0 < v; p0 += kPieceCols) {
        const int64_t pc = pieces > 1 ? std::min(kPieceCols, v - p0) : v;
        const at::Tensor a = dz.narrow(1, p0, pc), b = w.narrow(0, p0, pc);
        if (p0 == 0) {
          gemm_into(ge, a, b);
          if (pieces > 1) comp_e.narrow(0, 0, gn).zero_();
        } else {
          at::Tensor t = tmp_e.narrow(0, 0, gn);
          gemm_into(t, a, b);
          check_launch(cuda::launch_kahan_accumulate(ge.data_ptr<float>(),
                                                     comp_e.data_ptr<float>(), t.data_ptr<float>(),
                                                     gn * d, nullptr, stream),
                       "kahan_accumulate");
        }
        if (pieces == 1) break;
      }
      if (pieces > 1) ge.add_(comp_e.narrow(0, 0, gn));
      if (inv_scale.defined()) ge.mul_(inv_scale);
      if (fix_target) {
        launch_fix(w, gn, v, d, tg, shard.vocab_start, job.ignore_index, resid.narrow(0, 0, gn),
                   inv_ptr, ge.data_ptr<float>(), dtype);
      }
    }
    if (need_c && f64) {
      // Each vocabulary piece of this group's dW in double, rounded once; the first group is
      // dW so far, the next ones Kahan-added to it.
      for (int64_t p0 = 0; p0 < v; p0 += kDwPiece) {
        const int64_t pc = std::min(kDwPiece, v - p0);
        const at::Tensor t = w64.narrow(0, 0, pc);
        gemm_f64(t, dz.narrow(1, p0, pc).t(), xg, false);
        if (g0 == 0) {
          acc_w.narrow(0, p0, pc).copy_(t);
        } else {
          const at::Tensor t32 = tmp_w.narrow(0, 0, pc);
          t32.copy_(t);
          check_launch(cuda::launch_kahan_accumulate(acc_w.narrow(0, p0, pc).data_ptr<float>(),
                                                     comp_w.narrow(0, p0, pc).data_ptr<float>(),
                                                     t32.data_ptr<float>(), pc * d, nullptr,
                                                     stream),
                       "kahan_accumulate");
        }
      }
    } else if (need_c) {
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
        const TargetOrder order = sort_targets(tg);
        const at::Tensor xr = x_rows.narrow(0, g0, gn);
        const at::Tensor rs = resid.narrow(0, 0, gn);
        if (separate_acc) {
          gemm_into(acc_w, dz.t(), xg, beta);
          add_target_rows(acc_w, shard.vocab_start, xr, order, rs, nullptr, job.ignore_index,
                          dtype);
        } else if (dw_pieces) {
          // fp16: each piece's fp32 dW gets its target rows' residuals, then loses the scale
          // in its one rounding (scaled, a 16-bit dW could overflow).
          for (int64_t p0 = 0; p0 < v; p0 += kDwPiece) {
            const int64_t pc = std::min(kDwPiece, v - p0);
            const at::Tensor t = tmp_w.narrow(0, 0, pc);
            gemm_into(t, dz.narrow(1, p0, pc).t(), xg);
            add_target_rows(t, shard.vocab_start + p0, xr, order, rs, nullptr, job.ignore_index,
                            dtype);
            check_launch(cuda::launch_scale_store(out.gw.narrow(0, p0, pc).data_ptr(),
                                                  to_dtype(weight.scalar_type()),
                                                  t.data_ptr<float>(), pc * d, inv_ptr, stream),
                         "scale_store");
          }
        } else {
          // One group: dW straight in the weight's dtype (cuBLAS rounds each fp32 sum once),
          // then the rows that are some row's target again in fp32, from the dz columns of the
          // sorted targets (every position, duplicates and ignored ones included: a fixed size,
          // no host sync), with their residuals added before the one rounding. In place of
          // fp32 pieces of dW, each stored and patched: 63 of them cost 2.8 ms per step at
          // N = 4096, V = 128256 on the H200 (docs/perf-notes.md).
          gemm_into(out.gw, dz.t(), xg);
          if (v > 0) {
            const at::Tensor cols = (order.sorted - shard.vocab_start).clamp(0, v - 1);
            const at::Tensor target_cols = dz.index_select(1, cols);  // [gn rows, gn positions]
            const at::Tensor base = acc_w.narrow(0, 0, gn);           // [gn positions, d] fp32
            gemm_into(base, target_cols.t(), xg);
            add_target_rows(out.gw, shard.vocab_start, xr, order, rs, nullptr, job.ignore_index,
                            dtype, base);
          }
        }
      }
    }
  }
  if (kahan_dw) acc_w.add_(comp_w);
  if (separate_acc) {
    check_launch(cuda::launch_scale_store(out.gw.data_ptr(), to_dtype(weight.scalar_type()),
                                          acc_w.data_ptr<float>(), v * d, inv_ptr, stream),
                 "scale_store");
  }
  if (need_c && fp32_dw && inv_scale.defined()) out.gw.mul_(inv_scale);
  if (need_b) {
    out.gb.add_(gb_comp);
    if (inv_scale.defined()) out.gb.mul_(inv_scale);
  }
  return out;
}

}  // namespace binding
}  // namespace flce
