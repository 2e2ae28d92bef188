// Tile GEMMs with fp32 results for the CPU backend: C[m, n] (+)= op(A) op(B).
//
// A and B are row-major float, bfloat16 or float16; C is always float32: logits are never
// rounded to the input dtype. Every call runs on the calling thread only: the backend's workers
// (cpu/workers.h) each multiply their own tiles, inside one parallel region per op phase. Two
// paths, picked once per process (gemm_path()):
//
// - onednn: oneDNN's batch-reduce GEMM micro-kernels as torch exports them
//   (at::native::cpublas::brgemm: JIT-generated AVX-512 BF16 / AVX-512 / AVX2 kernels with fp32
//   accumulation). flce cuts the tile into [MB, NB] blocks and packs the right operand once
//   into column blocks that the kernels read contiguously (fp32 [n / NB, k, NB], bf16 pairs
//   [n / NB, k / 2, NB, 2]); fp16 operands are widened to fp32 (exactly) on the way.
// - blas: the BLAS torch links (MKL on x86-64 wheels: cblas_sgemm, cblas_gemm_bf16bf16f32,
//   cblas_gemm_f16f16f32, with AMX where the CPU has it), or ATen's fp32 matmul where the BLAS
//   lacks the mixed-precision GEMMs.
//
// Why two: MKL's GEMMs are the fastest there are on Intel CPUs (AMX bf16), but elsewhere MKL
// runs generic code, well below oneDNN's kernels (on a Zen 4 about 0.6x their rate in fp32 and
// a third in bf16). The default is blas on Intel CPUs and onednn elsewhere where torch's oneDNN
// kernels work; FLCE_CPU_GEMM=blas|onednn overrides it (docs/cpu-backend.md, "Tiles and GEMMs").
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace flce::cpu {

struct GemmOperand {
  const void* ptr;
  int64_t ld;  // row stride of the stored (untransposed) row-major matrix
  bool trans;  // use the stored matrix transposed
};

enum class GemmPath { blas, onednn };

// The path the tile GEMMs of `dtype` take now (process-wide choice, and torch.backends.mkldnn's
// current setting: with oneDNN disabled the blas path runs).
GemmPath gemm_path(at::ScalarType dtype);

// Whether bf16 x bf16 -> fp32 tile GEMMs run natively here: on the onednn path (its bf16 kernels
// need AVX512-BF16 or AMX), and on the blas path where MKL has them (Intel CPUs with
// AVX512-BF16 / AMX). Elsewhere a bf16 GEMM widens to fp32 and costs an fp32 one. Reported
// (flce.build_info()["cpu_bf16_native"]); it decides the default of the backward's bf16
// gradient tiles (bf16_grad).
bool bf16_gemm_native();

// Whether the tile GEMMs multiply bf16 on AMX here: a CPU with AMX-BF16, and neither MKL nor
// oneDNN held below it (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA: benchmarks/bench.py --isa
// avx2 sets both). There a bf16 tile GEMM costs about a sixth of an fp32 one (~1 TFLOP/s per
// core on a Xeon), so the recompute path's extra logit GEMM is cheap. Reads cpuid and the
// environment only: `import flce` asks (flce.build_info()["cpu_amx"]).
bool bf16_gemm_amx();

// How the backward multiplies a bf16 gradient tile G (fp32, from fp32 logits) by its operands
// (docs/numerics.md):
//   rounded  G rounded once to bf16, bf16 GEMMs with fp32 accumulation, as the CUDA backend
//            does: dE and dW within 1.5x bf16's rounding floor (norm-wise), 2 GEMMs per tile
//            (an fp32 dW of master weights takes hi + lo, as CUDA's: flce_cpu.cpp GradPass);
//   split    G = hi + lo, two bf16 tiles (~16 mantissa bits), 4 bf16 GEMMs: at the floor;
//   widened  fp32 GEMMs on fp32 copies of the bf16 operands: at the floor, at fp32's cost.
// `exact` is the caller's exact_bf16_grad. Unset: rounded wherever bf16 GEMMs run natively
// (bf16_gemm_native: AMX, AVX512-BF16), as on CUDA, where a bf16 GEMM costs at most half an
// fp32 one and the exact step would run at fp32's rate; widened where bf16 is widened to fp32
// anyway (there the rounded tile saves no GEMM time). true: split on AMX (a bf16 GEMM ~1/6 of
// an fp32 one), widened elsewhere (AVX512-BF16's vdpbf16ps does at most twice an FMA's work,
// so the split's 4 bf16 GEMMs cost at least 2 fp32 ones); FLCE_CPU_BF16_EXACT=split|widened
// picks either on any CPU (read at every call). false: rounded on any CPU. The one place this
// rule lives: the backward, the single pass and flce.build_info() ask here.
enum class Bf16Grad { rounded, split, widened };
Bf16Grad bf16_grad(std::optional<bool> exact);
const char* bf16_grad_name(Bf16Grad g);

// The right operand op(B) [k, n] of a tile GEMM, ready for the path: on the onednn path a packed
// copy (except an untransposed fp32 operand, read in place), on the blas path the operand
// itself. prepare() repacks only when the operand or the shape changed since its last call, so
// a weight tile packed once serves every row block. The key is the pointer, not the data:
// callers keep one Rhs per role for the duration of one op call, over inputs that do not change.
class Rhs {
 public:
  void prepare(at::ScalarType dtype, GemmOperand b, int64_t k, int64_t n);

 private:
  friend struct RhsAccess;
  at::ScalarType dtype_ = at::kFloat;
  GemmOperand src_{nullptr, 0, false};
  int64_t k_ = -1, n_ = -1;
  GemmPath path_ = GemmPath::blas;
  std::vector<float> f32_;      // onednn, fp32 compute: [ceil(n / NB), k, NB]
  std::vector<uint16_t> vnni_;  // onednn, bf16: [ceil(n / NB), ceil(k / 2), NB, 2] bit patterns
};

// Copies of the left operands that the onednn path makes (transposed, widened or padded), and
// the product panel of a compensated GEMM; each worker owns one, released with the op.
struct LhsScratch {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<float> panel;
};

// C [m, n] (row-major, leading dimension ldc) = op(A) [m, k] @ op(B) [k, n], plus C when
// `accumulate`; op(B) prepared by b.prepare(dtype, ..., k, n).
void gemm_f32out(at::ScalarType dtype, int64_t m, int64_t n, int64_t k, GemmOperand a,
                 const Rhs& b, bool accumulate, float* c, int64_t ldc, LhsScratch& scratch);

// A gradient accumulator: fp32 sums and their compensations (bf16 bit patterns, see
// flce/math.h kahan_add_bf16c), rows `ld` apart.
struct KahanOut {
  float* sum;
  uint16_t* comp;
  int64_t ld;
  // The accumulator is zero (sums and compensations) and this is its first add: the product is
  // stored into the sums instead, which is what a compensated add into zero gives (sum = x,
  // comp = 0, exactly), without reading the accumulator or, on the blas path, writing the
  // product to a scratch tile first.
  bool fresh = false;
};

// op(a) @ op(b) in fp32 [m, n] on this engine, for benchmarks' floors (benchmarks/_peers.py
// gemm3-flce; op flce::cpu_tile_gemm): a and b contiguous, both fp32, bf16 or fp16, a stored
// [m, k] ([k, m] when trans_a), b [k, n] ([n, k] when trans_b). Workers split the columns of
// the product and prepare only their slice of b, or, where op(a) must be copied (transposed),
// split its rows (each worker then prepares all of b); rows are multiplied 256 at a time
// (the tiles' height), as the ops multiply their tiles.
at::Tensor gemm_benchmark(const at::Tensor& a, const at::Tensor& b, bool trans_a, bool trans_b);

// (sum, comp) [m, n] += scale * sum_i op(A_i) [m, k] @ op(B) [k, n], one compensated add per
// element: a[0..num_a) is one operand, or the two bf16 halves (hi, lo) of a split fp32 tile. On
// the onednn path each [MB, NB] block's product is added while it is in L1, with no [m, n]
// product tile in memory.
void gemm_accumulate(at::ScalarType dtype, int64_t m, int64_t n, int64_t k,
                     const GemmOperand* a, int num_a, const Rhs& b, float scale,
                     KahanOut acc, LhsScratch& scratch);

}  // namespace flce::cpu
