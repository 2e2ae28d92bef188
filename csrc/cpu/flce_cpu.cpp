// The fused CPU backend: the same tiled algorithm as the CUDA kernels.
//
// Logits exist only as one [BLOCK_N, BLOCK_V] fp32 tile at a time (tile GEMM through the BLAS
// torch links, csrc/cpu/tile_gemm.h); the epilogue applies bias and softcap and folds the tile into
// per-row statistics (forward) or turns it into the gradient tile (backward) with the shared math
// of csrc/include/flce/math.h. The backward recomputes the tiles.
//
// Scratch memory (docs/cpu-backend.md):
//   forward:  one logit tile                       BLOCK_N * BLOCK_V * 4 bytes
//   backward: one logit/gradient tile (+ its bf16 split for bf16 inputs),
//             the tile products [BLOCK_N, D] and [BLOCK_V, D] in fp32,
//             the local Kahan state of the inner loop's gradient block (2 * BLOCK * D fp32),
//             and the Kahan compensation (plus an fp32 sum unless the output is fp32) of the
//             outer loop's gradient, sized min(N, V) * D: the loop order puts the smaller of
//             dE [N, D] and dC [V, D] in the global accumulator.
//
// Deterministic: every sum runs in a fixed order that depends on the shapes only, and threads
// split rows or columns, never a reduction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/epilogue.h"
#include "cpu/tile_gemm.h"
#include "flce/math.h"
#include "flce_ops.h"

namespace flce {
namespace {

constexpr int64_t BLOCK_N = 256;   // rows per tile
constexpr int64_t BLOCK_V = 2048;  // vocabulary columns per tile

using cpu::GemmOperand;
using cpu::gemm_f32out;

int64_t grain(int64_t work_per_item) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, work_per_item));
}

// The operands as the tiles read them: row-major contiguous, weight in the compute dtype.
struct Operands {
  at::Tensor x;     // [N, D]
  at::Tensor w;     // [V, D], compute dtype
  at::Tensor bias;  // [V] fp32 or undefined
  at::ScalarType dtype;
  cpu::Dtype row_dtype;  // the same, for the epilogue loops
  int64_t n, v, d;
};

Operands prepare(const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  Operands o;
  o.dtype = input.scalar_type();
  o.row_dtype = o.dtype == at::kFloat      ? cpu::Dtype::f32
                : o.dtype == at::kBFloat16 ? cpu::Dtype::bf16
                                           : cpu::Dtype::f16;
  o.x = input.contiguous();
  o.w = weight.to(o.dtype).contiguous();  // fp32 master weights: one cast copy
  if (bias) o.bias = bias->to(at::kFloat).contiguous();
  o.n = input.size(0);
  o.v = weight.size(0);
  o.d = input.size(1);
  return o;
}

// logits[r, j] = x[n0 + r] . w[v0 + j] + bias[v0 + j], then softcap; tile is [bn, bv] with row
// stride BLOCK_V.
void logit_tile(const Operands& o, int64_t n0, int64_t bn, int64_t v0, int64_t bv, float cap,
                float* tile) {
  const int64_t es = o.x.element_size();
  const char* xp = static_cast<const char*>(o.x.data_ptr()) + n0 * o.d * es;
  const char* wp = static_cast<const char*>(o.w.data_ptr()) + v0 * o.d * es;
  gemm_f32out(o.dtype, bn, bv, o.d, 1.f, GemmOperand{xp, o.d, false},
              GemmOperand{wp, o.d, true}, 0.f, tile, BLOCK_V);
  const float* b = o.bias.defined() ? o.bias.data_ptr<float>() + v0 : nullptr;
  if (b == nullptr && !(cap > 0.f)) return;
  at::parallel_for(0, bn, grain(bv), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) cpu::row_bias_softcap(tile + r * BLOCK_V, b, bv, cap);
  });
}

// Row i of a row-major [rows, D] operand (input or weight in the compute dtype).
const void* operand_row(const at::Tensor& m, int64_t i) {
  return static_cast<const char*>(m.data_ptr()) + i * m.size(1) * m.element_size();
}

bool row_ignored(int64_t t, int64_t ignore_index) { return t == ignore_index; }

at::Tensor partial_stats_cpu(const at::Tensor& input, const at::Tensor& weight,
                             const at::Tensor& target, const std::optional<at::Tensor>& bias,
                             int64_t vocab_start, int64_t ignore_index, double softcap) {
  check_linear_args(input, weight, target, bias);
  const Operands o = prepare(input, weight, bias);
  const float cap = static_cast<float>(softcap);
  const at::Tensor tgt = target.contiguous();
  const int64_t* t = tgt.data_ptr<int64_t>();
  at::Tensor out = at::empty({o.n, 4}, input.options().dtype(at::kFloat));
  float* st = out.data_ptr<float>();
  if (o.n == 0) return out;
  std::vector<float> tile_buf(BLOCK_N * BLOCK_V);
  float* tile = tile_buf.data();
  // Per-row running state of the current row block.
  std::vector<OnlineLse> lse(BLOCK_N);
  std::vector<float> zt(BLOCK_N), sz(BLOCK_N), szc(BLOCK_N);

  for (int64_t n0 = 0; n0 < o.n; n0 += BLOCK_N) {
    const int64_t bn = std::min(BLOCK_N, o.n - n0);
    for (int64_t r = 0; r < bn; ++r) {
      lse[r] = lse_empty();
      zt[r] = neg_inf();
      sz[r] = 0.f;
      szc[r] = 0.f;
    }
    for (int64_t v0 = 0; v0 < o.v; v0 += BLOCK_V) {
      const int64_t bv = std::min(BLOCK_V, o.v - v0);
      logit_tile(o, n0, bn, v0, bv, cap, tile);
      at::parallel_for(0, bn, grain(bv), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          float* row = tile + r * BLOCK_V;
          const int64_t tr = t[n0 + r];
          // The target's column in this tile, or -1; it is masked out of (max, sum exp).
          const int64_t tl = row_ignored(tr, ignore_index) ? -1 : tr - vocab_start - v0;
          const bool has_t = tl >= 0 && tl < bv;
          float z_target = 0.f;
          if (has_t) {
            z_target = row[tl];
            row[tl] = neg_inf();
            zt[r] = z_target;
          }
          const float mx = cpu::row_max(row, bv);
          // An all -inf tile (only the target, or -inf logits) adds nothing: exp(-inf - -inf)
          // would be NaN.
          const float s = mx == neg_inf() ? 0.f : cpu::row_sum_exp(row, bv, mx);
          lse_add_tile(lse[r], mx, s);
          if (has_t) row[tl] = z_target;
          const float sum_z = cpu::row_sum(row, bv);
          kahan_add(sz[r], szc[r], sum_z);
        }
      });
    }
    for (int64_t r = 0; r < bn; ++r) {
      float* p = st + (n0 + r) * 4;
      p[0] = lse[r].m;
      p[1] = lse[r].s;
      p[2] = zt[r];
      p[3] = kahan_result(sz[r], szc[r]);
    }
  }
  return out;
}

Tensor3 combine_cpu(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                    int64_t ignore_index, double label_smoothing, double z_loss) {
  check_combine_args(partials, target);
  const at::Tensor p = partials.contiguous();
  const at::Tensor tgt = target.contiguous();
  const int64_t ranks = p.size(0), n = p.size(1);
  const int64_t* t = tgt.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(t[i] == ignore_index || (t[i] >= 0 && t[i] < vocab_size),
                      "flce: target[", i, "] = ", t[i], " is out of range for a vocabulary of ",
                      vocab_size, " (and is not ignore_index = ", ignore_index, ")");
  }
  auto f32 = p.options();
  at::Tensor loss = at::empty({n}, f32), lse = at::empty({n}, f32), stats = at::empty({n, 2}, f32);
  const LossOptions opt{static_cast<float>(label_smoothing), static_cast<float>(z_loss), 0.f,
                        vocab_size};
  const float* pp = p.data_ptr<float>();
  float* lo = loss.data_ptr<float>();
  float* ls = lse.data_ptr<float>();
  float* sp = stats.data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      OnlineLse st = lse_empty();
      float zt = neg_inf(), sum_z = 0.f, sum_c = 0.f;
      for (int64_t r = 0; r < ranks; ++r) {  // fixed rank order: deterministic
        const float* q = pp + (r * n + i) * 4;
        st = lse_merge(st, OnlineLse{q[0], q[1]});
        if (q[2] != neg_inf()) zt = q[2];  // only the owner has it (NaN passes through)
        kahan_add(sum_z, sum_c, q[3]);
      }
      const float lse_x = lse_value(st);
      const RowLoss rl = row_loss(lse_x, zt, kahan_result(sum_z, sum_c),
                                  row_ignored(t[i], ignore_index), opt);
      lo[i] = rl.loss;
      ls[i] = rl.lse;
      sp[2 * i] = lse_x;
      sp[2 * i + 1] = zt;
    }
  });
  return {loss, lse, stats};
}

// Gradient accumulator in fp32 with Kahan compensation: rows of `width` floats.
struct KahanAcc {
  float* sum;
  float* comp;
  int64_t width;

  void add_rows(const float* x, int64_t rows, int64_t ldx) const {
    at::parallel_for(0, rows, grain(width), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        cpu::row_kahan_add(sum + r * width, comp + r * width, x + r * ldx, width);
      }
    });
  }
  KahanAcc offset(int64_t rows) const { return {sum + rows * width, comp + rows * width, width}; }
};

// Output of one gradient: an fp32 accumulator over its whole extent, written to `out` (the
// gradient tensor, in its dtype) at the end. When `out` is fp32 it is the sum itself.
struct GradBuffer {
  at::Tensor out, sum, comp;

  GradBuffer(const at::Tensor& like, int64_t rows, int64_t width) {
    out = at::empty({rows, width}, like.options());
    sum = like.scalar_type() == at::kFloat ? out : at::empty({rows, width}, out.options().dtype(at::kFloat));
    sum.zero_();
    comp = at::zeros({rows, width}, out.options().dtype(at::kFloat));
  }
  KahanAcc acc() { return {sum.data_ptr<float>(), comp.data_ptr<float>(), sum.size(1)}; }
  void finish() {
    sum.add_(comp);
    if (!out.is_same(sum)) out.copy_(sum);
  }
};

Tensor3 backward_cpu(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                     const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, const at::Tensor& stats,
                     int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                     double label_smoothing, double z_loss, double softcap,
                     std::array<bool, 3> output_mask) {
  check_backward_args(grad_loss, grad_lse, input, weight, target, bias, stats);
  const bool need_e = output_mask[0], need_c = output_mask[1], need_b = output_mask[2] && bias;
  const Operands o = prepare(input, weight, bias);
  const float cap = static_cast<float>(softcap);
  const LossOptions opt{static_cast<float>(label_smoothing), static_cast<float>(z_loss), cap,
                        vocab_size};
  // Outer loop over row blocks when the vocabulary is the smaller side (dC is the global
  // accumulator, dE is finished block by block), else over vocab blocks.
  const bool rows_outer = o.v <= o.n;
  const int64_t n = o.n, v = o.v, d = o.d;

  std::optional<GradBuffer> ge, gc;
  std::optional<GradBuffer> gb;
  if (need_e) ge.emplace(input, rows_outer ? std::min(n, BLOCK_N) : n, d);
  if (need_c) gc.emplace(weight, rows_outer ? v : std::min(v, BLOCK_V), d);
  if (need_b) gb.emplace(*bias, 1, v);
  // The outer loop's gradient is its GradBuffer's output; the inner one is written block by block.
  at::Tensor grad_e = !need_e ? input.new_empty({0})
                      : rows_outer ? at::empty({n, d}, input.options()) : ge->out;
  at::Tensor grad_c = !need_c ? weight.new_empty({0})
                      : rows_outer ? gc->out : at::empty({v, d}, weight.options());
  if ((!need_e && !need_c && !need_b) || n == 0 || v == 0) {
    if (need_e) grad_e.zero_();
    if (need_c) grad_c.zero_();
    at::Tensor grad_b = need_b ? at::zeros_like(*bias) : weight.new_empty({0});
    return {grad_e, grad_c, grad_b};
  }

  const at::Tensor tgt = target.contiguous();
  const int64_t* t = tgt.data_ptr<int64_t>();
  const at::Tensor gl = grad_loss.contiguous();  // an expanded scalar becomes [N]: small
  const float* g = gl.data_ptr<float>();
  const at::Tensor glse_t = grad_lse ? grad_lse->contiguous() : at::Tensor();
  const float* glse = glse_t.defined() ? glse_t.data_ptr<float>() : nullptr;
  const at::Tensor st_t = stats.contiguous();
  const float* st = st_t.data_ptr<float>();

  // bf16 inputs: the fp32 gradient tile is split G = hi + lo into two bf16 tiles so that the
  // tile products run on the bf16 GEMM (AMX) at ~16 mantissa bits, far below bf16's rounding.
  // fp16 tiles would underflow small gradients, so fp16 (and fp32) multiply G in fp32 against
  // an fp32 copy of the operand tile.
  const bool split = o.dtype == at::kBFloat16;
  std::vector<float> tile_buf(BLOCK_N * BLOCK_V);
  float* tile = tile_buf.data();
  at::Tensor hi, lo;
  if (split) {
    hi = at::empty({BLOCK_N, BLOCK_V}, o.x.options());
    lo = at::empty({BLOCK_N, BLOCK_V}, o.x.options());
  }
  at::Tensor x32 = (!split && o.dtype != at::kFloat) ? o.x.to(at::kFloat) : at::Tensor();
  at::Tensor w32 = (!split && o.dtype != at::kFloat) ? o.w.to(at::kFloat) : at::Tensor();
  std::vector<float> te(need_e ? BLOCK_N * d : 0), tc(need_c ? BLOCK_V * d : 0);
  // Per tile row: the target's column in the tile (-1 if elsewhere) and its gradient.
  std::vector<int64_t> t_col(BLOCK_N);
  std::vector<float> t_grad(BLOCK_N);

  auto process = [&](int64_t n0, int64_t bn, int64_t v0, int64_t bv, KahanAcc* eacc,
                     KahanAcc* cacc, KahanAcc* bacc) {
    logit_tile(o, n0, bn, v0, bv, cap, tile);
    at::parallel_for(0, bn, grain(bv), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = n0 + r;
        const bool ign = row_ignored(t[i], ignore_index);
        const RowGrad rg = row_grad(st[2 * i], st[2 * i + 1], ign, g[i], glse ? glse[i] : 0.f, opt);
        const int64_t tl = ign ? -1 : t[i] - vocab_start - v0;
        float* row = tile + r * BLOCK_V;
        const bool has_t = tl >= 0 && tl < bv;
        const float z_target = has_t ? row[tl] : 0.f;
        cpu::row_grad_fill(row, bv, rg, cap);
        // The target column leaves the tile: its gradient (about -1 while the others are about
        // 1/V) would dominate every fp32 partial sum of the tile GEMMs, whose rounding error
        // scales with those partial sums. It is added on its own below, exactly once per row.
        t_col[r] = has_t ? tl : -1;
        t_grad[r] = has_t ? rg.dz_t * softcap_grad(z_target, cap) : 0.f;
        if (has_t) row[tl] = 0.f;
        if (split) {
          auto* h = reinterpret_cast<uint16_t*>(hi.data_ptr<at::BFloat16>()) + r * BLOCK_V;
          auto* l = reinterpret_cast<uint16_t*>(lo.data_ptr<at::BFloat16>()) + r * BLOCK_V;
          cpu::row_split_bf16(row, h, l, bv);
        }
      }
    });
    if (bacc) {
      // Column sums of the tile in row order, then one Kahan add per column; the target
      // columns' gradients are Kahan-added one by one.
      std::vector<float> colsum(bv, 0.f);
      for (int64_t r = 0; r < bn; ++r) {
        const float* row = tile + r * BLOCK_V;
        for (int64_t j = 0; j < bv; ++j) colsum[j] += row[j];
      }
      bacc->add_rows(colsum.data(), 1, bv);  // bacc points at column v0, width bv
      for (int64_t r = 0; r < bn; ++r) {
        if (t_col[r] >= 0) kahan_add(bacc->sum[t_col[r]], bacc->comp[t_col[r]], t_grad[r]);
      }
    }
    // The gradient tile's operands: (hi, lo) bf16 pair, or the fp32 tile.
    const int64_t es = o.x.element_size();
    const char* xp = static_cast<const char*>(o.x.data_ptr()) + n0 * d * es;
    const char* wp = static_cast<const char*>(o.w.data_ptr()) + v0 * d * es;
    if (need_e) {
      // dE[n0:n0+bn] += G [bn, bv] @ W[v0:v0+bv] [bv, D]
      if (split) {
        gemm_f32out(at::kBFloat16, bn, d, bv, 1.f, GemmOperand{hi.data_ptr(), BLOCK_V, false},
                    GemmOperand{wp, d, false}, 0.f, te.data(), d);
        gemm_f32out(at::kBFloat16, bn, d, bv, 1.f, GemmOperand{lo.data_ptr(), BLOCK_V, false},
                    GemmOperand{wp, d, false}, 1.f, te.data(), d);
      } else {
        const float* w = w32.defined() ? w32.data_ptr<float>() + v0 * d
                                       : reinterpret_cast<const float*>(wp);
        gemm_f32out(at::kFloat, bn, d, bv, 1.f, GemmOperand{tile, BLOCK_V, false},
                    GemmOperand{w, d, false}, 0.f, te.data(), d);
      }
      eacc->add_rows(te.data(), bn, d);
      // dE[n] += dz_t W[t]: one scaled row per row that has its target in this tile.
      at::parallel_for(0, bn, grain(d), [&](int64_t r0, int64_t r1) {
        std::vector<float> prod(d);
        for (int64_t r = r0; r < r1; ++r) {
          if (t_col[r] < 0) continue;
          cpu::row_scale(prod.data(), operand_row(o.w, v0 + t_col[r]), o.row_dtype, d, t_grad[r]);
          cpu::row_kahan_add(eacc->sum + r * d, eacc->comp + r * d, prod.data(), d);
        }
      });
    }
    if (need_c) {
      // dC[v0:v0+bv] += G^T [bv, bn] @ X[n0:n0+bn] [bn, D]
      if (split) {
        gemm_f32out(at::kBFloat16, bv, d, bn, 1.f, GemmOperand{hi.data_ptr(), BLOCK_V, true},
                    GemmOperand{xp, d, false}, 0.f, tc.data(), d);
        gemm_f32out(at::kBFloat16, bv, d, bn, 1.f, GemmOperand{lo.data_ptr(), BLOCK_V, true},
                    GemmOperand{xp, d, false}, 1.f, tc.data(), d);
      } else {
        const float* x = x32.defined() ? x32.data_ptr<float>() + n0 * d
                                       : reinterpret_cast<const float*>(xp);
        gemm_f32out(at::kFloat, bv, d, bn, 1.f, GemmOperand{tile, BLOCK_V, true},
                    GemmOperand{x, d, false}, 0.f, tc.data(), d);
      }
      cacc->add_rows(tc.data(), bv, d);
      // dC[t] += dz_t X[n], in row order: rows that share a target add to one row of dC.
      std::vector<float> prod(d);
      for (int64_t r = 0; r < bn; ++r) {
        if (t_col[r] < 0) continue;
        cpu::row_scale(prod.data(), operand_row(o.x, n0 + r), o.row_dtype, d, t_grad[r]);
        cpu::row_kahan_add(cacc->sum + t_col[r] * d, cacc->comp + t_col[r] * d, prod.data(), d);
      }
    }
  };

  std::optional<KahanAcc> bacc_all;
  if (need_b) bacc_all = gb->acc();
  auto out_rows = [](at::Tensor& dst, int64_t r0, int64_t rows, GradBuffer& buf) {
    // Finish a local block: sum + compensation, rounded once to the output dtype.
    at::Tensor s = buf.sum.narrow(0, 0, rows), c = buf.comp.narrow(0, 0, rows);
    dst.narrow(0, r0, rows).copy_(s + c);
    buf.sum.zero_();
    buf.comp.zero_();
  };

  if (rows_outer) {
    KahanAcc cacc_all = need_c ? gc->acc() : KahanAcc{};
    for (int64_t n0 = 0; n0 < n; n0 += BLOCK_N) {
      const int64_t bn = std::min(BLOCK_N, n - n0);
      KahanAcc eacc = need_e ? ge->acc() : KahanAcc{};
      for (int64_t v0 = 0; v0 < v; v0 += BLOCK_V) {
        const int64_t bv = std::min(BLOCK_V, v - v0);
        KahanAcc cacc = need_c ? cacc_all.offset(v0) : KahanAcc{};
        KahanAcc bacc = need_b ? KahanAcc{bacc_all->sum + v0, bacc_all->comp + v0, bv} : KahanAcc{};
        process(n0, bn, v0, bv, &eacc, &cacc, need_b ? &bacc : nullptr);
      }
      if (need_e) out_rows(grad_e, n0, bn, *ge);
    }
    if (need_c) gc->finish();
  } else {
    KahanAcc eacc_all = need_e ? ge->acc() : KahanAcc{};
    for (int64_t v0 = 0; v0 < v; v0 += BLOCK_V) {
      const int64_t bv = std::min(BLOCK_V, v - v0);
      KahanAcc cacc = need_c ? gc->acc() : KahanAcc{};
      KahanAcc bacc = need_b ? KahanAcc{bacc_all->sum + v0, bacc_all->comp + v0, bv} : KahanAcc{};
      for (int64_t n0 = 0; n0 < n; n0 += BLOCK_N) {
        const int64_t bn = std::min(BLOCK_N, n - n0);
        KahanAcc eacc = need_e ? eacc_all.offset(n0) : KahanAcc{};
        process(n0, bn, v0, bv, &eacc, &cacc, need_b ? &bacc : nullptr);
      }
      if (need_c) out_rows(grad_c, v0, bv, *gc);
    }
    if (need_e) ge->finish();
  }
  at::Tensor grad_b = weight.new_empty({0});
  if (need_b) {
    gb->finish();
    grad_b = gb->out.reshape({v});
  }
  return {grad_e, grad_c, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(flce, CPU, m) {
  m.impl("partial_stats", &partial_stats_cpu);
  m.impl("combine", &combine_cpu);
  m.impl("backward", &backward_cpu);
}

}  // namespace flce
