// The fused CPU backend: the same tiled algorithm as the CUDA kernels.
//
// Logits exist only as [rows, block_v] fp32 tiles (BLOCK_N rows; BLOCK_N_WIDE in a 16-bit
// backward), one per worker at a time, or a row block's in the single pass (tile GEMMs
// through oneDNN's micro-kernels or the BLAS torch links, csrc/cpu/tile_gemm.h); the epilogue
// applies bias and softcap and folds the tile into per-row statistics (forward) or turns it into
// the gradient tile (backward) with the shared math of csrc/include/flce/math.h. The backward
// recomputes the tiles.
//
// Parallelism (cpu/workers.h): each op phase is one parallel region of workers that own a
// contiguous range of rows or vocabulary columns and run their tiles single-threaded. The
// forward splits rows. The backward splits the smaller of the two axes (rows when N < V), whose
// gradient each worker then accumulates alone over the whole pass; the other axis is walked in
// blocks by every worker, each filling a partial of that block's gradient, and the partials are
// added in worker order between two barriers at the end of the block.
//
// Scratch memory (docs/cpu-backend.md), T workers:
//   forward:  T logit tiles                          BLOCK_N * ld_tile * 4 bytes each
//             (+ the weight tile packed for the GEMM, per worker)
//   backward: per worker a logit/gradient tile (+ its bf16 split for bf16 inputs) and the
//             GEMMs' packed operands; the split axis's gradient: its bf16 compensation (plus
//             an fp32 sum unless the gradient is fp32, which is its own sum), the size of that
//             gradient; the other axis's block: T partials of [block, D] (fp32 sum + bf16
//             compensation; worker 0's sum is the gradient itself where that is fp32).
//
// Deterministic: every sum runs in a fixed order that depends on the shapes and the worker count
// only, never on scheduling: workers own fixed ranges, and partials are added in worker order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <vector>

#include "cpu/epilogue.h"
#include "cpu/rows.h"
#include "cpu/scratch.h"
#include "cpu/single_pass.h"
#include "cpu/tile_gemm.h"
#include "cpu/workers.h"
#include "flce/math.h"
#include "flce_ops.h"

namespace flce {
namespace {

constexpr int64_t BLOCK_N = 256;   // rows per tile
// Rows per tile of the recompute backward for 16-bit inputs: each tile adds its dC product
// into the Kahan accumulators of its vocabulary block (the first one stores it), less often
// with taller tiles; 1024 rows were the fastest measured, with AMX and without, and 2048 slower
// (docs/cpu-backend.md, "Tiles and GEMMs"). 34 MiB of tiles on 2 workers, where bf16 is far
// below chunked torch's memory; fp32, at chunked torch's, keeps 256.
constexpr int64_t BLOCK_N_WIDE = 1024;
// Vocabulary columns per tile: 256 for fp32 inputs, 2048 for 16-bit ones (Operands::block_v).
// fp32's backward is the one whose peak memory competes with chunked torch's, and each worker
// holds a tile, a packed weight tile (onednn) or product tile (blas) and a partial of the dC
// block, all proportional to the tile's columns: 256 keeps the peak below chunked torch's at
// about the time of 512. bf16 gains from wide tiles (its split gradient tile runs 4 GEMMs per
// tile, each adding into the Kahan accumulators) and has memory to spare (about a quarter of
// chunked torch's). The single pass takes wide tiles for every dtype: its logits are held per
// row block anyway, and each tile adds its dE product into the Kahan accumulators once. The
// measurements: docs/cpu-backend.md, "Tiles and GEMMs" (the single pass's: "Forward + backward
// in one pass").
constexpr int64_t BLOCK_V_F32 = 256;
using cpu::BLOCK_V_WIDE;  // cpu/single_pass.h
// Worker ranges and tiles start at multiples of ALIGN rows / columns.
constexpr int64_t ALIGN = 16;

using cpu::check_targets;
using cpu::combine_cpu;
using cpu::fold_row;
using cpu::GemmOperand;
using cpu::gemm_f32out;
using cpu::LhsScratch;
using cpu::Rhs;
using cpu::row_ignored;
using cpu::RowState;
using cpu::shard_col;
using cpu::Span;
using cpu::Tiles;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
  // Row stride of the tile buffers: not a power of two (cpu::TILE_PAD says why).
  int64_t ld_tile() const { return block_v + cpu::TILE_PAD; }
  // The vocabulary tiles of [v0, v1): block_v columns each, about evenly cut.
  Tiles vocab_tiles(Span cols) const { return Tiles(cols, block_v, ALIGN); }
};

cpu::Dtype row_dtype(at::ScalarType t) {
  return t == at::kFloat ? cpu::Dtype::f32 : t == at::kBFloat16 ? cpu::Dtype::bf16 : cpu::Dtype::f16;
}

// wide: BLOCK_V_WIDE columns per tile whatever the dtype (the single pass).
Operands prepare(const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, bool wide = false) {
  Operands o;
  o.dtype = input.scalar_type();
  o.row_dtype = row_dtype(o.dtype);
  o.w_dtype = weight.scalar_type();
  o.x = input.contiguous();
  o.w = weight.to(o.dtype).contiguous();  // fp32 master weights: one cast copy
  if (bias) o.bias = bias->to(at::kFloat).contiguous();
  o.n = input.size(0);
  o.v = weight.size(0);
  o.d = input.size(1);
  o.block_v = o.dtype == at::kFloat && !wide ? BLOCK_V_F32 : BLOCK_V_WIDE;
  return o;
}

// logits[r, j] = x[n0 + r] . w[v0 + j] + bias[v0 + j], then softcap and temperature; tile is
// [bn, bv] with row stride ld. wt: the weight tile W[v0:v0+bv]^T as the GEMM reads it (packed
// on the onednn path, when wt does not hold it yet); lhs: the worker's GEMM scratch.
void logit_tile(const Operands& o, int64_t n0, int64_t bn, int64_t v0, int64_t bv, float cap,
                float temp, float* tile, int64_t ld, Rhs& wt, LhsScratch& lhs) {
  const int64_t es = o.x.element_size();
  const char* xp = static_cast<const char*>(o.x.data_ptr()) + n0 * o.d * es;
  const char* wp = static_cast<const char*>(o.w.data_ptr()) + v0 * o.d * es;
  wt.prepare(o.dtype, GemmOperand{wp, o.d, true}, o.d, bv);
  gemm_f32out(o.dtype, bn, bv, o.d, GemmOperand{xp, o.d, false}, wt, false, tile, ld, lhs);
  const float* b = o.bias.defined() ? o.bias.data_ptr<float>() + v0 : nullptr;
  if (b == nullptr && !(cap > 0.f) && temp == 1.f) return;
  for (int64_t r = 0; r < bn; ++r) cpu::row_bias_softcap(tile + r * ld, b, bv, cap, temp);
}

// Row i of a row-major [rows, D] operand (input or weight in the compute dtype).
const void* operand_row(const at::Tensor& m, int64_t i) {
  return static_cast<const char*>(m.data_ptr()) + i * m.size(1) * m.element_size();
}

// The forward's walk: workers own rows, and every row folds its logit tiles in vocabulary order,
// whoever runs it (vocab tiles outer: each weight tile is prepared for the GEMM once per
// worker). State: a row's running statistics; fold(tile_row, r, v0, bv, state, scratch) folds
// row r's tile of columns [v0, v0 + bv) (both scratch: the tile row, and a worker's row of
// block_v floats); store(r, state) writes row r's result.
template <typename State, typename Fold, typename Store>
void fold_rows(const Operands& o, float cap, float temp, const State& empty, Fold&& fold,
               Store&& store) {
  const int64_t workers = cpu::num_workers(ceil_div(o.n, ALIGN));
  cpu::run_workers(workers, [&](int64_t w) {
    const Span rows = cpu::split(o.n, workers, w, ALIGN);
    const Tiles row_tiles(rows, BLOCK_N, ALIGN);
    std::vector<float> tile(row_tiles.step * o.ld_tile());
    std::vector<State> state(rows.size(), empty);
    std::vector<float> scratch(o.block_v);
    Rhs wt;
    LhsScratch lhs;
    o.vocab_tiles({0, o.v}).each([&](int64_t v0, int64_t bv) {
      row_tiles.each([&](int64_t n0, int64_t bn) {
        logit_tile(o, n0, bn, v0, bv, cap, temp, tile.data(), o.ld_tile(), wt, lhs);
        for (int64_t r = 0; r < bn; ++r) {
          fold(tile.data() + r * o.ld_tile(), n0 + r, v0, bv, state[n0 - rows.begin + r],
               scratch.data());
        }
      });
    });
    for (int64_t i = rows.begin; i < rows.end; ++i) store(i, state[i - rows.begin]);
  });
}

// partial_stats, and with `argmax` ([N] int64) each row's RowState::arg.
at::Tensor partial_stats_impl(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& target, const std::optional<at::Tensor>& bias,
                              int64_t vocab_start, int64_t ignore_index, double softcap,
                              double temperature, at::Tensor* argmax) {
  check_linear_args(input, weight, target, bias);
  const Operands o = prepare(input, weight, bias);
  const at::Tensor tgt = target.contiguous();
  const int64_t* t = tgt.data_ptr<int64_t>();
  at::Tensor out = at::empty({o.n, kPartialCols}, input.options().dtype(at::kFloat));
  float* st = out.data_ptr<float>();
  int64_t* arg = nullptr;
  if (argmax) {
    *argmax = at::empty({o.n}, tgt.options());
    arg = argmax->data_ptr<int64_t>();
  }
  fold_rows(
      o, static_cast<float>(softcap), static_cast<float>(temperature), RowState{},
      [&](float* row, int64_t i, int64_t v0, int64_t bv, RowState& state, float*) {
        const int64_t tl = shard_col(t[i], vocab_start, ignore_index);
        fold_row(row, bv, tl < 0 ? -1 : tl - v0, state, false, arg ? vocab_start + v0 : -1);
      },
      [&](int64_t i, const RowState& state) {
        state.store(st + i * kPartialCols);
        if (arg) arg[i] = state.arg;
      });
  return out;
}

at::Tensor partial_stats_cpu(const at::Tensor& input, const at::Tensor& weight,
                             const at::Tensor& target, const std::optional<at::Tensor>& bias,
                             int64_t vocab_start, int64_t ignore_index, double softcap,
                             double temperature) {
  return partial_stats_impl(input, weight, target, bias, vocab_start, ignore_index, softcap,
                            temperature, nullptr);
}

std::tuple<at::Tensor, at::Tensor> partial_stats_argmax_cpu(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t vocab_start, int64_t ignore_index,
    double softcap, double temperature) {
  at::Tensor argmax;
  at::Tensor partials = partial_stats_impl(input, weight, target, bias, vocab_start,
                                           ignore_index, softcap, temperature, &argmax);
  return {partials, argmax};
}

// ops_def.h forward_argmax: forward's outputs and the column of each row's largest non-target
// logit (RowState::arg).
Tensor5 forward_argmax_cpu(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& target, const std::optional<at::Tensor>& bias,
                           int64_t ignore_index, double label_smoothing, double z_loss,
                           double softcap, double temperature,
                           std::optional<bool> /*exact_bf16_grad: the autograd's*/) {
  at::Tensor argmax;
  const at::Tensor partial = partial_stats_impl(input, weight, target, bias, 0, ignore_index,
                                                softcap, temperature, &argmax);
  auto [loss, lse, stats, ent] = combine_cpu(partial.unsqueeze(0), target, weight.size(0),
                                             ignore_index, label_smoothing, z_loss);
  return {loss, lse, stats, ent, argmax};
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

// The axis a gradient runs along: dE along the rows, dC and db along the vocabulary.
enum class Axis { rows, vocab };

// One gradient [total, width] (db is [V, 1]) as the workers accumulate it.
//
// Along the split axis (`global`) each worker accumulates its own rows over the whole pass and
// finishes them. Along the other axis, walked block by block by every worker, each worker w
// accumulates a partial of the current block; combine() adds the partials in worker order and
// writes the block out. The result is rounded once to the gradient's dtype. Where the result is
// fp32, the sum of the global accumulator and of worker 0's partial is the result itself.
class Grad {
 public:
  Grad(at::ScalarType dtype, const at::TensorOptions& opts, int64_t total, int64_t width,
       bool global, int64_t block, int64_t workers)
      : dtype_(row_dtype(dtype)), width_(width), global_(global), block_(block),
        workers_(workers), sum_in_out_(dtype == at::kFloat) {
    const auto f32 = opts.dtype(at::kFloat);
    out_ = at::empty({total, width}, opts.dtype(dtype));
    out_sum_ = sum_in_out_ ? static_cast<float*>(out_.data_ptr()) : nullptr;
    // at::empty: no pages are touched here; each worker zeroes (first-touches) its own rows.
    const int64_t sum_rows = global ? (sum_in_out_ ? 0 : total) : (workers - sum_in_out_) * block;
    const int64_t comp_rows = global ? total : workers * block;
    sum_ = at::empty({sum_rows, width}, f32);
    comp_ = at::empty({comp_rows, width}, opts.dtype(at::kBFloat16));
  }

  bool global() const { return global_; }

  // Worker w's accumulator whose row 0 is gradient row r0; x0: the first row of the current
  // block (partials only).
  KahanAcc at(int64_t w, int64_t x0, int64_t r0) const {
    uint16_t* comp = reinterpret_cast<uint16_t*>(comp_.data_ptr());
    if (global_) return {sum_row(r0), comp + r0 * width_, width_};
    const int64_t i = w * block_ + r0 - x0;
    float* sum = w == 0 && sum_in_out_
                     ? out_sum_ + r0 * width_
                     : sum_.data_ptr<float>() + ((w - sum_in_out_) * block_ + r0 - x0) * width_;
    return {sum, comp + i * width_, width_};
  }

  // Zeroes worker w's accumulator rows [r0, r0 + rows) (x0 as for at()).
  void zero(int64_t w, int64_t x0, int64_t r0, int64_t rows) const {
    const KahanAcc a = at(w, x0, r0);
    std::memset(a.sum, 0, rows * width_ * sizeof(float));
    std::memset(a.comp, 0, rows * width_ * sizeof(uint16_t));
  }

  // Global: worker's own rows [r0, r0 + rows) are complete; write them out.
  void finish(int64_t r0, int64_t rows) const { write(at(0, 0, r0), r0, rows); }

  // Partials of the block [x0, x0 + xb) are complete: worker w adds them up (in worker order)
  // for its share of the block's rows and writes them out. Every worker must have finished the
  // block before, and every worker must have combined before a partial is reused.
  void combine(int64_t w, int64_t x0, int64_t xb) const {
    const Span rows = cpu::split(xb, workers_, w, 1);
    if (rows.size() == 0) return;
    const int64_t r0 = x0 + rows.begin, n = rows.size() * width_;
    const KahanAcc acc = at(0, x0, r0);
    for (int64_t p = 1; p < workers_; ++p) {
      const KahanAcc part = at(p, x0, r0);
      cpu::row_kahan_add_pair(acc.sum, acc.comp, part.sum, part.comp, n);
    }
    write(acc, r0, rows.size());
  }

  // The result: [total, width].
  const at::Tensor& out() const { return out_; }

 private:
  float* sum_row(int64_t r) const {
    return (sum_in_out_ ? out_sum_ : sum_.data_ptr<float>()) + r * width_;
  }

  // Rows [r0, r0 + rows) of the result from the complete accumulator a (its row 0 is r0).
  void write(const KahanAcc& a, int64_t r0, int64_t rows) const {
    const int64_t n = rows * width_;
    cpu::row_add_bf16(a.sum, a.comp, n);
    if (!sum_in_out_) {
      cpu::row_store(a.sum, static_cast<char*>(out_.data_ptr()) + r0 * width_ * out_.element_size(),
                     dtype_, n);
    }
  }

  cpu::Dtype dtype_;
  int64_t width_;
  bool global_;
  int64_t block_, workers_;
  bool sum_in_out_;
  at::Tensor out_, sum_, comp_;
  float* out_sum_;
};

// A worker's scratch for the backward's tiles.
struct TileWork {
  std::vector<float> tile;          // [rows, ld_tile]: logits, then the gradient
  std::vector<uint16_t> hi, lo;     // bf16 inputs: the gradient tile rounded (hi) or split
                                    // (hi + lo), same layout
  Rhs wt, w_rhs, x_rhs;  // the tile GEMMs' right operands: W tile^T (logits), W tile (dE),
                         // input rows (dC)
  LhsScratch lhs;
  std::vector<RowGrad> rg;          // per tile row: gradient coefficients
  std::vector<int64_t> ts;          // per tile row: target column in the shard, -1 ignored
  std::vector<int64_t> t_col;       // per tile row: target column in the tile, -1 none
  std::vector<float> t_grad;        // per tile row: the target column's gradient
  std::vector<float> row_max;       // per tile row: max |gradient| (bf16 split scale)
  std::vector<float> prod, colsum;  // a scaled operand row; the tile's column sums (bias)
  std::vector<float> y;             // target distributions: a row's target weights
  // 16-bit inputs multiplied in fp32: the tile's weight rows and input rows widened, and which
  // rows they hold (the operand's address).
  std::vector<float> w32, x32;
  const void* w32_of = nullptr;
  const void* x32_of = nullptr;

  // bf16_tiles: the bf16 tiles the gradient tile becomes (GradPass::bf16_tiles_).
  TileWork(int64_t rows, int64_t ld, bool own_tile, int bf16_tiles, bool widen, int64_t d,
           int64_t bv) {
    if (own_tile) tile.resize(rows * ld);
    if (bf16_tiles > 0) hi.resize(rows * ld);
    if (bf16_tiles > 1) lo.resize(rows * ld);
    if (widen) {
      w32.resize(bv * d);
      x32.resize(rows * d);
    }
    rg.resize(rows);
    ts.resize(rows);
    t_col.resize(rows);
    t_grad.resize(rows);
    row_max.resize(rows);
    prod.resize(d);
    colsum.resize(bv);
    y.resize(bv);
  }
};

// The backward's gradients and the work on one tile, shared by the recompute backward and the
// fused forward+backward.
class GradPass {
 public:
  // split: the axis the workers split (its gradients are global); block: the other axis's
  // block size. deferred: the single pass' gradients, which scale_grad multiplies by the
  // upstream gradient and rounds to their dtype: fp32 until then (ops_def.h). fp32_e: dE in
  // fp32 (grad_input_fp32). exact_bf16_grad: the caller's choice for bf16 inputs
  // (cpu::bf16_grad).
  GradPass(const Operands& o, const std::optional<at::Tensor>& bias, std::array<bool, 3> mask,
           Axis split, int64_t block, int64_t workers, float cap, float temp, bool deferred,
           bool fp32_e, std::optional<bool> exact_bf16_grad)
      : o_(o), cap_(cap), temp_(temp),
        need_e_(mask[0]), need_c_(mask[1]), need_b_(mask[2] && bias.has_value()),
        e_tiles_(bf16_tiles(o, exact_bf16_grad, /*dw=*/false)),
        c_tiles_(bf16_tiles(o, exact_bf16_grad, /*dw=*/true)),
        bf16_tiles_(std::max(need_e_ ? e_tiles_ : 0, need_c_ ? c_tiles_ : 0)),
        widen_(o.dtype != at::kFloat && e_tiles_ == 0) {
    const auto opts = o.x.options();
    auto make = [&](std::optional<Grad>& g, at::ScalarType dt, int64_t total, int64_t width,
                    Axis axis) {
      g.emplace(dt, opts, total, width, axis == split, std::min(block, total), workers);
    };
    if (need_e_) make(ge_, deferred || fp32_e ? at::kFloat : o.dtype, o.n, o.d, Axis::rows);
    if (need_c_) make(gc_, deferred ? at::kFloat : o.w_dtype, o.v, o.d, Axis::vocab);
    if (need_b_) make(gb_, deferred ? at::kFloat : bias->scalar_type(), o.v, 1, Axis::vocab);
  }

  bool needs_any() const { return need_e_ || need_c_ || need_b_; }
  // A target distribution's backward: each row's column gradients subtract u y_c (math.h
  // soft_logit_grad), and the target column is the row's pivot.
  void set_soft(const cpu::SoftTargets* soft) { soft_ = soft; }
  // own_tile: a tile buffer of its own (the single pass' tiles are in its row block's logits)
  TileWork tile_work(int64_t rows, bool own_tile = true) const {
    return TileWork(rows, o_.ld_tile(), own_tile, bf16_tiles_, widen_, o_.d, o_.block_v);
  }

  // Worker w's rows [s0, s0 + sn) of the split axis: zeroed before, written out after the pass.
  void begin_split(int64_t w, Span s) const { each_global([&](const Grad& g) { g.zero(w, 0, s.begin, s.size()); }); }
  void end_split(Span s) const { each_global([&](const Grad& g) { g.finish(s.begin, s.size()); }); }
  // Worker w's partials of the other axis's block [x0, x0 + xb).
  void begin_block(int64_t w, int64_t x0, int64_t xb) const {
    each_partial([&](const Grad& g) { g.zero(w, x0, x0, xb); });
  }
  void combine_block(int64_t w, int64_t x0, int64_t xb) const {
    each_partial([&](const Grad& g) { g.combine(w, x0, xb); });
  }

  // Worker w's tile [bn, bv] (row stride ld) holds the logits of rows [n0, n0 + bn) and shard
  // columns [v0, v0 + bv); tw.rg[r] are the rows' gradient coefficients and tw.ts[r] each row's
  // target column in the shard (-1: ignored). x0: the first row of the current block of the
  // axis that is not split. Turns the tile into the gradient and accumulates it.
  // w_rhs: the dE GEMM's weight tile as prepared for it (tw.w_rhs, or one kept per tile).
  // first_block: x0 is the first block; first_tile: this is the worker's first tile of the
  // block. An accumulator that nothing has added into yet (the split axis's in the first block,
  // a partial at the block's first tile) takes the tile's product as it is (KahanOut::fresh).
  void tile(TileWork& tw, int64_t w, int64_t x0, int64_t n0, int64_t bn, int64_t v0, int64_t bv,
            float* tile, int64_t ld, cpu::Rhs& w_rhs, bool first_block, bool first_tile) const {
    const int64_t d = o_.d;
    for (int64_t r = 0; r < bn; ++r) {
      float* row = tile + r * ld;
      const int64_t tl = tw.ts[r] - v0;
      const bool has_t = tw.ts[r] >= 0 && tl >= 0 && tl < bv;
      const float z_target = has_t ? row[tl] : 0.f;
      if (soft_) {
        cpu::row_soft_grad_fill(row, soft_->row(n0 + r, v0, bv, tw.y.data()), bv, tw.rg[r], cap_,
                                temp_);
      } else {
        cpu::row_grad_fill(row, bv, tw.rg[r], cap_, temp_);
      }
      // The target column leaves the tile: its gradient (about -1 while the others are about
      // 1/V) would dominate every fp32 partial sum of the tile GEMMs, whose rounding error
      // scales with those partial sums. It is added on its own below, exactly once per row.
      tw.t_col[r] = has_t ? tl : -1;
      tw.t_grad[r] = has_t ? tw.rg[r].dz_t * logit_transform_grad(z_target, cap_, temp_) : 0.f;
      if (has_t) row[tl] = 0.f;
      if (bf16_tiles_ > 0) tw.row_max[r] = cpu::row_absmax(row, bv);
    }
    // bf16 inputs (cpu::bf16_grad): where bf16 GEMMs run natively (cpu::bf16_gemm_native:
    // AMX, AVX512-BF16) the fp32 gradient tile G is by default rounded once to bf16 (hi), the
    // CUDA backend's contract. Asked for exact gradients on AMX (~6x an fp32 GEMM) it is split
    // G = hi + lo into two bf16 tiles, so that the tile products run on them at ~16 mantissa
    // bits, far below bf16's rounding. Elsewhere two bf16 GEMMs cost at least one fp32 GEMM
    // (AVX512-BF16 alone: on the Xeon of docs/benchmarks.md with AMX held off, MKL's bf16 tile
    // GEMMs ran at 100 GFLOP/s per core against 170 in fp32, and the bf16 single pass took
    // 4.06 s split, 2.14 s widened), and where bf16 is widened, twice one: the exact tile G
    // multiplies fp32 copies of the tile's weight and input rows (widen_), as fp16 inputs
    // always do (fp16 tiles would underflow small gradients).
    // The target column is left out of the bf16 tiles either way and added in fp32 below.
    //
    // bf16 GEMMs (AMX) flush subnormal operands to zero, and far from the decision boundary
    // (margins ~80) a row's gradients are ~1e-35 with most of its columns below FLT_MIN: the
    // bf16 tiles are scaled by a power of two that puts their largest entry near 1, and the
    // GEMMs take the inverse as alpha (both exact).
    float alpha = 1.f;
    const int64_t ls = o_.ld_tile();
    if (bf16_tiles_ > 0) {
      float mx = 0.f;
      for (int64_t r = 0; r < bn; ++r) mx = std::max(mx, tw.row_max[r]);
      const int k = (mx > 0.f && std::isfinite(mx)) ? std::clamp(-std::ilogb(mx), -126, 126) : 0;
      const float scale = std::ldexp(1.f, k);
      alpha = std::ldexp(1.f, -k);
      for (int64_t r = 0; r < bn; ++r) {
        cpu::row_split_bf16(tile + r * ld, &tw.hi[r * ls],
                            bf16_tiles_ > 1 ? &tw.lo[r * ls] : nullptr, bv, scale);
      }
    }
    if (need_b_) {
      // Column sums in row order, one Kahan add per column, then the target columns one by one.
      const KahanAcc bacc = gb_->at(w, x0, v0);  // [bv, 1]: bv contiguous columns
      std::fill(tw.colsum.begin(), tw.colsum.begin() + bv, 0.f);
      for (int64_t r = 0; r < bn; ++r) {
        const float* row = tile + r * ld;
        for (int64_t j = 0; j < bv; ++j) tw.colsum[j] += row[j];
      }
      cpu::row_kahan_add(bacc.sum, bacc.comp, tw.colsum.data(), bv);
      for (int64_t r = 0; r < bn; ++r) {
        if (tw.t_col[r] >= 0) bacc.add(tw.t_col[r], 0, tw.t_grad[r]);
      }
    }
    const int64_t es = o_.x.element_size();
    const char* xp = static_cast<const char*>(o_.x.data_ptr()) + n0 * d * es;
    const char* wp = static_cast<const char*>(o_.w.data_ptr()) + v0 * d * es;
    // The tile products go straight into the Kahan accumulators; the bf16 tiles' are scaled
    // back by alpha (a power of two: exact).
    const GemmOperand split_rows[2] = {{tw.hi.data(), ls, false}, {tw.lo.data(), ls, false}};
    const GemmOperand split_cols[2] = {{tw.hi.data(), ls, true}, {tw.lo.data(), ls, true}};
    if (need_e_) {
      // dE[n0:n0+bn] += G [bn, bv] @ W[v0:v0+bv] [bv, D]
      const KahanAcc eacc = ge_->at(w, x0, n0);
      const cpu::KahanOut eout{eacc.sum, eacc.comp, d,
                               ge_->global() ? first_block : first_tile};
      if (e_tiles_ > 0) {
        w_rhs.prepare(at::kBFloat16, GemmOperand{wp, d, false}, bv, d);
        cpu::gemm_accumulate(at::kBFloat16, bn, d, bv, split_rows, e_tiles_, w_rhs, alpha, eout,
                             tw.lhs);
      } else {
        const void* wt = widen_ ? static_cast<const void*>(widened(tw.w32, tw.w32_of, wp, bv)) : wp;
        const GemmOperand g{tile, ld, false};
        w_rhs.prepare(at::kFloat, GemmOperand{wt, d, false}, bv, d);
        cpu::gemm_accumulate(at::kFloat, bn, d, bv, &g, 1, w_rhs, 1.f, eout, tw.lhs);
      }
      // dE[n] += dz_t W[t]: one scaled row per row that has its target in this tile.
      for (int64_t r = 0; r < bn; ++r) {
        if (tw.t_col[r] < 0) continue;
        cpu::row_scale(tw.prod.data(), operand_row(o_.w, v0 + tw.t_col[r]), o_.row_dtype, d,
                       tw.t_grad[r]);
        eacc.add_row(r, tw.prod.data());
      }
    }
    if (need_c_) {
      // dC[v0:v0+bv] += G^T [bv, bn] @ X[n0:n0+bn] [bn, D]
      const KahanAcc cacc = gc_->at(w, x0, v0);
      const cpu::KahanOut cout{cacc.sum, cacc.comp, d,
                               gc_->global() ? first_block : first_tile};
      if (c_tiles_ > 0) {
        tw.x_rhs.prepare(at::kBFloat16, GemmOperand{xp, d, false}, bn, d);
        cpu::gemm_accumulate(at::kBFloat16, bv, d, bn, split_cols, c_tiles_, tw.x_rhs, alpha,
                             cout, tw.lhs);
      } else {
        const void* xr = widen_ ? static_cast<const void*>(widened(tw.x32, tw.x32_of, xp, bn)) : xp;
        const GemmOperand gt{tile, ld, true};
        tw.x_rhs.prepare(at::kFloat, GemmOperand{xr, d, false}, bn, d);
        cpu::gemm_accumulate(at::kFloat, bv, d, bn, &gt, 1, tw.x_rhs, 1.f, cout, tw.lhs);
      }
      // dC[t] += dz_t X[n], in row order: rows that share a target add to one row of dC.
      for (int64_t r = 0; r < bn; ++r) {
        if (tw.t_col[r] < 0) continue;
        cpu::row_scale(tw.prod.data(), operand_row(o_.x, n0 + r), o_.row_dtype, d, tw.t_grad[r]);
        cacc.add_row(tw.t_col[r], tw.prod.data());
      }
    }
  }

  Tensor3 outputs() const {
    // Distinct empty tensors (outputs must not alias) where a gradient is not computed, in the
    // dtypes of every backend and of the fake kernels: dE's the input's, dW's and db's the
    // weight's.
    const auto w_opts = o_.x.options().dtype(o_.w_dtype);
    at::Tensor e = o_.x.new_empty({0}), c = at::empty({0}, w_opts), b = at::empty({0}, w_opts);
    if (need_e_) e = ge_->out();
    if (need_c_) c = gc_->out();
    if (need_b_) b = gb_->out().reshape({o_.v});
    return {e, c, b};
  }

 private:
  template <typename F>
  void each_global(F f) const {
    for (const auto* g : {&ge_, &gc_, &gb_}) {
      if (*g && (*g)->global()) f(**g);
    }
  }
  template <typename F>
  void each_partial(F f) const {
    for (const auto* g : {&ge_, &gc_, &gb_}) {
      if (*g && !(*g)->global()) f(**g);
    }
  }

  const Operands& o_;
  float cap_, temp_;
  // rows [rows, D] of a 16-bit operand at src, widened (exactly) into buf unless buf holds them.
  const float* widened(std::vector<float>& buf, const void*& holds, const void* src,
                       int64_t rows) const {
    if (holds != src) {
      const int64_t es = o_.x.element_size();
      for (int64_t r = 0; r < rows; ++r) {
        cpu::row_scale(buf.data() + r * o_.d, static_cast<const char*>(src) + r * o_.d * es,
                       o_.row_dtype, o_.d, 1.f);
      }
      holds = src;
    }
    return buf.data();
  }

  // The bf16 tiles the dE (dw false) or dW GEMM multiplies: 1 (hi, the gradient tile rounded
  // once), 2 (hi + lo, split) or 0 (fp32 GEMMs, widen_ for 16-bit inputs). An fp32 dW of bf16
  // operands (master weights) takes hi + lo in the rounded mode too, as the CUDA backend does:
  // a tile rounded to 8 bits would fall far below an fp32 gradient's precision, and the fix
  // costs one GEMM, dW's, not dE's.
  static int bf16_tiles(const Operands& o, std::optional<bool> exact, bool dw) {
    if (o.dtype != at::kBFloat16) return 0;
    switch (cpu::bf16_grad(exact)) {
      case cpu::Bf16Grad::rounded: return dw && o.w_dtype == at::kFloat ? 2 : 1;
      case cpu::Bf16Grad::split: return 2;
      case cpu::Bf16Grad::widened: return 0;
    }
    return 0;
  }

  bool need_e_, need_c_, need_b_;
  int e_tiles_, c_tiles_;  // bf16_tiles of the dE and dW GEMMs
  int bf16_tiles_;         // the tiles computed: hi, and lo where a GEMM takes it
  bool widen_;
  std::optional<Grad> ge_, gc_, gb_;
  const cpu::SoftTargets* soft_ = nullptr;
};

// How the backward's workers share a shard: the split axis is the smaller one (its gradient is
// the one accumulated whole), in ranges of ALIGN-multiples; the other axis is walked in blocks
// of `block`.
struct BackwardPlan {
  Axis split;
  int64_t workers;
  int64_t block;       // block of the other axis
  int64_t split_tile;  // tiles of a worker's range
  int64_t tile_rows;   // rows per tile
};

BackwardPlan backward_plan(const Operands& o) {
  BackwardPlan p;
  p.split = o.v <= o.n ? Axis::vocab : Axis::rows;
  const int64_t extent = p.split == Axis::rows ? o.n : o.v;
  p.workers = cpu::num_workers(ceil_div(extent, ALIGN));
  p.tile_rows = o.dtype == at::kFloat ? BLOCK_N : BLOCK_N_WIDE;
  p.block = p.split == Axis::rows ? o.block_v : p.tile_rows;
  p.split_tile = p.split == Axis::rows ? p.tile_rows : o.block_v;
  return p;
}

// A target distribution's backward (soft_backward): its target weights, its rows' pivots and
// z-loss row weights (null: each row's target mass).
struct SoftBackward {
  cpu::SoftTargets y;
  const int64_t* pivot;
  const float* z_weight;
};

// The backward over the shard's tiles, recomputing each logit tile. soft: a target
// distribution's (st then holds kSoftCols per row and t is unused), or null. fp32_e: dE in fp32
// (GradPass).
Tensor3 run_backward(const Operands& o, const std::optional<at::Tensor>& bias, const int64_t* t,
                     const float* g, const float* glse, const float* gent, const float* st,
                     int64_t vocab_start, int64_t ignore_index, const LossOptions& opt,
                     std::array<bool, 3> mask, bool deferred, bool fp32_e,
                     std::optional<bool> exact_bf16_grad, const SoftBackward* soft = nullptr) {
  const BackwardPlan plan = backward_plan(o);
  GradPass pass(o, bias, mask, plan.split, plan.block, plan.workers, opt.softcap,
                opt.temperature, deferred, fp32_e, exact_bf16_grad);
  if (soft) pass.set_soft(&soft->y);
  if (!pass.needs_any()) return pass.outputs();
  const bool rows_split = plan.split == Axis::rows;
  const int64_t split_extent = rows_split ? o.n : o.v, other_extent = rows_split ? o.v : o.n;
  const Tiles blocks({0, other_extent}, plan.block, ALIGN);
  cpu::Barrier barrier(plan.workers);
  cpu::run_workers(plan.workers, [&](int64_t w) {
    const Span own = cpu::split(split_extent, plan.workers, w, ALIGN);
    const Tiles tiles(own, plan.split_tile, ALIGN);
    TileWork tw = pass.tile_work(plan.tile_rows);
    pass.begin_split(w, own);
    blocks.each([&](int64_t x0, int64_t xb) {
      pass.begin_block(w, x0, xb);
      tiles.each([&](int64_t s0, int64_t sb) {
        const int64_t n0 = rows_split ? s0 : x0, bn = rows_split ? sb : xb;
        const int64_t v0 = rows_split ? x0 : s0, bv = rows_split ? xb : sb;
        for (int64_t r = 0; r < bn; ++r) {
          const int64_t i = n0 + r;
          if (soft) {
            const float* si = st + kSoftCols * i;  // (m_x, s_x, p, u_x, y_a, y_rest, g)
            const float zw = soft->z_weight ? soft->z_weight[i] : si[4] + si[5];
            tw.rg[r] = soft_row_grad(OnlineLse{si[0], si[1], si[3]}, si[2], si[4], si[5], zw,
                                     g[i], glse ? glse[i] : 0.f, opt.z_loss,
                                     gent ? gent[i] : 0.f);
            tw.ts[r] = soft->pivot[i] < 0 ? -1 : soft->pivot[i] - vocab_start;
            continue;
          }
          const bool ign = row_ignored(t[i], ignore_index);
          const float* si = st + kStatsCols * i;  // (m_x, s_x, z_t, u_x)
          tw.rg[r] = row_grad(OnlineLse{si[0], si[1], si[3]}, si[2], ign, g[i],
                              glse ? glse[i] : 0.f, opt, gent ? gent[i] : 0.f);
          tw.ts[r] = shard_col(t[i], vocab_start, ignore_index);
        }
        logit_tile(o, n0, bn, v0, bv, opt.softcap, opt.temperature, tw.tile.data(), o.ld_tile(),
                   tw.wt, tw.lhs);
        pass.tile(tw, w, x0, n0, bn, v0, bv, tw.tile.data(), o.ld_tile(), tw.w_rhs, x0 == 0,
                  s0 == own.begin);
      });
      barrier.wait();  // every partial of the block is complete
      pass.combine_block(w, x0, xb);
      barrier.wait();  // every worker has read the partials: they may be reused
    });
    pass.end_split(own);
  }, &barrier);
  return pass.outputs();
}

LossOptions loss_options(double label_smoothing, double z_loss, double softcap,
                         int64_t vocab_size, double temperature) {
  return LossOptions{static_cast<float>(label_smoothing), static_cast<float>(z_loss),
                     static_cast<float>(softcap), vocab_size, static_cast<float>(temperature)};
}

Tensor3 backward_cpu(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                     const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, const at::Tensor& stats,
                     int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                     double label_smoothing, double z_loss, double softcap,
                     std::array<bool, 3> output_mask, const std::optional<at::Tensor>& grad_entropy,
                     double temperature, std::optional<bool> exact_bf16_grad,
                     bool grad_input_fp32) {
  check_backward_args(grad_loss, grad_lse, input, weight, target, bias, stats, grad_entropy);
  const Operands o = prepare(input, weight, bias);
  const at::Tensor tgt = target.contiguous();
  const at::Tensor gl = grad_loss.contiguous();  // an expanded scalar becomes [N]: small
  const at::Tensor glse = grad_lse ? grad_lse->contiguous() : at::Tensor();
  const at::Tensor gent = grad_entropy ? grad_entropy->contiguous() : at::Tensor();
  const at::Tensor st = stats.contiguous();
  return run_backward(o, bias, tgt.data_ptr<int64_t>(), gl.data_ptr<float>(),
                      glse.defined() ? glse.data_ptr<float>() : nullptr,
                      gent.defined() ? gent.data_ptr<float>() : nullptr, st.data_ptr<float>(),
                      vocab_start, ignore_index,
                      loss_options(label_smoothing, z_loss, softcap, vocab_size, temperature),
                      output_mask, /*deferred=*/false, grad_input_fp32, exact_bf16_grad);
}

std::tuple<at::Tensor, at::Tensor> soft_partial_stats_cpu(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& class_weight,
    int64_t vocab_start, int64_t vocab_size, int64_t ignore_index, double label_smoothing,
    double softcap, double temperature) {
  check_linear_operands(input, weight, bias);
  check_soft_target_args(input, target, class_weight, weight.size(0));
  // Wide tiles: each row of a tile reads BLOCK_V_WIDE contiguous target weights, which the
  // hardware prefetchers stream; 256 columns (1 KiB) per row, rows V * 4 bytes apart, left the
  // fold waiting on them (a third of the logit GEMM's time at N = 2048, V = 32768, D = 512).
  const Operands o = prepare(input, weight, bias, /*wide=*/true);
  std::vector<at::Tensor> keep;
  const cpu::SoftTargets y = cpu::soft_targets(target, class_weight, o.n, o.v, vocab_start,
                                               vocab_size, ignore_index, label_smoothing, keep);
  at::Tensor out = at::empty({o.n, kSoftCols}, input.options().dtype(at::kFloat));
  at::Tensor pivot = at::empty({o.n}, input.options().dtype(at::kLong));
  float* st = out.data_ptr<float>();
  int64_t* pv = pivot.data_ptr<int64_t>();
  fold_rows(
      o, static_cast<float>(softcap), static_cast<float>(temperature), soft_empty(),
      [&](float* row, int64_t i, int64_t v0, int64_t bv, SoftRow& state, float* y_row) {
        cpu::fold_soft_row(row, y.row(i, v0, bv, y_row), bv, vocab_start + v0, state);
      },
      [&](int64_t i, const SoftRow& state) {
        soft_store(state, st + i * kSoftCols);
        pv[i] = state.a;
      });
  return {out, pivot};
}

Tensor3 soft_backward_cpu(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
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
  const Operands o = prepare(input, weight, bias);
  std::vector<at::Tensor> keep;
  const at::Tensor gl = grad_loss.contiguous();  // an expanded scalar becomes [N]: small
  const at::Tensor glse = grad_lse ? grad_lse->contiguous() : at::Tensor();
  const at::Tensor gent = grad_entropy ? grad_entropy->contiguous() : at::Tensor();
  const at::Tensor st = stats.contiguous(), pv = pivot.contiguous();
  const at::Tensor zw = z_weight ? z_weight->contiguous() : at::Tensor();
  const SoftBackward soft{cpu::soft_targets(target, class_weight, o.n, o.v, vocab_start,
                                            vocab_size, ignore_index, label_smoothing, keep),
                          pv.data_ptr<int64_t>(), zw.defined() ? zw.data_ptr<float>() : nullptr};
  return run_backward(o, bias, nullptr, gl.data_ptr<float>(),
                      glse.defined() ? glse.data_ptr<float>() : nullptr,
                      gent.defined() ? gent.data_ptr<float>() : nullptr, st.data_ptr<float>(),
                      vocab_start, ignore_index,
                      loss_options(label_smoothing, z_loss, softcap, vocab_size, temperature),
                      // Target distributions keep exact bf16 gradients: exact_bf16_grad is not
                      // an argument of their ops.
                      output_mask, /*deferred=*/false, grad_input_fp32,
                      /*exact_bf16_grad=*/true, &soft);
}

// Rows per block of the fused forward+backward (FUSED_BLOCK_N and the workspace bounds of
// cpu/single_pass.h, which say why); 0 when not even 16 rows fit.
int64_t fused_block_rows(const Operands& o, int64_t workers) {
  const int64_t row_floats = (ceil_div(o.v, o.block_v) + workers) * o.ld_tile();
  const int64_t workspace =
      o.dtype == at::kFloat ? cpu::kFusedWorkspaceBytes : cpu::kFusedWorkspaceBytes16;
  const int64_t rows = std::min({cpu::FUSED_BLOCK_N, ceil_div(std::max<int64_t>(o.n, 1), 16) * 16,
                                 workspace / (4 * row_floats)});
  return rows >= 16 ? rows / 16 * 16 : 0;
}

// The reduced loss (sum or mean) and its gradients, in one pass: each row block's logits are
// computed once, folded into the row statistics, then turned into the gradient tile (3 GEMMs
// instead of the 4 of forward + recompute backward). Gradients come back deferred (ops_def.h):
// [1, ...] fp32, each the result of its Kahan accumulator, of the reduced loss (the mean's
// 1 / count is in every row's gradient coefficient); scale_grad multiplies them by the upstream
// gradient and rounds once to the gradient's dtype (a 16-bit dW held in fp32 costs no more
// than rounding it in the pass would: its fp32 sum lives until the end of the pass anyway).
// Workers split the vocabulary; per row block they fold their columns' statistics, merge them
// (barrier), turn their columns into gradients, and add up the block's dE partials (barrier).
// Rows are the outer loop, so each worker keeps its 16-bit weight tiles packed for the GEMMs
// over the whole pass: 2 V * D 16-bit values (W^T and W) more scratch on the onednn path, none
// on the blas path.
// The single pass's rows: class targets (t), or a target distribution (soft: its target weights
// and z-loss row weights, SoftBackward's; t then the class ids or null).
struct SinglePassRows {
  const int64_t* t;
  int64_t ignore_index;
  const SoftBackward* soft;
};

using Tensor5Out = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The single pass's outputs (ops_def.h): the loss sum / divisor, the divisor 1 (already
// applied), the gradients deferred as [1, ...] (an unrequested one stays the empty [0]).
Tensor5Out deferred_result(const at::Tensor& input, double sum, double divisor, Tensor3 grads) {
  auto deferred = [](const at::Tensor& g) { return g.numel() || g.dim() > 1 ? g.unsqueeze(0) : g; };
  return std::make_tuple(at::full({}, static_cast<float>(sum / divisor),
                                  input.options().dtype(at::kFloat)),
                         at::ones({}, input.options().dtype(at::kDouble)),
                         deferred(std::get<0>(grads)), deferred(std::get<1>(grads)),
                         deferred(std::get<2>(grads)));
}

// The single pass of sum_and_grad_cpu and soft_sum_and_grad_cpu: `divisor` the mean's (1 for a
// sum), whose inverse is every row's upstream gradient (0 for divisor 0: zero gradients, not
// 0 * inf).
Tensor5Out single_pass_cpu(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const SinglePassRows& rows_in,
                           const LossOptions& opt, std::array<bool, 3> output_mask,
                           double divisor, std::optional<bool> exact_bf16_grad,
                           const std::function<Tensor5Out(float)>& fallback) {
  const Operands o = prepare(input, weight, bias, /*wide=*/true);
  const cpu::SoftTargets* soft = rows_in.soft ? &rows_in.soft->y : nullptr;
  const float* z_weight = rows_in.soft ? rows_in.soft->z_weight : nullptr;
  const float g_row = divisor > 0 ? static_cast<float>(1.0 / divisor) : 0.f;
  const int64_t workers = cpu::num_workers(ceil_div(o.v, ALIGN));
  const int64_t bn_f = fused_block_rows(o, workers);
  // The vocabulary is too large to keep a row block's logits: forward, then the recompute
  // backward.
  if (bn_f == 0) return fallback(g_row);
  GradPass pass(o, bias, output_mask, Axis::vocab, bn_f, workers, opt.softcap, opt.temperature,
                /*deferred=*/true, /*fp32_e=*/true, exact_bf16_grad);
  if (soft) pass.set_soft(soft);
  // The pass returns the loss alone: the rows' entropy terms are not needed, nor, without
  // label smoothing, the sums of their logits.
  const bool loss_only = opt.label_smoothing == 0.f;
  const int64_t ld = o.ld_tile();
  // per worker: its columns' row statistics (class targets, or a target distribution's)
  std::vector<RowState> parts(soft ? 0 : workers * bn_f);
  std::vector<SoftRow> soft_parts(soft ? workers * bn_f : 0);
  float ls = 0.f, lc = 0.f;  // worker 0's Kahan sum of the row losses, in row order
  cpu::Barrier barrier(workers);
  cpu::run_workers(workers, [&](int64_t w) {
    const Span own = cpu::split(o.v, workers, w, ALIGN);
    const Tiles tiles = o.vocab_tiles(own);
    TileWork tw = pass.tile_work(bn_f, /*own_tile=*/false);
    // [tiles, bn_f, ld]: the row block's logits in the worker's columns, each tile's rows
    // contiguous with the row stride of the recompute path's tiles, and first touched by the
    // worker that uses them, on huge pages (cpu/scratch.h).
    cpu::HugeVector<float> z(tiles.count() * bn_f * ld);
    auto tile_z = [&](int64_t v0) { return z.data() + tiles.index(v0) * bn_f * ld; };
    // The worker's weight tiles as the dE GEMM and (16-bit inputs) the logit GEMM read them,
    // prepared once. fp32's logit GEMM repacks its tile per row block instead: the dE GEMM reads
    // an fp32 weight in place, and a kept W^T would cost V * D * 4 bytes for 2% of the time
    // (bf16: 5%; at N=4096, V=32768, D=512 on the Zen 4 of docs/benchmarks.md).
    std::vector<Rhs> w_rhs(tiles.count()), wt(o.dtype == at::kFloat ? 1 : tiles.count());
    RowState* mine = soft ? nullptr : parts.data() + w * bn_f;
    SoftRow* soft_mine = soft ? soft_parts.data() + w * bn_f : nullptr;
    pass.begin_split(w, own);
    Tiles({0, o.n}, bn_f, ALIGN).each([&](int64_t n0, int64_t bn) {
      if (soft) {
        std::fill(soft_mine, soft_mine + bn_f, soft_empty());
      } else {
        std::fill(mine, mine + bn_f, RowState{});
        for (int64_t r = 0; r < bn; ++r) {
          tw.ts[r] = shard_col(rows_in.t[n0 + r], 0, rows_in.ignore_index);
        }
      }
      tiles.each([&](int64_t v0, int64_t bv) {
        float* zt = tile_z(v0);
        logit_tile(o, n0, bn, v0, bv, opt.softcap, opt.temperature, zt, ld,
                   wt[wt.size() > 1 ? tiles.index(v0) : 0], tw.lhs);
        for (int64_t r = 0; r < bn; ++r) {
          if (soft) {
            cpu::fold_soft_row(zt + r * ld, soft->row(n0 + r, v0, bv, tw.y.data()), bv, v0,
                               soft_mine[r]);
          } else {
            fold_row(zt + r * ld, bv, tw.ts[r] < 0 ? -1 : tw.ts[r] - v0, mine[r], loss_only);
          }
        }
      });
      barrier.wait();  // every worker's statistics of the block are complete
      for (int64_t r = 0; r < bn; ++r) {
        float loss;
        if (soft) {
          SoftRow row = soft_parts[r];
          for (int64_t p = 1; p < workers; ++p) row = soft_merge(row, soft_parts[p * bn_f + r]);
          const float zw = z_weight ? z_weight[n0 + r] : row.y_a + row.y_rest;
          loss = soft_row_loss(row, zw, opt.z_loss).loss;
          tw.rg[r] = soft_row_grad(row.x, row.p, row.y_a, row.y_rest, zw, g_row, 0.f, opt.z_loss);
          tw.ts[r] = row.a;
        } else {
          RowState row = parts[r];
          for (int64_t p = 1; p < workers; ++p) row.merge(parts[p * bn_f + r]);
          const bool ign = tw.ts[r] < 0;
          loss = row_loss(row.lse, row.z_t, row.sum(), ign, opt).loss;
          tw.rg[r] = row_grad(row.lse, row.z_t, ign, g_row, 0.f, opt);
        }
        if (w == 0) kahan_add(ls, lc, loss);  // as combine with one shard
      }
      if (!pass.needs_any()) {
        barrier.wait();  // statistics read: they may be overwritten
        return;
      }
      pass.begin_block(w, n0, bn);
      tiles.each([&](int64_t v0, int64_t bv) {
        pass.tile(tw, w, n0, n0, bn, v0, bv, tile_z(v0), ld, w_rhs[tiles.index(v0)], n0 == 0,
                  v0 == own.begin);
      });
      // Every partial of the block is complete, and every worker has read the statistics. The
      // next block's statistics are written before its first barrier, its partials after it:
      // by then every worker has combined this block.
      barrier.wait();
      pass.combine_block(w, n0, bn);
    });
    pass.end_split(own);
  }, &barrier);
  return deferred_result(input, static_cast<double>(ls) + static_cast<double>(lc), divisor,
                         pass.outputs());
}

// The reduced loss (sum or mean) and its gradients, in one pass: each row block's logits are
// computed once, folded into the row statistics, then turned into the gradient tile (3 GEMMs
// instead of the 4 of forward + recompute backward). Gradients come back deferred (ops_def.h):
// [1, ...] fp32, each the result of its Kahan accumulator, of the reduced loss (the mean's
// 1 / count is in every row's gradient coefficient); scale_grad multiplies them by the upstream
// gradient and rounds once to the gradient's dtype (a 16-bit dW held in fp32 costs no more
// than rounding it in the pass would: its fp32 sum lives until the end of the pass anyway).
// Workers split the vocabulary; per row block they fold their columns' statistics, merge them
// (barrier), turn their columns into gradients, and add up the block's dE partials (barrier).
// Rows are the outer loop, so each worker keeps its 16-bit weight tiles packed for the GEMMs
// over the whole pass: 2 V * D 16-bit values (W^T and W) more scratch on the onednn path, none
// on the blas path.
Tensor5Out sum_and_grad_cpu(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, double label_smoothing,
    double z_loss, double softcap, std::array<bool, 3> output_mask, bool mean,
    int64_t vocab_start, int64_t vocab_size, const std::optional<std::string>& group_name,
    int64_t group_size, double temperature, std::optional<bool> exact_bf16_grad) {
  check_linear_args(input, weight, target, bias);
  TORCH_CHECK_VALUE(!group_name && vocab_start == 0 && (vocab_size < 0 || vocab_size ==
                                                        weight.size(0)),
                    "flce: the CPU backend's single pass is single-device; vocab-parallel CPU "
                    "training takes the recompute path (single_pass=False)");
  const at::Tensor tgt = target.contiguous();
  const int64_t* t = tgt.data_ptr<int64_t>();
  const int64_t v = weight.size(0);
  check_targets(t, input.size(0), v, ignore_index);
  const LossOptions opt = loss_options(label_smoothing, z_loss, softcap, v, temperature);
  int64_t count = 0;
  for (int64_t i = 0; i < input.size(0); ++i) count += !row_ignored(t[i], ignore_index);
  // mean: divided in double, rounded once (0/0 = NaN, as torch)
  const double divisor = mean ? static_cast<double>(count) : 1.0;
  auto fallback = [&](float g_row) {
    const at::Tensor partial =
        partial_stats_cpu(input, weight, target, bias, 0, ignore_index, softcap, temperature);
    auto [loss, lse, stats, ent] = combine_cpu(partial.unsqueeze(0), target, v, ignore_index,
                                               label_smoothing, z_loss);
    const double total = loss.to(at::kDouble).sum().item<double>();
    const at::Tensor g = at::full({input.size(0)}, g_row, loss.options());
    const Operands o = prepare(input, weight, bias, /*wide=*/true);
    Tensor3 grads = run_backward(o, bias, t, g.data_ptr<float>(), nullptr, nullptr,
                                 stats.contiguous().data_ptr<float>(), 0, ignore_index, opt,
                                 output_mask, /*deferred=*/true, /*fp32_e=*/true,
                                 exact_bf16_grad);
    return deferred_result(input, total, divisor, grads);
  };
  return single_pass_cpu(input, weight, bias, SinglePassRows{t, ignore_index, nullptr}, opt,
                         output_mask, divisor, exact_bf16_grad, fallback);
}

// The single pass of a target distribution (ops_def.h soft_sum_and_grad): as sum_and_grad_cpu,
// each row block's states (SoftRow) and gradient tiles from its logits computed once. mean:
// over the rows for probability targets, over the rows' z-loss weights (torch's class
// weights of their targets) or the non-ignored rows for class targets.
Tensor5Out soft_sum_and_grad_cpu(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& class_weight,
    const std::optional<at::Tensor>& z_weight, int64_t ignore_index, double label_smoothing,
    double z_loss, double softcap, double temperature, std::array<bool, 3> output_mask,
    bool mean) {
  check_linear_operands(input, weight, bias);
  check_soft_target_args(input, target, class_weight, weight.size(0));
  const int64_t n = input.size(0), v = weight.size(0);
  if (z_weight) {
    TORCH_CHECK_VALUE(z_weight->dim() == 1 && z_weight->size(0) == n &&
                          z_weight->scalar_type() == at::kFloat,
                      "flce: z_weight must be float32 [N]");
  }
  std::vector<at::Tensor> keep;
  const at::Tensor zw = z_weight ? z_weight->contiguous() : at::Tensor();
  const SoftBackward soft{cpu::soft_targets(target, class_weight, n, v, 0, v, ignore_index,
                                            label_smoothing, keep),
                          nullptr, zw.defined() ? zw.data_ptr<float>() : nullptr};
  double divisor = 1.0;
  if (mean && target.scalar_type() != at::kLong) {
    divisor = static_cast<double>(n);
  } else if (mean) {
    divisor = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      if (!row_ignored(soft.y.t[i], ignore_index)) divisor += soft.z_weight ? soft.z_weight[i] : 1.0;
    }
  }
  const LossOptions opt = loss_options(label_smoothing, z_loss, softcap, v, temperature);
  auto fallback = [&](float g_row) {
    auto [partial, pivot] = soft_partial_stats_cpu(input, weight, target, bias, class_weight, 0,
                                                   v, ignore_index, label_smoothing, softcap,
                                                   temperature);
    auto [loss, lse, stats, piv, ent] =
        cpu::soft_combine_cpu(partial.unsqueeze(0), pivot.unsqueeze(0), z_weight, z_loss);
    const double total = loss.to(at::kDouble).sum().item<double>();
    const at::Tensor g = at::full({n}, g_row, loss.options());
    const at::Tensor st = stats.contiguous(), pv = piv.contiguous();
    const SoftBackward rows{soft.y, pv.data_ptr<int64_t>(), soft.z_weight};
    const Operands o = prepare(input, weight, bias, /*wide=*/true);
    Tensor3 grads = run_backward(o, bias, nullptr, g.data_ptr<float>(), nullptr, nullptr,
                                 st.data_ptr<float>(), 0, ignore_index, opt, output_mask,
                                 /*deferred=*/true, /*fp32_e=*/true,
                                 /*exact_bf16_grad=*/true, &rows);
    return deferred_result(input, total, divisor, grads);
  };
  // (target distributions keep exact bf16 gradients, as soft_backward_cpu)
  return single_pass_cpu(input, weight, bias, SinglePassRows{nullptr, ignore_index, &soft}, opt,
                         output_mask, divisor, /*exact_bf16_grad=*/true, fallback);
}

// grad = dtype((sum of the k slices of deferred [k, ...]) * scale), in double, rounded once.
at::Tensor scale_grad_cpu(const at::Tensor& deferred, const at::Tensor& scale,
                          at::ScalarType dtype) {
  TORCH_CHECK_VALUE(deferred.dim() >= 1 && (deferred.size(0) == 1 || deferred.size(0) == 2),
                    "flce: scale_grad needs a deferred gradient [k, ...] with k = 1 or 2, got ",
                    deferred.sizes());
  const at::Tensor p = deferred.contiguous();
  const double k = scale.to(at::kDouble).item<double>();
  at::Tensor out = at::empty(p[0].sizes(), p.options().dtype(dtype));
  const int64_t n = p[0].numel(), slices = p.size(0);
  const at::ScalarType in_dtype = p.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in_dtype, "flce_scale_grad", [&] {
    using in_t = scalar_t;
    const in_t* x = p.data_ptr<in_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "flce_scale_grad", [&] {
      scalar_t* o = out.data_ptr<scalar_t>();
      at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          double sum = 0.0;
          for (int64_t s = 0; s < slices; ++s) sum += static_cast<double>(x[s * n + i]);
          o[i] = static_cast<scalar_t>(sum * k);
        }
      });
    });
  });
  return out;
}

// deferred [1, ...] *= scale in place, in double, rounded once to its dtype.
void scale_grad_inplace_cpu(const at::Tensor& deferred, const at::Tensor& scale) {
  TORCH_CHECK_VALUE(deferred.dim() >= 1 && deferred.size(0) == 1 && deferred.is_contiguous(),
                    "flce: scale_grad_ needs a contiguous deferred gradient [1, ...], got ",
                    deferred.sizes());
  const double k = scale.to(at::kDouble).item<double>();
  const int64_t n = deferred.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, deferred.scalar_type(),
                                  "flce_scale_grad_", [&] {
    scalar_t* x = deferred.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        x[i] = static_cast<scalar_t>(static_cast<double>(x[i]) * k);
      }
    });
  });
}

}  // namespace

namespace cpu {

Tensor4 combine_cpu(const at::Tensor& partials, const at::Tensor& target, int64_t vocab_size,
                    int64_t ignore_index, double label_smoothing, double z_loss) {
  check_combine_args(partials, target);
  const at::Tensor p = partials.contiguous();
  const at::Tensor tgt = target.contiguous();
  const int64_t ranks = p.size(0), n = p.size(1);
  const int64_t* t = tgt.data_ptr<int64_t>();
  check_targets(t, n, vocab_size, ignore_index);
  auto f32 = p.options();
  at::Tensor loss = at::empty({n}, f32), lse = at::empty({n}, f32), ent = at::empty({n}, f32),
             stats = at::empty({n, kStatsCols}, f32);
  const LossOptions opt{static_cast<float>(label_smoothing), static_cast<float>(z_loss), 0.f,
                        vocab_size};
  const float* pp = p.data_ptr<float>();
  float* lo = loss.data_ptr<float>();
  float* ls = lse.data_ptr<float>();
  float* sp = stats.data_ptr<float>();
  float* ep = ent.data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      RowState st;
      for (int64_t r = 0; r < ranks; ++r) {  // fixed rank order: deterministic
        const float* q = pp + (r * n + i) * kPartialCols;
        st.merge(RowState{OnlineLse{q[0], q[1], q[4]}, q[2], q[3], 0.f});
      }
      const bool ign = row_ignored(t[i], ignore_index);
      const RowLoss rl = row_loss(st.lse, st.z_t, st.sum(), ign, opt);
      lo[i] = rl.loss;
      ls[i] = rl.lse;
      ep[i] = row_entropy(st.lse, st.z_t, ign);
      // (m_x, s_x, z_t, u_x): the backward's p_j = exp(z_j - M) / S, and the entropy's state
      float* out = sp + kStatsCols * i;
      out[0] = st.lse.m;
      out[1] = st.lse.s;
      out[2] = st.z_t;
      out[3] = st.lse.u;
    }
  });
  return {loss, lse, stats, ent};
}

SoftTargets soft_targets(const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
                         int64_t n, int64_t v_local, int64_t vocab_start, int64_t vocab_size,
                         int64_t ignore_index, double label_smoothing,
                         std::vector<at::Tensor>& keep) {
  SoftTargets y;
  const at::Tensor tgt = target.scalar_type() == at::kLong ? target.contiguous() : target;
  if (tgt.scalar_type() == at::kLong) {
    TORCH_CHECK_VALUE(tgt.dim() == 1 && tgt.size(0) == n, "flce: class targets must be [N] with N=",
                      n, ", got ", tgt.sizes());
    y.t = tgt.data_ptr<int64_t>();
    check_targets(y.t, n, vocab_size, ignore_index);
  } else {
    TORCH_CHECK_VALUE(tgt.dim() == 2 && tgt.size(0) == n && tgt.size(1) == v_local,
                      "flce: probability targets must be [N, V] with N=", n, ", V=", v_local,
                      ", got ", tgt.sizes());
    // Rows may be strided (a slice of a wider tensor); the columns are read contiguously.
    const at::Tensor q = tgt.stride(1) == 1 || v_local <= 1 ? tgt : tgt.contiguous();
    y.q = q.data_ptr();
    y.q_dtype = row_dtype(q.scalar_type());
    y.ldq = n > 1 ? q.stride(0) : v_local;
    keep.push_back(q);
  }
  keep.push_back(tgt);
  if (class_weight) {
    const at::Tensor w = class_weight->contiguous();
    keep.push_back(w);
    y.w = w.data_ptr<float>();
  }
  y.ignore_index = ignore_index;
  y.alpha = static_cast<float>(1.0 - label_smoothing);
  y.beta = static_cast<float>(label_smoothing / static_cast<double>(vocab_size));
  y.vocab_start = vocab_start;
  return y;
}

Tensor5 soft_combine_cpu(const at::Tensor& partials, const at::Tensor& pivot,
                         const std::optional<at::Tensor>& z_weight, double z_loss) {
  check_soft_combine_args(partials, pivot, z_weight);
  const at::Tensor p = partials.contiguous(), pv = pivot.contiguous();
  const at::Tensor zw = z_weight ? z_weight->contiguous() : at::Tensor();
  const int64_t ranks = p.size(0), n = p.size(1);
  auto f32 = p.options();
  at::Tensor loss = at::empty({n}, f32), lse = at::empty({n}, f32), ent = at::empty({n}, f32),
             stats = at::empty({n, kSoftCols}, f32), piv = at::empty({n}, pv.options());
  const float* pp = p.data_ptr<float>();
  const int64_t* pa = pv.data_ptr<int64_t>();
  const float* zp = zw.defined() ? zw.data_ptr<float>() : nullptr;
  float* lo = loss.data_ptr<float>();
  float* ls = lse.data_ptr<float>();
  float* sp = stats.data_ptr<float>();
  float* ep = ent.data_ptr<float>();
  int64_t* po = piv.data_ptr<int64_t>();
  const float zl = static_cast<float>(z_loss);
  at::parallel_for(0, n, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      SoftRow st = soft_empty();
      for (int64_t r = 0; r < ranks; ++r) {  // fixed rank order: deterministic
        st = soft_merge(st, soft_load(pp + (r * n + i) * kSoftCols, pa[r * n + i]));
      }
      const SoftLoss sl = soft_row_loss(st, zp ? zp[i] : st.y_a + st.y_rest, zl);
      lo[i] = sl.loss;
      ls[i] = sl.lse;
      ep[i] = row_entropy(st.x, st.p, st.a < 0);
      soft_store(st, sp + kSoftCols * i);
      po[i] = st.a;
    }
  });
  return {loss, lse, stats, piv, ent};
}

}  // namespace cpu

void check_target_cpu(const at::Tensor& target, int64_t vocab_size, int64_t ignore_index) {
  const at::Tensor t = target.to(at::kLong).contiguous();
  cpu::check_targets(t.data_ptr<int64_t>(), t.numel(), vocab_size, ignore_index);
}

TORCH_LIBRARY_IMPL(flce, CPU, m) {
  m.impl("check_target", &check_target_cpu);
  m.impl("soft_partial_stats", &soft_partial_stats_cpu);
  m.impl("soft_combine", &cpu::soft_combine_cpu);
  m.impl("soft_backward", &soft_backward_cpu);
  m.impl("soft_sum_and_grad", &soft_sum_and_grad_cpu);
  m.impl("partial_stats", &partial_stats_cpu);
  m.impl("forward_argmax", &forward_argmax_cpu);
  m.impl("partial_stats_argmax", &partial_stats_argmax_cpu);
  m.impl("combine", &cpu::combine_cpu);
  m.impl("backward", &backward_cpu);
  m.impl("sum_and_grad", &sum_and_grad_cpu);
  m.impl("scale_grad", &scale_grad_cpu);
  m.impl("scale_grad_", &scale_grad_inplace_cpu);
}

}  // namespace flce
