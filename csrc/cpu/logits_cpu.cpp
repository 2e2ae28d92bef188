// Cross-entropy on given logits, CPU backend (flce::logits_stats, logits_forward,
// logits_backward, logits_backward_; schemas in ops_def.h).
//
// The logits are read in their own dtype (fp32, bf16 or fp16), one chunk of kChunk columns of a
// row at a time: widened to fp32 into a worker's scratch with the softcap and temperature
// applied (the chunk stays in L1), then folded into the row's statistics (the forward: one read
// of the logits) or turned into the gradient and stored in the logits' dtype (the backward: one
// read and one write, over the logits themselves for logits_backward_). Memory beyond the
// gradient: the per-row statistics and a chunk per worker. The math is flce/math.h's, as in the
// fused linear ops: the same RowState and fold_row (cpu/rows.h), the same row_grad.
//
// Workers (cpu/workers.h) own contiguous ranges of rows, so every row's sums run in one fixed
// order: bitwise reproducible for a given worker count.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "cpu/epilogue.h"
#include "cpu/rows.h"
#include "cpu/workers.h"
#include "flce/math.h"
#include "flce_ops.h"

namespace flce::cpu {
namespace {

// Columns per chunk: 16 KiB of fp32 scratch.
constexpr int64_t kChunk = 4096;
// Rows per unit of the row split.
constexpr int64_t kRowAlign = 4;

Dtype dtype_of(at::ScalarType t) {
  return t == at::kFloat ? Dtype::f32 : t == at::kBFloat16 ? Dtype::bf16 : Dtype::f16;
}

// The logits as the loops read them: a row-major view with unit column stride.
struct Logits {
  const char* base;
  int64_t n, v, ld;  // ld: row stride in elements
  int64_t es;        // element size
  Dtype dtype;
  float cap, temp;

  explicit Logits(const at::Tensor& z, double softcap, double temperature)
      : base(static_cast<const char*>(z.data_ptr())), n(z.size(0)), v(z.size(1)),
        ld(z.size(0) > 1 ? z.stride(0) : z.size(1)), es(z.element_size()),
        dtype(dtype_of(z.scalar_type())), cap(static_cast<float>(softcap)),
        temp(static_cast<float>(temperature)) {}

  // z = softcap(u) / T of row i, columns [c0, c0 + cn), into buf (fp32).
  void load(int64_t i, int64_t c0, int64_t cn, float* buf) const {
    row_scale(buf, base + (i * ld + c0) * es, dtype, cn, 1.f);
    if (cap > 0.f || temp != 1.f) row_bias_softcap(buf, nullptr, cn, cap, temp);
  }
};

// Each worker's rows, in a fixed order.
template <typename F>
void for_rows(int64_t n, F f) {
  const int64_t workers = num_workers((n + kRowAlign - 1) / kRowAlign);
  run_workers(workers, [&](int64_t w) {
    const Span rows = split(n, workers, w, kRowAlign);
    std::vector<float> buf(kChunk);
    for (int64_t i = rows.begin; i < rows.end; ++i) f(i, buf.data());
  });
}

// logits_stats, and with `argmax` ([N] int64) each row's RowState::arg. Without the logit sum
// and the entropy's u (with_sum, with_entropy: ops_def.h lets them be 0) a chunk takes two
// vector passes after its widening (max, sum of exponentials) instead of three with a product
// more per column (fold_row's loss_only).
at::Tensor logits_stats_impl(const at::Tensor& logits, const at::Tensor& target,
                             int64_t vocab_start, int64_t ignore_index, double softcap,
                             double temperature, bool with_sum, bool with_entropy,
                             at::Tensor* argmax) {
  check_logits_args(logits, target);
  const Logits z(logits, softcap, temperature);
  const at::Tensor tgt = target.contiguous();
  const int64_t* t = tgt.data_ptr<int64_t>();
  at::Tensor out = at::empty({z.n, kPartialCols}, logits.options().dtype(at::kFloat));
  float* st = out.data_ptr<float>();
  int64_t* arg = nullptr;
  if (argmax) {
    *argmax = at::empty({z.n}, tgt.options());
    arg = argmax->data_ptr<int64_t>();
  }
  const bool loss_only = !with_sum && !with_entropy;
  for_rows(z.n, [&](int64_t i, float* buf) {
    RowState row;
    const int64_t tl = shard_col(t[i], vocab_start, ignore_index);
    for (int64_t c0 = 0; c0 < z.v; c0 += kChunk) {
      const int64_t cn = std::min(kChunk, z.v - c0);
      z.load(i, c0, cn, buf);
      fold_row(buf, cn, tl < 0 ? -1 : tl - c0, row, loss_only, arg ? vocab_start + c0 : -1);
    }
    row.store(st + i * kPartialCols);
    if (arg) arg[i] = row.arg;
  });
  return out;
}

at::Tensor logits_stats_cpu(const at::Tensor& logits, const at::Tensor& target,
                            int64_t vocab_start, int64_t ignore_index, double softcap,
                            double temperature, bool with_sum, bool with_entropy) {
  return logits_stats_impl(logits, target, vocab_start, ignore_index, softcap, temperature,
                           with_sum, with_entropy, nullptr);
}

Tensor4 logits_forward_cpu(const at::Tensor& logits, const at::Tensor& target,
                           int64_t ignore_index, double label_smoothing, double z_loss,
                           double softcap, double temperature, bool with_entropy,
                           bool /*inplace_backward: autograd's*/) {
  const at::Tensor partials = logits_stats_cpu(logits, target, 0, ignore_index, softcap,
                                               temperature, label_smoothing != 0.0, with_entropy);
  return combine_cpu(partials.unsqueeze(0), target, logits.size(1), ignore_index, label_smoothing,
                     z_loss);
}

std::tuple<at::Tensor, at::Tensor> logits_stats_argmax_cpu(
    const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
    int64_t ignore_index, double softcap, double temperature, bool with_sum,
    bool with_entropy) {
  at::Tensor argmax;
  at::Tensor partials = logits_stats_impl(logits, target, vocab_start, ignore_index, softcap,
                                          temperature, with_sum, with_entropy, &argmax);
  return {partials, argmax};
}

// ops_def.h logits_forward_argmax: logits_forward's outputs and the column of each row's largest
// non-target logit (RowState::arg).
Tensor5 logits_forward_argmax_cpu(const at::Tensor& logits, const at::Tensor& target,
                                  int64_t ignore_index, double label_smoothing, double z_loss,
                                  double softcap, double temperature, bool with_entropy,
                                  bool /*inplace_backward: autograd's*/) {
  at::Tensor argmax;
  const at::Tensor partials = logits_stats_impl(logits, target, 0, ignore_index, softcap,
                                                temperature, label_smoothing != 0.0,
                                                with_entropy, &argmax);
  auto [loss, lse, stats, ent] = combine_cpu(partials.unsqueeze(0), target, logits.size(1),
                                             ignore_index, label_smoothing, z_loss);
  return {loss, lse, stats, ent, argmax};
}

// The gradient of every row into out (the logits' dtype and layout; out may be the logits).
void logits_grad(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                 const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
                 const at::Tensor& target, const at::Tensor& stats, int64_t vocab_start,
                 int64_t vocab_size, int64_t ignore_index, double label_smoothing, double z_loss,
                 double softcap, double temperature, const at::Tensor& out) {
  check_logits_backward_args(grad_loss, grad_lse, grad_entropy, logits, target, stats);
  const Logits z(logits, softcap, temperature);
  const at::Tensor tgt = target.contiguous(), st = stats.contiguous();
  const at::Tensor g = grad_loss.contiguous();  // an expanded scalar becomes [N]: small
  const at::Tensor gl = grad_lse ? grad_lse->contiguous() : at::Tensor();
  const at::Tensor ge = grad_entropy ? grad_entropy->contiguous() : at::Tensor();
  const int64_t* t = tgt.data_ptr<int64_t>();
  const float* sp = st.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* glp = gl.defined() ? gl.data_ptr<float>() : nullptr;
  const float* gep = ge.defined() ? ge.data_ptr<float>() : nullptr;
  const LossOptions opt{static_cast<float>(label_smoothing), static_cast<float>(z_loss), z.cap,
                        vocab_size, z.temp};
  char* ob = static_cast<char*>(out.data_ptr());
  const int64_t out_ld = z.n > 1 ? out.stride(0) : z.v;
  for_rows(z.n, [&](int64_t i, float* buf) {
    const float* s = sp + kStatsCols * i;  // (m_x, s_x, z_t, u_x)
    const bool ign = row_ignored(t[i], ignore_index);
    const RowGrad rg = row_grad(OnlineLse{s[0], s[1], s[3]}, s[2], ign, gp[i],
                                glp ? glp[i] : 0.f, opt, gep ? gep[i] : 0.f);
    const int64_t tl = ign ? -1 : t[i] - vocab_start;
    for (int64_t c0 = 0; c0 < z.v; c0 += kChunk) {
      const int64_t cn = std::min(kChunk, z.v - c0);
      z.load(i, c0, cn, buf);
      const int64_t tc = tl - c0;
      const bool has_t = tl >= 0 && tc >= 0 && tc < cn;
      const float z_target = has_t ? buf[tc] : 0.f;
      row_grad_fill(buf, cn, rg, z.cap, z.temp);
      if (has_t) buf[tc] = rg.dz_t * logit_transform_grad(z_target, z.cap, z.temp);
      row_store(buf, ob + (i * out_ld + c0) * z.es, z.dtype, cn);
    }
  });
}

at::Tensor logits_backward_cpu(const at::Tensor& grad_loss,
                               const std::optional<at::Tensor>& grad_lse,
                               const std::optional<at::Tensor>& grad_entropy,
                               const at::Tensor& logits, const at::Tensor& target,
                               const at::Tensor& stats, int64_t vocab_start, int64_t vocab_size,
                               int64_t ignore_index, double label_smoothing, double z_loss,
                               double softcap, double temperature) {
  at::Tensor out = at::empty(logits.sizes(), logits.options());
  logits_grad(grad_loss, grad_lse, grad_entropy, logits, target, stats, vocab_start, vocab_size,
              ignore_index, label_smoothing, z_loss, softcap, temperature, out);
  return out;
}

void logits_backward_inplace_cpu(const at::Tensor& grad_loss,
                                 const std::optional<at::Tensor>& grad_lse,
                                 const std::optional<at::Tensor>& grad_entropy,
                                 const at::Tensor& logits, const at::Tensor& target,
                                 const at::Tensor& stats, int64_t vocab_start, int64_t vocab_size,
                                 int64_t ignore_index, double label_smoothing, double z_loss,
                                 double softcap, double temperature) {
  logits_grad(grad_loss, grad_lse, grad_entropy, logits, target, stats, vocab_start, vocab_size,
              ignore_index, label_smoothing, z_loss, softcap, temperature, logits);
}

// Target distributions (soft_logits_stats, soft_logits_backward): as above, with each chunk's
// target weights beside it (rows.h SoftTargets, fold_soft_row).
std::tuple<at::Tensor, at::Tensor> soft_logits_stats_cpu(
    const at::Tensor& logits, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, int64_t vocab_start, int64_t vocab_size,
    int64_t ignore_index, double label_smoothing, double softcap, double temperature) {
  check_soft_logits_args(logits, target, class_weight);
  const Logits z(logits, softcap, temperature);
  std::vector<at::Tensor> keep;
  const SoftTargets y = soft_targets(target, class_weight, z.n, z.v, vocab_start, vocab_size,
                                     ignore_index, label_smoothing, keep);
  at::Tensor out = at::empty({z.n, kSoftCols}, logits.options().dtype(at::kFloat));
  at::Tensor pivot = at::empty({z.n}, logits.options().dtype(at::kLong));
  float* st = out.data_ptr<float>();
  int64_t* pv = pivot.data_ptr<int64_t>();
  for_rows(z.n, [&](int64_t i, float* buf) {
    std::vector<float> yb(std::min(kChunk, z.v));
    SoftRow row = soft_empty();
    for (int64_t c0 = 0; c0 < z.v; c0 += kChunk) {
      const int64_t cn = std::min(kChunk, z.v - c0);
      z.load(i, c0, cn, buf);
      fold_soft_row(buf, y.row(i, c0, cn, yb.data()), cn, vocab_start + c0, row);
    }
    soft_store(row, st + i * kSoftCols);
    pv[i] = row.a;
  });
  return {out, pivot};
}

at::Tensor soft_logits_backward_cpu(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const at::Tensor& stats, const at::Tensor& pivot, const std::optional<at::Tensor>& z_weight,
    int64_t vocab_start, int64_t vocab_size, int64_t ignore_index, double label_smoothing,
    double z_loss, double softcap, double temperature) {
  check_soft_logits_args(logits, target, class_weight);
  check_soft_rows(logits.size(0), grad_loss, grad_lse, grad_entropy, stats, pivot, z_weight);
  const Logits z(logits, softcap, temperature);
  std::vector<at::Tensor> keep;
  const SoftTargets y = soft_targets(target, class_weight, z.n, z.v, vocab_start, vocab_size,
                                     ignore_index, label_smoothing, keep);
  const at::Tensor st = stats.contiguous(), pv = pivot.contiguous();
  const at::Tensor g = grad_loss.contiguous();
  const at::Tensor gl = grad_lse ? grad_lse->contiguous() : at::Tensor();
  const at::Tensor ge = grad_entropy ? grad_entropy->contiguous() : at::Tensor();
  const at::Tensor zw = z_weight ? z_weight->contiguous() : at::Tensor();
  const float* sp = st.data_ptr<float>();
  const int64_t* pp = pv.data_ptr<int64_t>();
  const float* gp = g.data_ptr<float>();
  const float* glp = gl.defined() ? gl.data_ptr<float>() : nullptr;
  const float* gep = ge.defined() ? ge.data_ptr<float>() : nullptr;
  const float* zwp = zw.defined() ? zw.data_ptr<float>() : nullptr;
  const float zl = static_cast<float>(z_loss);
  at::Tensor out = at::empty(logits.sizes(), logits.options());
  char* ob = static_cast<char*>(out.data_ptr());
  const int64_t out_ld = z.n > 1 ? out.stride(0) : z.v;
  for_rows(z.n, [&](int64_t i, float* buf) {
    std::vector<float> yb(std::min(kChunk, z.v));
    const float* s = sp + kSoftCols * i;  // (m_x, s_x, p, u_x, y_a, y_rest, g)
    const RowGrad rg = soft_row_grad(OnlineLse{s[0], s[1], s[3]}, s[2], s[4], s[5],
                                     zwp ? zwp[i] : s[4] + s[5], gp[i], glp ? glp[i] : 0.f, zl,
                                     gep ? gep[i] : 0.f);
    const int64_t al = pp[i] < 0 ? -1 : pp[i] - vocab_start;
    for (int64_t c0 = 0; c0 < z.v; c0 += kChunk) {
      const int64_t cn = std::min(kChunk, z.v - c0);
      z.load(i, c0, cn, buf);
      const int64_t ac = al - c0;
      const bool has_a = al >= 0 && ac >= 0 && ac < cn;
      const float z_pivot = has_a ? buf[ac] : 0.f;
      row_soft_grad_fill(buf, y.row(i, c0, cn, yb.data()), cn, rg, z.cap, z.temp);
      if (has_a) buf[ac] = rg.dz_t * logit_transform_grad(z_pivot, z.cap, z.temp);
      row_store(buf, ob + (i * out_ld + c0) * z.es, z.dtype, cn);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flce, CPU, m) {
  m.impl("soft_logits_stats", &soft_logits_stats_cpu);
  m.impl("soft_logits_backward", &soft_logits_backward_cpu);
  m.impl("logits_stats", &logits_stats_cpu);
  m.impl("logits_forward", &logits_forward_cpu);
  m.impl("logits_forward_argmax", &logits_forward_argmax_cpu);
  m.impl("logits_stats_argmax", &logits_stats_argmax_cpu);
  m.impl("logits_backward", &logits_backward_cpu);
  m.impl("logits_backward_", &logits_backward_inplace_cpu);
}

}  // namespace flce::cpu
