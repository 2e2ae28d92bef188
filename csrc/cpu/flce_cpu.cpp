// The fused CPU backend: the same tiled algorithm as the CUDA kernels.
//
// Logits exist only as one [BLOCK_N, block_v] fp32 tile at a time (tile GEMMs through oneDNN's
// micro-kernels or the BLAS torch links, csrc/cpu/tile_gemm.h); the epilogue applies bias and
// softcap and folds the tile into per-row statistics (forward) or turns it into the gradient tile
// (backward) with the shared math of csrc/include/flce/math.h. The backward recomputes the tiles.
//
// Scratch memory (docs/cpu-backend.md):
//   forward:  one logit tile                       BLOCK_N * ld_tile * 4 bytes
//             (+ the weight tile packed for the GEMM)
//   backward: one logit/gradient tile (+ its bf16 split for bf16 inputs), the GEMMs' packed
//             operands (the transposed weight tile; bf16: the weight tile and input rows),
//             the inner loop's gradient block: its bf16 compensation (BLOCK * D * 2 bytes; plus
//             an fp32 sum unless the gradient is fp32, which is its own sum), and the same for
//             the outer loop's gradient, sized min(N, V) * D: the loop order puts the smaller
//             of dE [N, D] and dC [V, D] in the global accumulator. The tile products are added
//             to the accumulators block by block (cpu::gemm_accumulate), never stored whole.
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
// Vocabulary columns per tile: 512 for fp32 inputs, 2048 for 16-bit ones (Operands::block_v).
// fp32's packed weight tile, tile and gradient block weigh twice as much per column, and its
// backward's peak memory is the one that competes with chunked torch's (78 MB against 80 at
// N=4096, V=32768, D=512; 2048 columns would add 6 MB). bf16 gains 5% from the wider tiles (its
// split gradient tile runs 4 GEMMs per tile, each adding into the Kahan accumulators) and has
// memory to spare (a fifth of chunked torch's with them).
constexpr int64_t BLOCK_V_F32 = 512;
constexpr int64_t BLOCK_V_16BIT = 2048;

using cpu::GemmOperand;
using cpu::gemm_f32out;
using cpu::LhsScratch;
using cpu::Rhs;

int64_t grain(int64_t work_per_item) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, work_per_item));
}

// The operands as the tiles read them: row-major contiguous, weight in the compute dtype.
struct Operands {
  at::Tensor x;     // [N, D]
  at::Tensor w;     // [V, D], compute dtype
  at::Tensor bias;  // [V] fp32 or undefined
  at::ScalarType dtype;
  cpu::Dtype row_dtype;     // the same, for the epilogue loops
  at::ScalarType w_dtype;   // the weight's own dtype (fp32 master weights), its gradient's
  int64_t n, v, d;
  int64_t block_v;  // vocabulary columns per tile
  // Row stride of the tile buffers: not a power of two. The dC GEMM reads the gradient tile
  // transposed, and a column of a 2^k-strided tile maps to a single cache set.
  int64_t ld_tile() const { return block_v + 16; }
};

Operands prepare(const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  Operands o;
  o.dtype = input.scalar_type();
  o.row_dtype = o.dtype == at::kFloat      ? cpu::Dtype::f32
                : o.dtype == at::kBFloat16 ? cpu::Dtype::bf16
                                           : cpu::Dtype::f16;
  o.w_dtype = weight.scalar_type();
  o.x = input.contiguous();
  o.w = weight.to(o.dtype).contiguous();  // fp32 master weights: one cast copy
  if (bias) o.bias = bias->to(at::kFloat).contiguous();
  o.n = input.size(0);
  o.v = weight.size(0);
  o.d = input.size(1);
  o.block_v = o.dtype == at::kFloat ? BLOCK_V_F32 : BLOCK_V_16BIT;
  return o;
}

// The scratch of the logit tiles: the weight tile W[v0:v0+bv]^T as the GEMM reads it (packed
// once per vocab tile on the onednn path) and copies of the input rows where it needs them.
struct LogitScratch {
  Rhs wt;
  LhsScratch lhs;
};

// logits[r, j] = x[n0 + r] . w[v0 + j] + bias[v0 + j], then softcap; tile is [bn, bv] with row
// stride ld.
void logit_tile(const Operands& o, int64_t n0, int64_t bn, int64_t v0, int64_t bv, float cap,
                float* tile, int64_t ld, LogitScratch& scratch) {
  const int64_t es = o.x.element_size();
  const char* xp = static_cast<const char*>(o.x.data_ptr()) + n0 * o.d * es;
  const char* wp = static_cast<const char*>(o.w.data_ptr()) + v0 * o.d * es;
  scratch.wt.prepare(o.dtype, GemmOperand{wp, o.d, true}, o.d, bv);
  gemm_f32out(o.dtype, bn, bv, o.d, GemmOperand{xp, o.d, false}, scratch.wt, false, tile, ld,
              scratch.lhs);
  const float* b = o.bias.defined() ? o.bias.data_ptr<float>() + v0 : nullptr;
  if (b == nullptr && !(cap > 0.f)) return;
  at::parallel_for(0, bn, grain(bv), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) cpu::row_bias_softcap(tile + r * ld, b, bv, cap);
  });
}

// Row i of a row-major [rows, D] operand (input or weight in the compute dtype).
const void* operand_row(const at::Tensor& m, int64_t i) {
  return static_cast<const char*>(m.data_ptr()) + i * m.size(1) * m.element_size();
}

bool row_ignored(int64_t t, int64_t ignore_index) { return t == ignore_index; }

// A row's running statistics over the tiles of a shard.
struct RowState {
  OnlineLse lse = lse_empty();  // over non-target logits
  float z_t = neg_inf();        // target logit, where this shard holds it
  float sum_z = 0.f, sum_c = 0.f;  // Kahan sum of all logits (label smoothing)
  float sum() const { return kahan_result(sum_z, sum_c); }
};

// Fold one tile row (bv logits; the target at column tl, or tl outside [0, bv)) into st.
void fold_row(float* row, int64_t bv, int64_t tl, RowState& st) {
  const bool has_t = tl >= 0 && tl < bv;
  float z_target = 0.f;
  if (has_t) {  // masked out of (max, sum exp) in place, then restored
    z_target = row[tl];
    row[tl] = neg_inf();
    st.z_t = z_target;
  }
  const float mx = cpu::row_max(row, bv);
  // An all -inf tile (only the target, or -inf logits) adds nothing: exp(-inf - -inf) is NaN.
  const float s = mx == neg_inf() ? 0.f : cpu::row_sum_exp(row, bv, mx);
  lse_add_tile(st.lse, mx, s);
  if (has_t) row[tl] = z_target;
  kahan_add(st.sum_z, st.sum_c, cpu::row_sum(row, bv));
}

// The target's column in the shard, or -1 for an ignored row.
int64_t shard_col(int64_t t, int64_t vocab_start, int64_t ignore_index) {
  return row_ignored(t, ignore_index) ? -1 : t - vocab_start;
}

void check_targets(const int64_t* t, int64_t n, int64_t vocab_size, int64_t ignore_index) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(t[i] == ignore_index || (t[i] >= 0 && t[i] < vocab_size),
                      "flce: target[", i, "] = ", t[i], " is out of range for a vocabulary of ",
                      vocab_size, " (and is not ignore_index = ", ignore_index, ")");
  }
}

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
  std::vector<float> tile(BLOCK_N * o.ld_tile());
  // Vocab tiles outer: each weight tile is prepared for the GEMM once; every row folds the
  // tiles in vocabulary order all the same.
  std::vector<RowState> rows(o.n);
  LogitScratch scratch;
  for (int64_t v0 = 0; v0 < o.v; v0 += o.block_v) {
    const int64_t bv = std::min(o.block_v, o.v - v0);
    for (int64_t n0 = 0; n0 < o.n; n0 += BLOCK_N) {
      const int64_t bn = std::min(BLOCK_N, o.n - n0);
      logit_tile(o, n0, bn, v0, bv, cap, tile.data(), o.ld_tile(), scratch);
      at::parallel_for(0, bn, grain(bv), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t tl = shard_col(t[n0 + r], vocab_start, ignore_index);
          fold_row(tile.data() + r * o.ld_tile(), bv, tl < 0 ? -1 : tl - v0, rows[n0 + r]);
        }
      });
    }
  }
  for (int64_t i = 0; i < o.n; ++i) {
    float* p = st + i * 4;
    p[0] = rows[i].lse.m;
    p[1] = rows[i].lse.s;
    p[2] = rows[i].z_t;
    p[3] = rows[i].sum();
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
  check_targets(t, n, vocab_size, ignore_index);
  auto f32 = p.options();
  at::Tensor loss = at::empty({n}, f32), lse = at::empty({n}, f32), stats = at::empty({n, 3}, f32);
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
      sp[3 * i] = st.m;  // (m_x, s_x, z_t): the backward's p_j = exp(z_j - M) / S
      sp[3 * i + 1] = st.s;
      sp[3 * i + 2] = zt;
    }
  });
  return {loss, lse, stats};
}

// Gradient accumulator rows of `width` floats: fp32 sums and their compensations, stored as
// bf16 (kahan_add_bf16c: the accumulators are the backward's largest scratch, and the
// renormalized bf16 compensation keeps each add within 2^-9 ulp of exact).
struct KahanAcc {
  float* sum = nullptr;
  uint16_t* comp = nullptr;
  int64_t width = 0;

  void add_row(int64_t r, const float* x) const {
    cpu::row_kahan_add(sum + r * width, comp + r * width, x, width);
  }
  void add(int64_t r, int64_t j, float x) const {
    kahan_add_bf16c(sum[r * width + j], comp[r * width + j], x);
  }
};

// One gradient [total, width]: its compensated fp32 accumulator, either over the whole extent
// (global) or over one block of rows that flush() writes out (local). An fp32 gradient is its
// own sum (no copy); otherwise the result is rounded once to the gradient's dtype, or, deferred,
// kept as the fp32 (sum, compensation) pair [2, total, width] for a later scale_grad.
struct GradBuffer {
  at::Tensor out;   // [total, width] in the gradient's dtype, or the pair [2, total, width]
  at::Tensor sum;   // fp32: [total, width] where it is the result (or out[0]), else [rows, width]
  at::Tensor comp;  // bf16 bit patterns: [total, width] (global) or [rows, width] (local)
  bool global, deferred, sum_in_out;

  // global: the accumulator spans all `total` rows; else it holds one block of `rows`.
  GradBuffer(at::ScalarType dtype, const at::TensorOptions& opts, int64_t total, int64_t rows,
             int64_t width, bool global_, bool deferred_)
      : global(global_), deferred(deferred_) {
    const auto f32 = opts.dtype(at::kFloat);
    out = deferred ? at::empty({2, total, width}, f32)
                   : at::empty({total, width}, opts.dtype(dtype));
    sum_in_out = deferred ? global : dtype == at::kFloat;
    sum = !sum_in_out ? at::empty({rows, width}, f32) : deferred ? out[0] : out;
    comp = at::empty({global ? total : rows, width}, opts.dtype(at::kBFloat16));
    sum.zero_();
    comp.zero_();
  }
  // The accumulator from gradient row r0 on (a local block starts at r0).
  KahanAcc acc(int64_t r0) {
    const int64_t w = comp.size(1);
    return {sum.data_ptr<float>() + (global || sum_in_out ? r0 : 0) * w,
            reinterpret_cast<uint16_t*>(comp.data_ptr()) + (global ? r0 : 0) * w, w};
  }
  // Local block -> rows [r0, r0 + rows) of the result; the accumulator starts over.
  void flush(int64_t r0, int64_t rows) {
    if (deferred) {
      out[0].narrow(0, r0, rows).copy_(sum.narrow(0, 0, rows));
      out[1].narrow(0, r0, rows).copy_(comp.narrow(0, 0, rows));
    } else {
      at::Tensor s = sum_in_out ? out.narrow(0, r0, rows) : sum.narrow(0, 0, rows);
      fold_comp(s);
      if (!sum_in_out) out.narrow(0, r0, rows).copy_(s);
    }
    if (!sum_in_out) sum.zero_();
    comp.zero_();
  }
  // Global accumulator -> result.
  void finish() {
    if (deferred) {
      out[1].copy_(comp);
      return;
    }
    fold_comp(sum);
    if (!sum_in_out) out.copy_(sum);
  }

  // s [rows, width] += the first rows of comp, in place (at::add_ would first make an fp32 copy
  // of the bf16 compensation).
  void fold_comp(const at::Tensor& s) {
    const int64_t w = comp.size(1);
    float* sp = s.data_ptr<float>();
    const uint16_t* cp = reinterpret_cast<const uint16_t*>(comp.data_ptr());
    at::parallel_for(0, s.size(0), std::max<int64_t>(1, 16384 / std::max<int64_t>(w, 1)),
                     [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) cpu::row_add_bf16(sp + r * w, cp + r * w, w);
    });
  }
};

// The backward's tile loop state: gradient buffers, the tile's bf16 split, per-row target data.
// Callers put logits in a tile, then call tile(); the loop order decides which gradient is global.
class GradPass {
 public:
  GradPass(const Operands& o, const std::optional<at::Tensor>& bias, std::array<bool, 3> mask,
           bool rows_outer, int64_t block_n, float cap, bool deferred)
      : o_(o), rows_outer_(rows_outer), cap_(cap),
        need_e_(mask[0]), need_c_(mask[1]), need_b_(mask[2] && bias.has_value()),
        split_(o.dtype == at::kBFloat16) {
    const auto opts = o.x.options();
    const int64_t n = o.n, v = o.v, d = o.d;
    if (need_e_) {
      ge_.emplace(o.dtype, opts, n, rows_outer ? std::min(n, block_n) : n, d, !rows_outer,
                  deferred);
    }
    if (need_c_) {
      gc_.emplace(o.w_dtype, opts, v, rows_outer ? v : std::min(v, o.block_v), d, rows_outer,
                  deferred);
    }
    if (need_b_) gb_.emplace(bias->scalar_type(), opts, 1, 1, v, true, deferred);
    // bf16 inputs: the fp32 gradient tile is split G = hi + lo into two bf16 tiles so that the
    // tile products run on the bf16 GEMM (AMX) at ~16 mantissa bits, far below bf16's rounding.
    // fp16 tiles would underflow small gradients, so fp16 (and fp32) multiply G in fp32 against
    // fp32 operands.
    if (split_) {
      hi_.resize(block_n * o.ld_tile());
      lo_.resize(block_n * o.ld_tile());
    } else if (o.dtype != at::kFloat) {
      x32_ = o.x.to(at::kFloat);
      w32_ = o.w.to(at::kFloat);
    }
    t_col_.resize(block_n);
    t_grad_.resize(block_n);
    row_max_.resize(block_n);
  }

  bool needs_any() const { return need_e_ || need_c_ || need_b_; }

  // The tile [bn, bv] (row stride ld) holds the logits of rows [n0, n0 + bn) and shard columns
  // [v0, v0 + bv); rg[r] are the rows' gradient coefficients and t_shard[r] each row's target
  // column in the shard (-1: ignored). Turns the tile into the gradient and accumulates it.
  void tile(int64_t n0, int64_t bn, int64_t v0, int64_t bv, float* tile, int64_t ld,
            const RowGrad* rg, const int64_t* t_shard) {
    const int64_t d = o_.d;
    at::parallel_for(0, bn, grain(bv), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* row = tile + r * ld;
        const int64_t tl = t_shard[r] - v0;
        const bool has_t = t_shard[r] >= 0 && tl >= 0 && tl < bv;
        const float z_target = has_t ? row[tl] : 0.f;
        cpu::row_grad_fill(row, bv, rg[r], cap_);
        // The target column leaves the tile: its gradient (about -1 while the others are about
        // 1/V) would dominate every fp32 partial sum of the tile GEMMs, whose rounding error
        // scales with those partial sums. It is added on its own below, exactly once per row.
        t_col_[r] = has_t ? tl : -1;
        t_grad_[r] = has_t ? rg[r].dz_t * softcap_grad(z_target, cap_) : 0.f;
        if (has_t) row[tl] = 0.f;
        if (split_) row_max_[r] = cpu::row_absmax(row, bv);
      }
    });
    // bf16 GEMMs (AMX) flush subnormal operands to zero, and far from the decision boundary
    // (margins ~80) a row's gradients are ~1e-35 with most of its columns below FLT_MIN: the
    // split tile is scaled by a power of two that puts its largest entry near 1, and the GEMMs
    // take the inverse as alpha (both exact).
    float alpha = 1.f;
    if (split_) {
      float mx = 0.f;
      for (int64_t r = 0; r < bn; ++r) mx = std::max(mx, row_max_[r]);
      const int k = (mx > 0.f && std::isfinite(mx)) ? std::clamp(-std::ilogb(mx), -126, 126) : 0;
      const float scale = std::ldexp(1.f, k);
      alpha = std::ldexp(1.f, -k);
      at::parallel_for(0, bn, grain(bv), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t off = r * o_.ld_tile();
          cpu::row_split_bf16(tile + r * ld, &hi_[off], &lo_[off], bv, scale);
        }
      });
    }
    if (need_b_) {
      // Column sums in row order, one Kahan add per column, then the target columns one by one.
      const KahanAcc all = gb_->acc(0);  // one row of V columns
      const KahanAcc bacc{all.sum + v0, all.comp + v0, bv};
      std::vector<float> colsum(bv, 0.f);
      for (int64_t r = 0; r < bn; ++r) {
        const float* row = tile + r * ld;
        for (int64_t j = 0; j < bv; ++j) colsum[j] += row[j];
      }
      bacc.add_row(0, colsum.data());
      for (int64_t r = 0; r < bn; ++r) {
        if (t_col_[r] >= 0) bacc.add(0, t_col_[r], t_grad_[r]);
      }
    }
    const int64_t es = o_.x.element_size();
    const char* xp = static_cast<const char*>(o_.x.data_ptr()) + n0 * d * es;
    const char* wp = static_cast<const char*>(o_.w.data_ptr()) + v0 * d * es;
    // The tile products go straight into the Kahan accumulators; the split tile's are scaled
    // back by alpha (a power of two: exact).
    const int64_t ls = o_.ld_tile();
    const GemmOperand split_rows[2] = {{hi_.data(), ls, false}, {lo_.data(), ls, false}};
    const GemmOperand split_cols[2] = {{hi_.data(), ls, true}, {lo_.data(), ls, true}};
    if (need_e_) {
      // dE[n0:n0+bn] += G [bn, bv] @ W[v0:v0+bv] [bv, D]
      const KahanAcc eacc = ge_->acc(n0);
      const cpu::KahanOut eout{eacc.sum, eacc.comp, d};
      if (split_) {
        w_rhs_.prepare(at::kBFloat16, GemmOperand{wp, d, false}, bv, d);
        cpu::gemm_accumulate(at::kBFloat16, bn, d, bv, split_rows, 2, w_rhs_, alpha, eout, lhs_);
      } else {
        const void* w = w32_.defined() ? static_cast<const void*>(w32_.data_ptr<float>() + v0 * d) : wp;
        const GemmOperand g{tile, ld, false};
        w_rhs_.prepare(at::kFloat, GemmOperand{w, d, false}, bv, d);
        cpu::gemm_accumulate(at::kFloat, bn, d, bv, &g, 1, w_rhs_, 1.f, eout, lhs_);
      }
      // dE[n] += dz_t W[t]: one scaled row per row that has its target in this tile.
      at::parallel_for(0, bn, grain(d), [&](int64_t r0, int64_t r1) {
        std::vector<float> prod(d);
        for (int64_t r = r0; r < r1; ++r) {
          if (t_col_[r] < 0) continue;
          cpu::row_scale(prod.data(), operand_row(o_.w, v0 + t_col_[r]), o_.row_dtype, d,
                         t_grad_[r]);
          eacc.add_row(r, prod.data());
        }
      });
    }
    if (need_c_) {
      // dC[v0:v0+bv] += G^T [bv, bn] @ X[n0:n0+bn] [bn, D]
      const KahanAcc cacc = gc_->acc(v0);
      const cpu::KahanOut cout{cacc.sum, cacc.comp, d};
      if (split_) {
        x_rhs_.prepare(at::kBFloat16, GemmOperand{xp, d, false}, bn, d);
        cpu::gemm_accumulate(at::kBFloat16, bv, d, bn, split_cols, 2, x_rhs_, alpha, cout, lhs_);
      } else {
        const void* x = x32_.defined() ? static_cast<const void*>(x32_.data_ptr<float>() + n0 * d) : xp;
        const GemmOperand gt{tile, ld, true};
        x_rhs_.prepare(at::kFloat, GemmOperand{x, d, false}, bn, d);
        cpu::gemm_accumulate(at::kFloat, bv, d, bn, &gt, 1, x_rhs_, 1.f, cout, lhs_);
      }
      // dC[t] += dz_t X[n], in row order: rows that share a target add to one row of dC.
      std::vector<float> prod(d);
      for (int64_t r = 0; r < bn; ++r) {
        if (t_col_[r] < 0) continue;
        cpu::row_scale(prod.data(), operand_row(o_.x, n0 + r), o_.row_dtype, d, t_grad_[r]);
        cacc.add_row(t_col_[r], prod.data());
      }
    }
  }

  // End of an outer-loop block: the inner gradient's local block is complete.
  void end_row_block(int64_t n0, int64_t bn) {
    if (rows_outer_ && need_e_) ge_->flush(n0, bn);
  }
  void end_vocab_block(int64_t v0, int64_t bv) {
    if (!rows_outer_ && need_c_) gc_->flush(v0, bv);
  }

  Tensor3 finish() {
    // Distinct empty tensors: outputs must not alias.
    at::Tensor e = o_.x.new_empty({0}), c = o_.x.new_empty({0}), b = o_.x.new_empty({0});
    if (need_e_) {
      if (!rows_outer_) ge_->finish();
      e = ge_->out;
    }
    if (need_c_) {
      if (rows_outer_) gc_->finish();
      c = gc_->out;
    }
    if (need_b_) {
      gb_->finish();
      b = gb_->deferred ? gb_->out.reshape({2, o_.v}) : gb_->out.reshape({o_.v});
    }
    return {e, c, b};
  }

 private:
  const Operands& o_;
  bool rows_outer_;
  float cap_;
  bool need_e_, need_c_, need_b_, split_;
  std::optional<GradBuffer> ge_, gc_, gb_;
  std::vector<uint16_t> hi_, lo_;
  at::Tensor x32_, w32_;
  Rhs w_rhs_, x_rhs_;  // the tile GEMMs' right operands: W tile (dE), input rows (dC)
  LhsScratch lhs_;
  std::vector<int64_t> t_col_;
  std::vector<float> t_grad_;
  std::vector<float> row_max_;  // per tile row: max |gradient| (bf16 split scale)
};


// The backward over the shard's tiles, recomputing each logit tile.
Tensor3 run_backward(const Operands& o, const std::optional<at::Tensor>& bias, const int64_t* t,
                     const float* g, const float* glse, const float* st, int64_t vocab_start,
                     int64_t ignore_index, const LossOptions& opt, std::array<bool, 3> mask,
                     bool deferred) {
  // Outer loop over row blocks when the vocabulary is the smaller side (dC is the global
  // accumulator, dE is finished block by block), else over vocab blocks.
  const bool rows_outer = o.v <= o.n;
  GradPass pass(o, bias, mask, rows_outer, BLOCK_N, opt.softcap, deferred);
  if (!pass.needs_any()) return pass.finish();
  std::vector<float> tile(BLOCK_N * o.ld_tile());
  std::vector<RowGrad> rg(BLOCK_N);
  std::vector<int64_t> ts(BLOCK_N);
  LogitScratch scratch;
  auto row_block = [&](int64_t n0, int64_t bn) {
    for (int64_t r = 0; r < bn; ++r) {
      const int64_t i = n0 + r;
      const bool ign = row_ignored(t[i], ignore_index);
      rg[r] = row_grad(OnlineLse{st[3 * i], st[3 * i + 1]}, st[3 * i + 2], ign, g[i],
                       glse ? glse[i] : 0.f, opt);
      ts[r] = shard_col(t[i], vocab_start, ignore_index);
    }
  };
  auto one_tile = [&](int64_t n0, int64_t bn, int64_t v0, int64_t bv) {
    logit_tile(o, n0, bn, v0, bv, opt.softcap, tile.data(), o.ld_tile(), scratch);
    pass.tile(n0, bn, v0, bv, tile.data(), o.ld_tile(), rg.data(), ts.data());
  };
  if (rows_outer) {
    for (int64_t n0 = 0; n0 < o.n; n0 += BLOCK_N) {
      const int64_t bn = std::min(BLOCK_N, o.n - n0);
      row_block(n0, bn);
      for (int64_t v0 = 0; v0 < o.v; v0 += o.block_v) {
        one_tile(n0, bn, v0, std::min(o.block_v, o.v - v0));
      }
      pass.end_row_block(n0, bn);
    }
  } else {
    for (int64_t v0 = 0; v0 < o.v; v0 += o.block_v) {
      const int64_t bv = std::min(o.block_v, o.v - v0);
      for (int64_t n0 = 0; n0 < o.n; n0 += BLOCK_N) {
        const int64_t bn = std::min(BLOCK_N, o.n - n0);
        row_block(n0, bn);
        one_tile(n0, bn, v0, bv);
      }
      pass.end_vocab_block(v0, bv);
    }
  }
  return pass.finish();
}

LossOptions loss_options(double label_smoothing, double z_loss, double softcap,
                         int64_t vocab_size) {
  return LossOptions{static_cast<float>(label_smoothing), static_cast<float>(z_loss),
                     static_cast<float>(softcap), vocab_size};
}

Tensor3 backward_cpu(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                     const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, const at::Tensor& stats,
                     int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                     double label_smoothing, double z_loss, double softcap,
                     std::array<bool, 3> output_mask) {
  check_backward_args(grad_loss, grad_lse, input, weight, target, bias, stats);
  const Operands o = prepare(input, weight, bias);
  const at::Tensor tgt = target.contiguous();
  const at::Tensor gl = grad_loss.contiguous();  // an expanded scalar becomes [N]: small
  const at::Tensor glse = grad_lse ? grad_lse->contiguous() : at::Tensor();
  const at::Tensor st = stats.contiguous();
  return run_backward(o, bias, tgt.data_ptr<int64_t>(), gl.data_ptr<float>(),
                      glse.defined() ? glse.data_ptr<float>() : nullptr, st.data_ptr<float>(),
                      vocab_start, ignore_index,
                      loss_options(label_smoothing, z_loss, softcap, vocab_size), output_mask,
                      /*deferred=*/false);
}

// Rows per block of the fused forward+backward: a row block keeps its logits for the whole
// vocabulary, [rows, V] fp32 with rows fused_row_stride(V) apart, within kFusedWorkspaceBytes;
// 0 when not even 16 rows fit.
constexpr int64_t kFusedWorkspaceBytes = int64_t(64) << 20;

// A multiple of 16 floats plus 16: not a power of two, as ld_tile().
int64_t fused_row_stride(int64_t v) { return (v + 15) / 16 * 16 + 16; }

int64_t fused_block_rows(int64_t v) {
  const int64_t rows = std::min<int64_t>(BLOCK_N, kFusedWorkspaceBytes / (4 * fused_row_stride(v)));
  return rows >= 16 ? rows / 16 * 16 : 0;
}

// Loss sum and the gradients of that sum, in one pass: each row block's logits are computed
// once, folded into the row statistics, then turned into the gradient tile (3 GEMMs instead of
// the 4 of forward + recompute backward). Gradients come back deferred, as fp32
// (sum, compensation) pairs [2, ...] for scale_grad to scale by the upstream gradient and
// round once.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sum_and_grad_cpu(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
    double z_loss, double softcap, std::array<bool, 3> output_mask, bool mean,
    int64_t vocab_start, int64_t vocab_size, const std::optional<std::string>& group_name,
    int64_t group_size) {
  check_linear_args(input, weight, target, bias);
  TORCH_CHECK_VALUE(!group_name && vocab_start == 0 && (vocab_size < 0 || vocab_size ==
                                                        weight.size(0)),
                    "flce: the CPU backend's single pass is single-device; vocab-parallel CPU "
                    "training takes the recompute path (single_pass=False)");
  const Operands o = prepare(input, weight, bias);
  const at::Tensor tgt = target.contiguous();
  const int64_t* t = tgt.data_ptr<int64_t>();
  check_targets(t, o.n, o.v, ignore_index);
  const LossOptions opt = loss_options(label_smoothing, z_loss, softcap, o.v);
  at::Tensor loss_sum = at::empty({}, input.options().dtype(at::kFloat));
  int64_t count = 0;
  for (int64_t i = 0; i < o.n; ++i) count += !row_ignored(t[i], ignore_index);
  // mean: divided in double, rounded once (0/0 = NaN, as torch).
  const double divisor = mean ? static_cast<double>(count) : 1.0;
  auto reduced = [&](double sum) {
    loss_sum.fill_(static_cast<float>(sum / divisor));
    return loss_sum;
  };
  at::Tensor div = at::full({}, divisor, input.options().dtype(at::kDouble));
  const int64_t bn_f = fused_block_rows(o.v);
  if (bn_f == 0) {
    // The vocabulary is too large to keep a row block's logits: forward, then the recompute
    // backward of the sum (upstream gradient 1 per row).
    const at::Tensor partial = partial_stats_cpu(input, weight, target, bias, 0, ignore_index, softcap);
    auto [loss, lse, stats] = combine_cpu(partial.unsqueeze(0), target, o.v, ignore_index,
                                          label_smoothing, z_loss);
    const double total = loss.to(at::kDouble).sum().item<double>();
    const at::Tensor ones = at::ones({o.n}, loss.options());
    auto [e, c, b] = run_backward(o, bias, t, ones.data_ptr<float>(), nullptr,
                                  stats.contiguous().data_ptr<float>(), 0, ignore_index, opt,
                                  output_mask, /*deferred=*/true);
    return {reduced(total), div, e, c, b};
  }
  GradPass pass(o, bias, output_mask, /*rows_outer=*/true, bn_f, opt.softcap, /*deferred=*/true);
  // [bn_f, V]: the row block's logits
  const int64_t ld_z = fused_row_stride(o.v);
  std::vector<float> z(bn_f * ld_z);
  LogitScratch scratch;
  std::vector<RowState> rows(bn_f);
  std::vector<RowGrad> rg(bn_f);
  std::vector<int64_t> ts(bn_f);
  float ls = 0.f, lc = 0.f;
  for (int64_t n0 = 0; n0 < o.n; n0 += bn_f) {
    const int64_t bn = std::min(bn_f, o.n - n0);
    std::fill(rows.begin(), rows.end(), RowState{});
    for (int64_t r = 0; r < bn; ++r) ts[r] = shard_col(t[n0 + r], 0, ignore_index);
    for (int64_t v0 = 0; v0 < o.v; v0 += o.block_v) {
      const int64_t bv = std::min(o.block_v, o.v - v0);
      logit_tile(o, n0, bn, v0, bv, opt.softcap, z.data() + v0, ld_z, scratch);
      at::parallel_for(0, bn, grain(bv), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          fold_row(z.data() + r * ld_z + v0, bv, ts[r] < 0 ? -1 : ts[r] - v0, rows[r]);
        }
      });
    }
    for (int64_t r = 0; r < bn; ++r) {  // as combine_cpu with one shard: the same loss bits
      const bool ign = ts[r] < 0;
      const float lse_x = lse_value(rows[r].lse);
      kahan_add(ls, lc, row_loss(lse_x, rows[r].z_t, rows[r].sum(), ign, opt).loss);
      rg[r] = row_grad(rows[r].lse, rows[r].z_t, ign, 1.f, 0.f, opt);
    }
    if (pass.needs_any()) {
      for (int64_t v0 = 0; v0 < o.v; v0 += o.block_v) {
        pass.tile(n0, bn, v0, std::min(o.block_v, o.v - v0), z.data() + v0, ld_z, rg.data(),
                  ts.data());
      }
      pass.end_row_block(n0, bn);
    }
  }
  auto [e, c, b] = pass.finish();
  return {reduced(static_cast<double>(ls) + static_cast<double>(lc)), div, e, c, b};
}

// grad = dtype((sum + comp) * scale) from a deferred pair [2, ...], in double, rounded once.
at::Tensor scale_grad_cpu(const at::Tensor& pair, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(pair.dim() >= 1 && pair.size(0) == 2 && pair.scalar_type() == at::kFloat,
                    "flce: scale_grad needs a float32 [2, ...] pair, got ", pair.sizes());
  const at::Tensor p = pair.contiguous();
  const double k = scale.to(at::kDouble).item<double>();
  at::Tensor out = at::empty(p[0].sizes(), p.options().dtype(dtype));
  const int64_t n = p[0].numel();
  const float* s = p.data_ptr<float>();
  const float* c = s + n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "flce_scale_grad", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        o[i] = static_cast<scalar_t>((static_cast<double>(s[i]) + static_cast<double>(c[i])) * k);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flce, CPU, m) {
  m.impl("partial_stats", &partial_stats_cpu);
  m.impl("combine", &combine_cpu);
  m.impl("backward", &backward_cpu);
  m.impl("sum_and_grad", &sum_and_grad_cpu);
  m.impl("scale_grad", &scale_grad_cpu);
}

}  // namespace flce
