// The row-chunk driver of the CUDA backend. Every launch sequence of the linear ops (forward,
// partial_stats, the recompute backward, the single pass, vocab-parallel) is one of two loops
// over chunks of rows, each chunk's logits from one library GEMM (cuBLAS with an fp32 output) and
// the row kernels of flce_rows.cu:
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
//                 in every accumulation mode (GradAccumulator, accumulate.cpp).
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

void row_argmax_into(const cuda::RowOperands& ops, int64_t* out) {
  cuda::RowArgmaxParams ap{};
  static_cast<cuda::RowOperands&>(ap) = ops;
  ap.argmax = out;
  check_launch(cuda::launch_row_argmax(ap, dev::stream()), "row_argmax");
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
  // Called boxed: its group_name is "Any" in the schema of the torch CI builds against (2.14)
  // and "str" in 2.11's (the lent GPU machines' image); a typed call fits one of the two, a
  // boxed string both.
  static const c10::OperatorHandle gather =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_gather_into_tensor",
                                                     "");
  static auto wait = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("_c10d_functional::wait_tensor", "")
                         .typed<at::Tensor(const at::Tensor&)>();
  torch::jit::Stack stack{partials.contiguous(), shard.group_size, *shard.group};
  gather.callBoxed(&stack);
  at::Tensor all = wait.call(stack.back().toTensor());
  return aligned_contiguous(all.view({shard.group_size, n, cuda::kPartialCols}));
}

ChunkPlan plan_chunks(int64_t n, int64_t v, at::ScalarType compute, bool split, bool must) {
  return heuristics::chunk_plan(n, logits_ld(v), workspace_bytes(), compute == at::kFloat, split,
                                must);
}

bool split_grad(const LinearJob& job, bool need_c) {
  return need_c && job.input.scalar_type() != at::kFloat && job.weight.scalar_type() == at::kFloat;
}

// ---------------------------------------------------------------------------------------------
// stats_chunks: the merged [n, 5] partial statistics of the shard's columns.
// ---------------------------------------------------------------------------------------------
at::Tensor stats_chunks(const LinearJob& job, bool need_sum, bool need_u, at::Tensor* pivot,
                        at::Tensor* argmax) {
  const int64_t n = job.input.size(0), v = job.weight.size(0);
  const auto f32 = f32_of(job.input);
  TORCH_CHECK(!job.soft || pivot != nullptr, "flce: soft stats_chunks needs a pivot output");
  TORCH_CHECK(!job.soft || argmax == nullptr, "flce: soft stats_chunks keeps no argmax");
  if (argmax != nullptr) {
    // (an empty shard has no non-target column: -1)
    *argmax = v == 0 ? at::full({n}, -1, job.input.options().dtype(at::kLong))
                     : dev::empty({n}, job.input.options().dtype(at::kLong));
  }
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
    if (argmax != nullptr) row_argmax_into(rs, argmax->data_ptr<int64_t>() + s0);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// grad_chunks: the gradients (and, computing the statistics, the loss rows). Its parts: the
// coefficients of given statistics, the single pass' statistics of a sub-chunk, and the
// accumulator (accumulate.cpp) that turns each group's dz into dE, dW and db.
// ---------------------------------------------------------------------------------------------
namespace {

// Every row's gradient coefficients [n, 8] and |dz| bounds [n] from given statistics. fp16: the
// tile's power-of-two scale folded into them (dz is linear in (a, u, dz_t, h), math.h RowGrad),
// so that max |scale * dz| is in (2^13, 2^14] and p_j * g, g ~ 1/N, stays out of fp16's
// subnormals; returns its inverse [1] (exact), else undefined.
at::Tensor given_coefficients(const LinearJob& job, const GradJob& gj, const at::Tensor& coef,
                              const at::Tensor& bound) {
  if (job.soft) {
    // (the same slots: soft dz = A p_c - g y_c with g in u's, linear in (a, u, dz_t, h) too)
    launch_soft_coef(coef.size(0), gj.stats, gj.grad_loss, gj.grad_lse, gj.grad_entropy,
                     gj.z_weight, job.z_loss, job.temperature, coef.data_ptr<float>(),
                     bound.data_ptr<float>());
  } else {
    launch_coef(job.target, gj.stats, gj.grad_loss.data_ptr<float>(), gj.grad_loss.stride(0),
                gj.grad_lse ? gj.grad_lse->data_ptr<float>() : nullptr,
                gj.grad_lse ? gj.grad_lse->stride(0) : 0,
                gj.grad_entropy ? gj.grad_entropy->data_ptr<float>() : nullptr,
                gj.grad_entropy ? gj.grad_entropy->stride(0) : 0, job.ignore_index,
                job.label_smoothing, job.z_loss, job.softcap, job.temperature,
                job.shard.vocab_size, coef.data_ptr<float>(), bound.data_ptr<float>());
  }
  if (job.input.scalar_type() != at::kHalf) return at::Tensor();
  const at::Tensor mx = bound.amax();
  const at::Tensor e = at::clamp(14.0 - at::ceil(at::log2(mx)), -126.0, 126.0);
  const at::Tensor scale =
      at::where(at::isfinite(mx) & (mx > 0), at::exp2(e), at::ones_like(mx)).reshape({1});
  coef.narrow(1, 1, 3).mul_(scale);
  coef.select(1, 5).mul_(scale);
  return at::reciprocal(scale).contiguous();
}

// The single pass' statistics of one sub-chunk of at most S rows: its partials (row_stats of its
// logits), all-gathered over the shard's group and finalized into the loss rows, then its rows'
// coefficients.
struct SubChunkStats {
  at::Tensor partials, split_partials, lse, stats;

  SubChunkStats(int64_t S, int64_t v, const at::TensorOptions& f32)
      : partials(dev::empty({S, cuda::kPartialCols}, f32)),
        split_partials(dev::empty({max_row_splits(v) * S * cuda::kPartialCols}, f32)),
        lse(dev::empty({S}, f32)),
        stats(dev::empty({S, cuda::kStatsCols}, f32)) {}

  // ops: the sub-chunk's logits; its rows' coefficients into coef and bound.
  void compute(const LinearJob& job, const GradJob& gj, const cuda::RowOperands& ops, int64_t s0,
               int64_t sn, GradOut& out, float* coef, float* bound) {
    cuda::RowStatsParams rs{};
    static_cast<cuda::RowOperands&>(rs) = ops;
    rs.need_sum = job.label_smoothing != 0.0;
    rs.need_u = false;  // no entropy: the single pass returns none
    row_stats_into(rs, partials.data_ptr<float>(), split_partials.data_ptr<float>());
    const at::Tensor ts = job.target.narrow(0, s0, sn), st = stats.narrow(0, 0, sn);
    launch_finalize(gather_partials(partials.narrow(0, 0, sn), job.shard), ts,
                    job.shard.vocab_size, job.ignore_index, job.label_smoothing, job.z_loss,
                    out.loss_rows.data_ptr<float>() + s0, lse.data_ptr<float>(), nullptr,
                    st.data_ptr<float>(), out.flag.data_ptr<int>());
    const int64_t gs = gj.grad_loss.stride(0);
    launch_coef(ts, st, gj.grad_loss.data_ptr<float>() + s0 * gs, gs, nullptr, 0, nullptr, 0,
                job.ignore_index, job.label_smoothing, job.z_loss, job.softcap, job.temperature,
                job.shard.vocab_size, coef, bound);
  }
};

}  // namespace

// Groups of G rows, each in sub-chunks of S: the logits GEMM, the statistics (given, or the
// single pass'), row_grad's dz into the group buffer; then the group's dE and dW.
GradOut grad_chunks(const LinearJob& job, const GradJob& gj, const ChunkPlan& plan) {
  const bool given = gj.stats.defined();
  const int64_t n = job.input.size(0), v = job.weight.size(0);
  const at::ScalarType compute = job.input.scalar_type();
  const auto f32 = f32_of(job.input);
  TORCH_CHECK(given || (!gj.grad_lse && !gj.grad_entropy && compute != at::kHalf),
              "flce: grad_chunks computes the statistics only for a plain loss gradient");
  TORCH_CHECK(given || !job.soft, "flce: soft grad_chunks reads given statistics");
  const bool split = split_grad(job, gj.mask[1]);
  const at::Tensor x = gemm_input(job.input);
  const at::Tensor w = gemm_weight(job.weight, compute);
  const at::Tensor bias32 = job.bias ? job.bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t G = plan.group_rows, S = plan.sub_rows;
  const int64_t ld = logits_ld(v), elt = job.input.element_size();
  GradOut out;
  if (!given) {
    out.loss_rows = dev::empty({n}, f32);
    out.flag = at::zeros({1}, job.input.options().dtype(at::kInt));
  }
  // The row coefficients: every row's at once from given statistics, else a sub-chunk's.
  at::Tensor coef = dev::empty({given ? n : S, 8}, f32), bound = dev::empty({given ? n : S}, f32);
  const at::Tensor inv_scale = given && n > 0 ? given_coefficients(job, gj, coef, bound)
                                              : at::Tensor();
  GradAccumulator acc(job, gj.mask, G, S, x, w, inv_scale);
  if (n == 0) {
    acc.finish(out);
    return out;
  }
  // The group's gradient buffer: dz rows of G x V in the compute dtype (row stride gld
  // elements), and for master weights its lo half; fp32: the logits themselves. The fp32 logits
  // of a sub-chunk otherwise.
  const int64_t gld = plan.in_place ? ld : v;
  at::Tensor group = dev::empty({G * gld}, job.input.options());
  at::Tensor group_lo = split ? dev::empty({G * v}, job.input.options()) : at::Tensor();
  at::Tensor scratch = plan.in_place ? at::Tensor() : dev::empty({S * ld}, f32);
  std::optional<SubChunkStats> sub;
  if (!given) sub.emplace(S, v, f32);

  for (int64_t g0 = 0; g0 < n; g0 += G) {
    const int64_t gn = std::min(G, n - g0);
    for (int64_t s0 = g0; s0 < g0 + gn; s0 += S) {
      const int64_t sn = std::min(S, g0 + gn - s0);
      char* dz_rows = static_cast<char*>(group.data_ptr()) + (s0 - g0) * gld * elt;
      float* lp = plan.in_place ? reinterpret_cast<float*>(dz_rows) : scratch.data_ptr<float>();
      gemm_into(at::from_blob(lp, {sn, v}, {ld, 1}, f32), x.narrow(0, s0, sn), w.t());
      const cuda::RowOperands ops = chunk_operands(job, lp, s0, sn, ld, bias32);
      float* sub_coef = coef.data_ptr<float>() + (given ? s0 * 8 : 0);
      if (!given) sub->compute(job, gj, ops, s0, sn, out, sub_coef, bound.data_ptr<float>());
      cuda::RowGradParams rg{};
      static_cast<cuda::RowOperands&>(rg) = ops;
      rg.mode = soft_mode(job, s0);
      rg.coef = sub_coef;
      rg.grad = dz_rows;
      rg.grad_ld = gld;
      rg.grad_lo =
          split ? static_cast<char*>(group_lo.data_ptr()) + (s0 - g0) * v * elt : nullptr;
      rg.grad_lo_ld = v;
      rg.target_resid = acc.target_resid(s0 - g0);
      rg.col_partials = acc.bias_partials();
      rg.rows_per_cta = rg.col_partials != nullptr ? kBiasRows : 1;
      // (a 16-bit tile never aliases the logits here: in place is fp32 only)
      rg.entropy = gj.grad_entropy.has_value();
      rg.col_splits =
          cuda::row_grad_splits(rg, to_dtype(compute), static_cast<int>(dev::sm_count()));
      check_launch(cuda::launch_row_grad(rg, to_dtype(compute), dev::stream()), "row_grad");
      acc.add_bias(sn);
    }
    const auto opts = job.input.options();
    acc.add_group(at::from_blob(group.data_ptr(), {gn, v}, {gld, 1}, opts),
                  split ? at::from_blob(group_lo.data_ptr(), {gn, v}, {v, 1}, opts) : at::Tensor(),
                  g0);
  }
  acc.finish(out);
  return out;
}

}  // namespace binding
}  // namespace flce
