// The single pass of the CUDA backend (flce::sum_and_grad): the training default, the loss and
// its gradients with 3 GEMMs, no recompute. Helpers shared with the other launch sequences are
// in binding.h (flce_cuda.cpp); the row kernels in flce_rows.cu.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "cuda/binding.h"
#include "cuda/device.h"
#include "cuda/params.h"
#include "flce_ops.h"

namespace flce {
namespace binding {
namespace {

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

  // The fused logits path (FLCE_CUDA_FUSED_LOGITS=1, opt-in until a GPU has run it; docs/cuda.md
  // "Fused logits"): the logits GEMM's epilogue stores E softcap'(z), E = exp(z - r_tile), in
  // bf16 where the group's dz will be, with a partial per (row, tile), and dz is computed over
  // it in place. For bf16 inputs and weight whose gradient meets its bound from the stored
  // values (tile_epilogue.h): no label smoothing (cancellation).
  const bool fused = env_flag("FLCE_CUDA_FUSED_LOGITS", false) && compute == at::kBFloat16 &&
                     weight.scalar_type() == at::kBFloat16 && label_smoothing == 0.0 && v > 0;
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
    fused_base.bias = bias ? bias32.data_ptr<float>() : nullptr;
    fused_base.softcap = static_cast<float>(softcap);
    fused_base.temperature = static_cast<float>(temperature);
    fused_base.col_offset = shard.vocab_start;
    fused_base.ignore_index = ignore_index;
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

  at::Tensor loss_rows = dev::empty({n}, f32);
  at::Tensor ge = need_e ? dev::empty({1, n, d}, f32) : input.new_empty({0});
  at::Tensor gw = need_c ? dev::empty({1, v, d}, weight.options()) : weight.new_empty({0});
  at::Tensor gb = need_b ? dev::empty({1, v}, f32) : weight.new_empty({0});

  const int64_t G = plan.group_rows, ld = logits_ld(v);
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
  // Column splits of the row kernels (a sub-chunk's rows alone are a few hundred CTAs): at most
  // one per 4096-column tile of a row.
  const int64_t max_splits = std::max<int64_t>(ceil_div(v, cuda::kRowTileCols), 1);
  at::Tensor split_partials =
      fused ? at::Tensor() : dev::empty({max_splits * S * cuda::kPartialCols}, f32);
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
  // FLCE_CUDA_FP32_GRAD=fp64: instead, dE and each group's dW in float64 (gemm_f64: the products
  // exact, the sums in double), rounded once; dW's groups still Kahan-added in fp32.
  const bool f64 = compute == at::kFloat && fp32_grads_in_fp64();
  const int64_t pieces = compute == at::kFloat && !f64 ? ceil_div(v, kPieceCols) : 1;
  at::Tensor tmp_e = need_e && pieces > 1 ? dev::empty({G, d}, f32) : at::Tensor();
  at::Tensor comp_e = need_e && pieces > 1 ? dev::empty({G, d}, f32) : at::Tensor();
  const auto f64_opts = input.options().dtype(at::kDouble);
  at::Tensor e64 = f64 && need_e ? dev::empty({G, d}, f64_opts) : at::Tensor();
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
  at::Tensor w64 = f64 && need_c ? dev::empty({std::min(v, kDwPiece), d}, f64_opts) : at::Tensor();
  // x as target_rows reads it: row-major
  const at::Tensor x_rows = fix_c && x.stride(1) != 1 ? x.contiguous() : x;

  for (int64_t g0 = 0; g0 < n; g0 += G) {
    const int64_t gn = std::min(G, n - g0);
    const at::Tensor xg = x.narrow(0, g0, gn);
    for (int64_t s0 = g0; s0 < g0 + gn; s0 += S) {
      const int64_t sn = std::min(S, g0 + gn - s0);
      const at::Tensor ts = target.narrow(0, s0, sn);
      if (fused) {
        cuda::FusedLogitsParams fp = fused_base;
        fp.x = static_cast<const char*>(xf.data_ptr()) + s0 * xf.stride(0) * elt;
        fp.n = sn;
        fp.target = ts.data_ptr<int64_t>();
        fp.target_stride = ts.stride(0);
        fp.e = static_cast<char*>(group.data_ptr()) + (s0 - g0) * gld * elt;
        fp.partials = tile_partials.data_ptr<float>();
        if (gemm_sm90) {
          check_launch(cuda::launch_fused_logits_sm90(fp, stream), "fused_logits_sm90");
        } else if (gemm_sm100) {
          check_launch(cuda::launch_fused_logits_sm100(fp, stream), "fused_logits_sm100");
        } else {
          const at::Tensor logits =
              at::from_blob(scratch.data_ptr<float>(), {sn, v}, {ld, 1}, f32);
          gemm_into(logits, x.narrow(0, s0, sn), w.t());
          fp.logits = scratch.data_ptr<float>();
          fp.logits_ld = ld;
          check_launch(cuda::launch_logits_epilogue(fp, stream), "logits_epilogue");
        }
        check_launch(cuda::launch_fused_merge(tile_partials.data_ptr<float>(), sn, fused_tiles,
                                              partials.data_ptr<float>(), stream),
                     "fused_merge");
      }
      cuda::RowStatsParams rs{};
      float* lp = plan.in_place ? group.data_ptr<float>() + (s0 - g0) * ld
                                : (scratch.defined() ? scratch.data_ptr<float>() : nullptr);
      if (!fused) {
        const at::Tensor logits = at::from_blob(lp, {sn, v}, {ld, 1}, f32);
        gemm_into(logits, x.narrow(0, s0, sn), w.t());
      }

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
      if (!fused) {
        rs.splits = cuda::row_stats_splits(rs, static_cast<int>(dev::sm_count()));
        rs.partials =
            rs.splits > 1 ? split_partials.data_ptr<float>() : partials.data_ptr<float>();
        check_launch(cuda::launch_row_stats(rs, stream), "row_stats");
        if (rs.splits > 1) {
          merge_partials(split_partials.data_ptr<float>(), rs.splits, sn,
                         partials.data_ptr<float>());
        }
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

      if (fused) {
        cuda::FusedGradParams fg{};
        fg.e = static_cast<char*>(group.data_ptr()) + (s0 - g0) * gld * elt;
        fg.e_ld = gld;
        fg.partials = tile_partials.data_ptr<float>();
        fg.coef = coef.data_ptr<float>();
        fg.stats = st.data_ptr<float>();
        fg.n = sn;
        fg.v = v;
        fg.softcap = static_cast<float>(softcap);
        fg.temperature = static_cast<float>(temperature);
        fg.target = ts.data_ptr<int64_t>();
        fg.target_stride = ts.stride(0);
        fg.col_offset = shard.vocab_start;
        fg.ignore_index = ignore_index;
        fg.target_resid = fix_target ? resid.data_ptr<float>() + (s0 - g0) : nullptr;
        fg.col_partials = need_b ? col_partials.data_ptr<float>() : nullptr;
        fg.rows_per_block = kBiasRows;
        check_launch(cuda::launch_fused_grad(fg, stream), "fused_grad");
      } else {
        cuda::RowGradParams rg{};
        static_cast<cuda::RowOperands&>(rg) = rs;  // the same logits
        rg.coef = coef.data_ptr<float>();
        rg.grad = static_cast<char*>(group.data_ptr()) + (s0 - g0) * gld * elt;
        rg.grad_ld = gld;
        rg.grad_lo =
            split ? static_cast<char*>(group_lo.data_ptr()) + (s0 - g0) * v * elt : nullptr;
        rg.grad_lo_ld = v;
        rg.target_resid = fix_target ? resid.data_ptr<float>() + (s0 - g0) : nullptr;
        rg.col_partials = need_b && v > 0 ? col_partials.data_ptr<float>() : nullptr;
        rg.rows_per_cta = rg.col_partials != nullptr ? kBiasRows : 1;
        // (a 16-bit tile never aliases the logits here: in place is fp32 only)
        rg.entropy = false;  // the single pass returns no entropy
        rg.col_splits = cuda::row_grad_splits(rg, dtype, static_cast<int>(dev::sm_count()));
        check_launch(cuda::launch_row_grad(rg, dtype, stream), "row_grad");
      }
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
    if (need_e && f64) {
      const at::Tensor t = e64.narrow(0, 0, gn);
      gemm_f64(t, dz, w, false);
      ge[0].narrow(0, g0, gn).copy_(t);
    } else if (need_e) {
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

}  // namespace
}  // namespace binding

FLCE_CUDA_IMPL(m) { m.impl("sum_and_grad", &binding::sum_and_grad_cuda); }

}  // namespace flce
