#include "cpu/tile_gemm.h"

#include "cpu/epilogue.h"
#include "cpu/workers.h"

#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/env.h>
#include <dlfcn.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <iterator>
#include <string>

namespace flce::cpu {

// Friend of Rhs: the GEMM reads what prepare() stored.
struct RhsAccess {
  static at::ScalarType dtype(const Rhs& r) { return r.dtype_; }
  static const GemmOperand& src(const Rhs& r) { return r.src_; }
  static int64_t k(const Rhs& r) { return r.k_; }
  static int64_t n(const Rhs& r) { return r.n_; }
  static GemmPath path(const Rhs& r) { return r.path_; }
  // fp32 op(B) from row k0, column block nblk, and its row stride: the packed copy, or the
  // operand itself where it is fp32 and untransposed already.
  static const float* f32(const Rhs& r, int64_t nblk, int64_t k0, int64_t& ldb);
  static const uint16_t* vnni(const Rhs& r) { return r.vnni_.data(); }
};

namespace {

// ---------------------------------------------------------------------------------------------
// blas path
// ---------------------------------------------------------------------------------------------

// CBLAS enums (values fixed by the CBLAS standard).
constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

// MKL ILP64 vs LP64: torch's MKL is LP64 (int indices). These prototypes are MKL's.
using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                          int, float, float*, int);
// cblas_sgemm_compute with neither operand packed: sgemm without alpha (ours is always 1).
using sgemm_compute_fn = void (*)(int, int, int, int, int, int, const float*, int, const float*,
                                  int, float, float*, int);
using lowp_gemm_fn = void (*)(int, int, int, int, int, int, float, const void*, int, const void*,
                              int, float, float*, int);

struct Blas {
  sgemm_fn sgemm = nullptr;
  sgemm_compute_fn sgemm_compute = nullptr;
  lowp_gemm_fn bf16 = nullptr;
  lowp_gemm_fn f16 = nullptr;
};

// Resolve the BLAS torch itself links (MKL on x86-64 wheels) from the already loaded
// libtorch_cpu; nothing is loaded that was not there. torch 2.14's libtorch_cpu exports MKL's
// cblas_sgemm_compute but not cblas_sgemm: the former serves, without ATen's dispatch and
// tensor views in every worker's call (the portable fallback below).
const Blas& blas() {
  static const Blas b = [] {
    Blas r;
    void* h = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (h == nullptr) h = RTLD_DEFAULT;
    r.sgemm = reinterpret_cast<sgemm_fn>(dlsym(h, "cblas_sgemm"));
    r.sgemm_compute = reinterpret_cast<sgemm_compute_fn>(dlsym(h, "cblas_sgemm_compute"));
    r.bf16 = reinterpret_cast<lowp_gemm_fn>(dlsym(h, "cblas_gemm_bf16bf16f32"));
    r.f16 = reinterpret_cast<lowp_gemm_fn>(dlsym(h, "cblas_gemm_f16f16f32"));
    return r;
  }();
  return b;
}

bool fits_int(int64_t x) { return x <= static_cast<int64_t>(INT32_MAX); }

// The op(X) view of a stored row-major matrix as a tensor.
at::Tensor operand_view(const GemmOperand& x, int64_t rows, int64_t cols, at::ScalarType dtype) {
  // op(X) is [rows, cols]; the stored matrix is [rows, cols] or, transposed, [cols, rows].
  auto opts = at::TensorOptions().dtype(dtype);
  void* p = const_cast<void*>(x.ptr);
  if (!x.trans) return at::from_blob(p, {rows, cols}, {x.ld, 1}, opts);
  return at::from_blob(p, {rows, cols}, {1, x.ld}, opts);
}

void gemm_blas(at::ScalarType dtype, int64_t m, int64_t n, int64_t k, GemmOperand a,
               GemmOperand b, float beta, float* c, int64_t ldc) {
  at::Tensor cv = at::from_blob(c, {m, n}, {ldc, 1}, at::TensorOptions().dtype(at::kFloat));
  const Blas& bl = blas();
  const bool ints = fits_int(m) && fits_int(n) && fits_int(k) && fits_int(a.ld) &&
                    fits_int(b.ld) && fits_int(ldc);
  const int ta = a.trans ? kTrans : kNoTrans;
  const int tb = b.trans ? kTrans : kNoTrans;
  if (ints) {
    if (dtype == at::kFloat && bl.sgemm) {
      bl.sgemm(kRowMajor, ta, tb, int(m), int(n), int(k), 1.f, static_cast<const float*>(a.ptr),
               int(a.ld), static_cast<const float*>(b.ptr), int(b.ld), beta, c, int(ldc));
      return;
    }
    if (dtype == at::kFloat && bl.sgemm_compute) {
      bl.sgemm_compute(kRowMajor, ta, tb, int(m), int(n), int(k),
                       static_cast<const float*>(a.ptr), int(a.ld),
                       static_cast<const float*>(b.ptr), int(b.ld), beta, c, int(ldc));
      return;
    }
    lowp_gemm_fn f = dtype == at::kBFloat16 ? bl.bf16 : dtype == at::kHalf ? bl.f16 : nullptr;
    if (f) {
      f(kRowMajor, ta, tb, int(m), int(n), int(k), 1.f, a.ptr, int(a.ld), b.ptr, int(b.ld), beta,
        c, int(ldc));
      return;
    }
  }
  // Portable path: fp32 operands (a tile-sized conversion for bf16/fp16), ATen's fp32 matmul.
  at::Tensor av = operand_view(a, m, k, dtype).to(at::kFloat);
  at::Tensor bv = operand_view(b, k, n, dtype).to(at::kFloat);
  if (beta == 0.f) {
    at::mm_out(cv, av, bv);
  } else {
    cv.addmm_(av, bv);
  }
}

// ---------------------------------------------------------------------------------------------
// onednn path
// ---------------------------------------------------------------------------------------------

// Blocks of C per brgemm call: [MB, NB] with the whole k (in KC chunks). 64 x 64 keeps an fp32
// B block of k = 512 in L2 and spreads the fixed cost of each brgemm call (a kernel lookup
// among it) over twice the work of 32 x 64: the fastest of the block shapes measured
// (docs/cpu-backend.md, "Tiles and GEMMs").
constexpr int64_t MB = 64;
constexpr int64_t NB = 64;
// The kernels accumulate k in registers, one FMA after another; over a long k (dE's k is the
// vocab tile) that sequential fp32 sum loses accuracy (2.2x the ideal error at k = 2048 in
// tests/api/test_accuracy.py). Chunks of KC are summed on their own and added to C: a two-level sum,
// as blocked BLAS GEMMs do (1.2x).
constexpr int64_t KC = 256;

// fp32 operands that are untransposed already are read in place (they need no VNNI pairs or
// transposition; skipping the copy saves its memory, a tile's worth).
bool rhs_direct(at::ScalarType dtype, const GemmOperand& b) {
  return dtype == at::kFloat && !b.trans;
}

}  // namespace

const float* RhsAccess::f32(const Rhs& r, int64_t nblk, int64_t k0, int64_t& ldb) {
  if (rhs_direct(r.dtype_, r.src_)) {
    ldb = r.src_.ld;
    return static_cast<const float*>(r.src_.ptr) + k0 * ldb + nblk * NB;
  }
  ldb = NB;
  return r.f32_.data() + (nblk * r.k_ + k0) * NB;
}

namespace {

float widen(const void* p, at::ScalarType dtype, int64_t i) {
  if (dtype == at::kFloat) return static_cast<const float*>(p)[i];
  if (dtype == at::kHalf) return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
  return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
}

// dst [rows, cols] (row stride ldd) = op(src) [rows, cols] widened to fp32 (or, for bf16, the
// bit patterns copied), in 16 x 16 blocks: a transposed operand's rows are often a power of two
// apart, and a row-by-row gather would then hit one cache set per element.
template <typename T, typename F>
void copy_op(const GemmOperand& src, int64_t rows, int64_t cols, T* dst, int64_t ldd, F convert) {
  constexpr int64_t T16 = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += T16) {
    const int64_t r1 = std::min(rows, r0 + T16);
    for (int64_t c0 = 0; c0 < cols; c0 += T16) {
      const int64_t c1 = std::min(cols, c0 + T16);
      if (src.trans) {
        // Through a 16 x 16 buffer: contiguous reads along the stored rows (op's columns),
        // contiguous writes along dst's rows.
        decltype(convert(0)) buf[T16][T16];
        for (int64_t j = c0; j < c1; ++j) {
          for (int64_t r = r0; r < r1; ++r) buf[j - c0][r - r0] = convert(j * src.ld + r);
        }
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t j = c0; j < c1; ++j) dst[r * ldd + j] = buf[j - c0][r - r0];
        }
      } else {
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t j = c0; j < c1; ++j) dst[r * ldd + j] = convert(r * src.ld + j);
        }
      }
    }
  }
}

#if defined(__x86_64__)
// dst [rows, cols] (row stride ldd) = the transpose of src [cols, rows] (row stride lds), in
// B x B blocks that `block` transposes in registers, an element loop at the edges.
template <int B, typename T, typename Block>
void transpose_by_blocks(const T* src, int64_t lds, T* dst, int64_t ldd, int64_t rows,
                         int64_t cols, Block block) {
  for (int64_t r0 = 0; r0 < rows; r0 += B) {
    int64_t c0 = 0;
    if (r0 + B <= rows) {
      for (; c0 + B <= cols; c0 += B) block(src + c0 * lds + r0, lds, dst + r0 * ldd + c0, ldd);
    }
    for (int64_t r = r0; r < std::min(rows, r0 + B); ++r) {
      for (int64_t c = c0; c < cols; ++c) dst[r * ldd + c] = src[c * lds + r];
    }
  }
}

// SSE2 (the x86-64 baseline) register transposes, 4 x 4 fp32 and 8 x 8 16-bit: several times
// faster than copy_op's element loop; the dC GEMM reads a transposed tile every tile.
void transpose(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
               int64_t cols) {
  transpose_by_blocks<4>(src, lds, dst, ldd, rows, cols,
                         [](const float* s, int64_t ls, float* d, int64_t ld) {
    __m128 x0 = _mm_loadu_ps(s), x1 = _mm_loadu_ps(s + ls);
    __m128 x2 = _mm_loadu_ps(s + 2 * ls), x3 = _mm_loadu_ps(s + 3 * ls);
    _MM_TRANSPOSE4_PS(x0, x1, x2, x3);
    _mm_storeu_ps(d, x0);
    _mm_storeu_ps(d + ld, x1);
    _mm_storeu_ps(d + 2 * ld, x2);
    _mm_storeu_ps(d + 3 * ld, x3);
  });
}

void transpose(const uint16_t* src, int64_t lds, uint16_t* dst, int64_t ldd, int64_t rows,
               int64_t cols) {
  transpose_by_blocks<8>(src, lds, dst, ldd, rows, cols,
                         [](const uint16_t* s, int64_t ls, uint16_t* d, int64_t ld) {
    __m128i x[8], a[8], c[8];
    for (int i = 0; i < 8; ++i) x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i * ls));
    // 16-bit, then 32-bit, then 64-bit interleaves of row pairs: the rows of the transpose.
    for (int i = 0; i < 4; ++i) {
      a[2 * i] = _mm_unpacklo_epi16(x[2 * i], x[2 * i + 1]);
      a[2 * i + 1] = _mm_unpackhi_epi16(x[2 * i], x[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // a[4h..4h+3] -> c[4h..4h+3]
      c[4 * h] = _mm_unpacklo_epi32(a[4 * h], a[4 * h + 2]);
      c[4 * h + 1] = _mm_unpackhi_epi32(a[4 * h], a[4 * h + 2]);
      c[4 * h + 2] = _mm_unpacklo_epi32(a[4 * h + 1], a[4 * h + 3]);
      c[4 * h + 3] = _mm_unpackhi_epi32(a[4 * h + 1], a[4 * h + 3]);
    }
    for (int j = 0; j < 4; ++j) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * j * ld),
                       _mm_unpacklo_epi64(c[j], c[j + 4]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + (2 * j + 1) * ld),
                       _mm_unpackhi_epi64(c[j], c[j + 4]));
    }
  });
}
#else
template <typename T>
void transpose(const T* src, int64_t lds, T* dst, int64_t ldd, int64_t rows, int64_t cols) {
  copy_op(GemmOperand{src, lds, true}, rows, cols, dst, ldd, [src](int64_t i) { return src[i]; });
}
#endif

bool cpu_is_intel() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[13];
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  vendor[12] = '\0';
  return std::strcmp(vendor, "GenuineIntel") == 0;
#else
  return false;
#endif
}

#if defined(__x86_64__)
bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1u);
}

// MKL's instruction-set levels (MKL_ENABLE_INSTRUCTIONS, mkl_enable_instructions), in order.
// bf16 arithmetic starts at AVX512_E3 (AVX512-BF16), AMX at AVX512_E4.
enum class MklIsa {
  sse4_2, avx, avx2, avx2_e1, avx512, avx512_e1, avx512_e2, avx512_e3, avx512_e4, avx512_e5,
  uncapped
};

// The level MKL_ENABLE_INSTRUCTIONS holds MKL at; uncapped where it is unset or names no level
// (MKL then dispatches as it would without it).
MklIsa mkl_isa_cap() {
  const auto isa = c10::utils::get_env("MKL_ENABLE_INSTRUCTIONS");
  if (!isa) return MklIsa::uncapped;
  static constexpr const char* kLevels[] = {"SSE4_2",    "AVX",       "AVX2",      "AVX2_E1",
                                            "AVX512",    "AVX512_E1", "AVX512_E2", "AVX512_E3",
                                            "AVX512_E4", "AVX512_E5"};
  for (size_t i = 0; i < std::size(kLevels); ++i) {
    if (*isa == kLevels[i]) return static_cast<MklIsa>(i);
  }
  return MklIsa::uncapped;
}
#endif

// Whether MKL multiplies bf16 natively here (AVX512-BF16 or AMX-BF16 on an Intel CPU, which is
// where MKL uses them, unless MKL_ENABLE_INSTRUCTIONS holds it below AVX512_E3). Elsewhere it
// widens bf16 to fp32 and runs its fp32 kernels: a bf16 GEMM costs what an fp32 one does
// (measured on the Zen 4 CI machine, natively and with AVX2 emulated).
bool mkl_bf16_native() {
#if defined(__x86_64__)
  if (!cpu_is_intel() || blas().bf16 == nullptr || mkl_isa_cap() < MklIsa::avx512_e3) {
    return false;
  }
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool avx512_bf16 = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1u);
  return cpu_has_amx_bf16() || avx512_bf16;
#else
  return false;
#endif
}

// Whether torch's oneDNN micro-kernels run here (torch built with oneDNN's ukernel API, an
// AVX-512 CPU): a small bf16 product, checked exactly. brgemm raises where they do not.
bool onednn_usable() {
  try {
    constexpr int64_t M = 3, N = 16, K = 4;
    c10::BFloat16 a[M * K], bp[K * N];
    float c[M * N];
    for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<float>(i % 5 - 2);
    for (int64_t r = 0; r < K; ++r) {
      for (int64_t j = 0; j < N; ++j) {
        bp[((r / 2) * N + j) * 2 + r % 2] = static_cast<float>((r + j) % 7 - 3);
      }
    }
    at::native::cpublas::brgemm(M, N, K, K, N, N, false, a, bp, c, true);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        float ref = 0.f;
        for (int64_t r = 0; r < K; ++r) {
          ref += static_cast<float>((i * K + r) % 5 - 2) * static_cast<float>((r + j) % 7 - 3);
        }
        if (c[i * N + j] != ref) return false;
      }
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

GemmPath default_path() {
  const auto env = c10::utils::get_env("FLCE_CPU_GEMM");
  const bool usable = onednn_usable();
  if (env && !env->empty()) {
    if (*env == "blas") return GemmPath::blas;
    TORCH_CHECK_VALUE(*env == "onednn", "flce: FLCE_CPU_GEMM must be 'blas' or 'onednn', got '",
                      *env, "'");
    if (!usable) {
      TORCH_WARN_ONCE("flce: FLCE_CPU_GEMM=onednn, but torch's oneDNN micro-kernels do not run "
                      "on this CPU / torch build; using the BLAS path");
    }
    return usable ? GemmPath::onednn : GemmPath::blas;
  }
  return usable && !cpu_is_intel() ? GemmPath::onednn : GemmPath::blas;
}

// Where the product of a GEMM goes: C (stored, or added to with `accumulate`), or, when `sum`
// is set, scale * product Neumaier-added to (sum, comp).
struct Out {
  float* c = nullptr;
  int64_t ldc = 0;
  bool accumulate = false;
  float* sum = nullptr;
  uint16_t* comp = nullptr;
  float scale = 1.f;
  bool fresh = false;  // KahanOut::fresh: store into the (zero) accumulator

  // Row r of the compensated output += scale * x[0..n) (x is scaled in place).
  void add_row(int64_t r, float* x, int64_t n) const {
    if (scale != 1.f) {
      for (int64_t j = 0; j < n; ++j) x[j] *= scale;
    }
    if (fresh) {
      std::memcpy(sum + r * ldc, x, n * sizeof(float));
    } else {
      row_kahan_add(sum + r * ldc, comp + r * ldc, x, n);
    }
  }
};

// A as the kernels read it: row-major [m, kk] in the compute type (bf16 pairs need an even k),
// copied (transposed, widened or padded) into dst only when needed.
bool lhs_needs_copy(at::ScalarType dtype, int64_t k, int64_t kk, const GemmOperand& a) {
  return a.trans || kk != k || dtype == at::kHalf;
}

const void* lhs_for_kernels(at::ScalarType dtype, int64_t m, int64_t k, int64_t kk,
                            const GemmOperand& a, void* dst, int64_t& lda) {
  lda = a.ld;
  if (!lhs_needs_copy(dtype, k, kk, a)) return a.ptr;
  if (dtype == at::kBFloat16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    const uint16_t* src = static_cast<const uint16_t*>(a.ptr);
    if (a.trans) {
      transpose(src, a.ld, d, kk, m, k);
    } else {
      copy_op(a, m, k, d, kk, [src](int64_t i) { return src[i]; });
    }
    if (kk != k) {
      for (int64_t r = 0; r < m; ++r) d[r * kk + k] = 0;
    }
    lda = kk;
    return d;
  }
  float* d = static_cast<float*>(dst);
  if (dtype == at::kFloat) {
    transpose(static_cast<const float*>(a.ptr), a.ld, d, k, m, k);  // fp32 is copied only to transpose
  } else {
    copy_op(a, m, k, d, k, [&](int64_t i) { return widen(a.ptr, dtype, i); });
  }
  lda = k;
  return d;
}

// Rows [m0, ...) of op(A).
GemmOperand lhs_rows(const GemmOperand& a, int64_t m0, at::ScalarType dtype) {
  const int64_t off = (a.trans ? m0 : m0 * a.ld) * static_cast<int64_t>(at::elementSize(dtype));
  return {static_cast<const char*>(a.ptr) + off, a.ld, a.trans};
}

// Sum over the operands a[0..na) of op(a[i]) @ op(B), into `out`.
void gemm_onednn(at::ScalarType dtype, int64_t m, int64_t n, int64_t k, const GemmOperand* a,
                 int na, const Rhs& b, const Out& out, LhsScratch& scratch) {
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t kk = bf16 ? (k + 1) / 2 * 2 : k;
  int copies = 0;  // scratch only for the operands that are copied
  for (int i = 0; i < na; ++i) copies += lhs_needs_copy(dtype, k, kk, a[i]);
  // Rows [0, rows) of the operands as the kernels read them, copied into the caller's buffers
  // where needed; arow[i] and lda[i] are where (and how) rows start.
  auto lhs = [&](int64_t m0, int64_t rows, std::vector<uint16_t>& b16, std::vector<float>& f32,
                 const void** arow, int64_t* lda) {
    if (bf16) {
      b16.resize(copies * rows * kk);
    } else {
      f32.resize(copies * rows * k);
    }
    for (int i = 0, c = 0; i < na; ++i) {
      void* dst = bf16 ? static_cast<void*>(b16.data() + c * rows * kk)
                       : static_cast<void*>(f32.data() + c * rows * k);
      c += lhs_needs_copy(dtype, k, kk, a[i]);
      arow[i] = lhs_for_kernels(dtype, rows, k, kk, lhs_rows(a[i], m0, dtype), dst, lda[i]);
    }
  };
  const int64_t nbn = (n + NB - 1) / NB;
  // One [mm, nn] block of the product: the sum over operands and k chunks, the first chunk
  // written to dst (or added to it with `add`), the others summed in `part`. arow[i]: the
  // block's first row of operand i.
  auto block = [&](const void* const* arow, const int64_t* lda, int64_t mm, int64_t nblk,
                   float* dst, int64_t ldd, bool add, float* part) {
    const int64_t nn = std::min(NB, n - nblk * NB);
    for (int op = 0; op < na; ++op) {
      for (int64_t k0 = 0; k0 < kk; k0 += KC) {
        const int64_t kc = std::min(KC, kk - k0);
        const bool first = op == 0 && k0 == 0;
        float* c = first ? dst : part;
        const int64_t ldc = first ? ldd : nn;
        if (bf16) {
          // bf16 pairs: chunk k0 (even) starts at pair row k0 / 2.
          const auto* a16 = static_cast<const c10::BFloat16*>(arow[op]) + k0;
          const auto* b16 = reinterpret_cast<const c10::BFloat16*>(RhsAccess::vnni(b)) +
                            (nblk * kk + k0) * NB;
          at::native::cpublas::brgemm(mm, nn, kc, lda[op], NB, ldc, first && add, a16, b16, c,
                                      true);
        } else {
          const float* a32 = static_cast<const float*>(arow[op]) + k0;
          int64_t ldb;
          const float* b32 = RhsAccess::f32(b, nblk, k0, ldb);
          at::native::cpublas::brgemm(mm, nn, kc, lda[op], ldb, ldc, first && add, a32, b32, c,
                                      false);
        }
        if (!first) {
          for (int64_t r = 0; r < mm; ++r) {
            for (int64_t j = 0; j < nn; ++j) dst[r * ldd + j] += part[r * nn + j];
          }
        }
      }
    }
  };
  float part[MB * NB];
  if (out.sum == nullptr) {
    // Column blocks outer: consecutive blocks reuse one B block from cache.
    const void* arow[2];
    int64_t lda[2];
    lhs(0, m, scratch.bf16, scratch.f32, arow, lda);
    const int64_t es = bf16 ? 2 : 4;  // the kernels' element: fp16 operands were widened to fp32
    for (int64_t nblk = 0; nblk < nbn; ++nblk) {
      for (int64_t m0 = 0; m0 < m; m0 += MB) {
        const void* rows[2];
        for (int op = 0; op < na; ++op) {
          rows[op] = static_cast<const char*>(arow[op]) + m0 * lda[op] * es;
        }
        block(rows, lda, std::min(MB, m - m0), nblk, out.c + m0 * out.ldc + nblk * NB, out.ldc,
              out.accumulate, part);
      }
    }
    return;
  }
  // Compensated output, by row panels, so that the adds run along full rows of the
  // accumulators (a [64, 64] block at a time would hit them in scattered pieces). The panel's
  // rows of A are copied where they need a copy (the transposed gradient tile of the dC GEMM):
  // a panel at a time, while in cache, and never the whole operand.
  scratch.panel.resize(MB * n);  // [mm, n]
  for (int64_t m0 = 0; m0 < m; m0 += MB) {
    const int64_t mm = std::min(MB, m - m0);
    const void* arow[2];
    int64_t lda[2];
    lhs(m0, mm, scratch.bf16, scratch.f32, arow, lda);
    for (int64_t nblk = 0; nblk < nbn; ++nblk) {
      block(arow, lda, mm, nblk, scratch.panel.data() + nblk * NB, n, false, part);
    }
    for (int64_t r = 0; r < mm; ++r) out.add_row(m0 + r, scratch.panel.data() + r * n, n);
  }
}

// The blas path of gemm_accumulate: the product in a scratch tile, then the compensated adds;
// into a fresh accumulator, the product straight into its sums.
void accumulate_blas(at::ScalarType dtype, int64_t m, int64_t n, int64_t k,
                     const GemmOperand* a, int na, GemmOperand b, const Out& out,
                     LhsScratch& scratch) {
  if (!out.fresh) scratch.panel.resize(m * n);
  float* prod = out.fresh ? out.sum : scratch.panel.data();
  const int64_t ld = out.fresh ? out.ldc : n;
  for (int i = 0; i < na; ++i) gemm_blas(dtype, m, n, k, a[i], b, i == 0 ? 0.f : 1.f, prod, ld);
  if (out.fresh) {
    if (out.scale == 1.f) return;
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < n; ++j) prod[r * ld + j] *= out.scale;
    }
    return;
  }
  for (int64_t r = 0; r < m; ++r) out.add_row(r, prod + r * n, n);
}

}  // namespace

bool bf16_gemm_amx() {
#if defined(__x86_64__)
  if (!cpu_has_amx_bf16() || mkl_isa_cap() < MklIsa::avx512_e4) return false;
  // oneDNN's AMX levels carry "AMX" in their names.
  const auto isa = c10::utils::get_env("ONEDNN_MAX_CPU_ISA");
  return !isa || isa->empty() || isa->find("AMX") != std::string::npos || *isa == "ALL" ||
         *isa == "DEFAULT";
#else
  return false;
#endif
}

Bf16Grad bf16_grad(std::optional<bool> exact) {
  if (exact.has_value() && !*exact) return Bf16Grad::rounded;
  if (!exact.has_value()) return bf16_gemm_native() ? Bf16Grad::rounded : Bf16Grad::widened;
  const auto env = c10::utils::get_env("FLCE_CPU_BF16_EXACT");
  if (env && !env->empty()) {
    TORCH_CHECK_VALUE(*env == "split" || *env == "widened",
                      "flce: FLCE_CPU_BF16_EXACT must be 'split' or 'widened', got '", *env, "'");
    return *env == "split" ? Bf16Grad::split : Bf16Grad::widened;
  }
  return bf16_gemm_amx() ? Bf16Grad::split : Bf16Grad::widened;
}

const char* bf16_grad_name(Bf16Grad g) {
  return g == Bf16Grad::rounded ? "rounded" : g == Bf16Grad::split ? "split" : "widened";
}

bool bf16_gemm_native() {
  static const bool mkl = mkl_bf16_native();
  return gemm_path(at::kBFloat16) == GemmPath::onednn || mkl;
}

GemmPath gemm_path(at::ScalarType dtype) {
  (void)dtype;  // one choice for every dtype: fp16 runs the fp32 kernels on the onednn path
  static const GemmPath p = default_path();
  if (p == GemmPath::onednn && !at::globalContext().userEnabledMkldnn()) return GemmPath::blas;
  return p;
}

void Rhs::prepare(at::ScalarType dtype, GemmOperand b, int64_t k, int64_t n) {
  const GemmPath path = gemm_path(dtype);
  if (dtype == dtype_ && path == path_ && k == k_ && n == n_ && b.ptr == src_.ptr &&
      b.ld == src_.ld && b.trans == src_.trans) {
    return;
  }
  dtype_ = dtype;
  path_ = path;
  src_ = b;
  k_ = k;
  n_ = n;
  if (path != GemmPath::onednn) return;
  if (rhs_direct(dtype, b)) {  // the kernels read it in place: no copy
    f32_ = {};
    return;
  }
  // Column blocks of NB, each contiguous: a B block stays in L2 while the GEMM sweeps the row
  // blocks of A, where a power-of-two row stride (a weight tile's) would map it to a few sets.
  const int64_t blocks = (n + NB - 1) / NB;
  if (dtype == at::kBFloat16) {
    // Block: [ceil(k / 2), NB, 2], rows 2p and 2p + 1 of op(B) interleaved, zero past an odd k.
    const int64_t kk = (k + 1) / 2 * 2;
    vnni_.assign(blocks * kk * NB, 0);
    uint16_t* dst = vnni_.data();
    const uint16_t* src = static_cast<const uint16_t*>(b.ptr);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t n0 = blk * NB, nn = std::min(NB, n - n0);
      uint16_t* out = dst + blk * kk * NB;
      // Read along the stored rows: op(B)'s columns when transposed, else its rows.
      if (b.trans) {
        for (int64_t j = 0; j < nn; ++j) {
          const uint16_t* col = src + (n0 + j) * b.ld;
          for (int64_t r = 0; r < k; ++r) out[((r / 2) * NB + j) * 2 + r % 2] = col[r];
        }
      } else {
        for (int64_t r = 0; r < k; ++r) {
          const uint16_t* row = src + r * b.ld + n0;
          for (int64_t j = 0; j < nn; ++j) out[((r / 2) * NB + j) * 2 + r % 2] = row[j];
        }
      }
    }
    return;
  }
  f32_.assign(blocks * k * NB, 0.f);
  float* dst = f32_.data();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n0 = blk * NB, nn = std::min(NB, n - n0);
    const GemmOperand sub{static_cast<const char*>(b.ptr) +
                              (b.trans ? n0 * b.ld : n0) * at::elementSize(dtype),
                          b.ld, b.trans};
    if (dtype == at::kFloat) {
      const float* src = static_cast<const float*>(sub.ptr);
      if (sub.trans) {
        transpose(src, sub.ld, dst + blk * k * NB, NB, k, nn);
      } else {
        copy_op(sub, k, nn, dst + blk * k * NB, NB, [src](int64_t i) { return src[i]; });
      }
    } else {
      copy_op(sub, k, nn, dst + blk * k * NB, NB,
              [&](int64_t i) { return widen(sub.ptr, dtype, i); });
    }
  }
}

namespace {

bool check_empty(const Rhs& b, at::ScalarType dtype, int64_t m, int64_t n, int64_t k) {
  TORCH_INTERNAL_ASSERT(RhsAccess::k(b) == k && RhsAccess::n(b) == n &&
                        RhsAccess::dtype(b) == dtype, "flce: tile GEMM operand not prepared");
  return m == 0 || n == 0;
}

}  // namespace

void gemm_f32out(at::ScalarType dtype, int64_t m, int64_t n, int64_t k, GemmOperand a,
                 const Rhs& b, bool accumulate, float* c, int64_t ldc, LhsScratch& scratch) {
  if (check_empty(b, dtype, m, n, k)) return;
  if (k == 0) {
    if (!accumulate) {
      at::from_blob(c, {m, n}, {ldc, 1}, at::TensorOptions().dtype(at::kFloat)).zero_();
    }
    return;
  }
  if (RhsAccess::path(b) == GemmPath::onednn) {
    Out out;
    out.c = c;
    out.ldc = ldc;
    out.accumulate = accumulate;
    gemm_onednn(dtype, m, n, k, &a, 1, b, out, scratch);
  } else {
    gemm_blas(dtype, m, n, k, a, RhsAccess::src(b), accumulate ? 1.f : 0.f, c, ldc);
  }
}

void gemm_accumulate(at::ScalarType dtype, int64_t m, int64_t n, int64_t k,
                     const GemmOperand* a, int num_a, const Rhs& b, float scale,
                     KahanOut acc, LhsScratch& scratch) {
  TORCH_INTERNAL_ASSERT(num_a == 1 || num_a == 2);
  if (check_empty(b, dtype, m, n, k) || k == 0) return;
  Out out;
  out.ldc = acc.ld;
  out.sum = acc.sum;
  out.comp = acc.comp;
  out.scale = scale;
  out.fresh = acc.fresh;
  if (RhsAccess::path(b) == GemmPath::onednn) {
    gemm_onednn(dtype, m, n, k, a, num_a, b, out, scratch);
  } else {
    accumulate_blas(dtype, m, n, k, a, num_a, RhsAccess::src(b), out, scratch);
  }
}

at::Tensor gemm_benchmark(const at::Tensor& a, const at::Tensor& b, bool trans_a,
                          bool trans_b) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous(),
                    "flce: cpu_tile_gemm takes contiguous 2-D a and b");
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu(), "flce: cpu_tile_gemm is CPU-only");
  const auto dtype = a.scalar_type();
  TORCH_CHECK_VALUE(dtype == b.scalar_type() &&
                        (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
                    "flce: cpu_tile_gemm takes a and b of one dtype: float32, bfloat16 or float16");
  const int64_t m = a.size(trans_a ? 1 : 0), k = a.size(trans_a ? 0 : 1);
  const int64_t n = b.size(trans_b ? 0 : 1);
  TORCH_CHECK_VALUE(b.size(trans_b ? 1 : 0) == k, "flce: cpu_tile_gemm: op(a) is [", m, ", ", k,
                    "] but op(b) is [", b.size(trans_b ? 1 : 0), ", ", n, "]");
  at::Tensor c = at::empty({m, n}, a.options().dtype(at::kFloat));
  constexpr int64_t kRows = 256;
  const int64_t es = a.element_size();
  const char* ap = static_cast<const char*>(a.data_ptr());
  const char* bp = static_cast<const char*>(b.data_ptr());
  float* cp = c.data_ptr<float>();
  const bool split_rows = trans_a;
  const int64_t workers = num_workers(split_rows ? (m + MB - 1) / MB : (n + NB - 1) / NB);
  run_workers(workers, [&](int64_t w) {
    const Span rows = split_rows ? split(m, workers, w, MB) : Span{0, m};
    const Span cols = split_rows ? Span{0, n} : split(n, workers, w, NB);
    if (rows.size() == 0 || cols.size() == 0) return;
    Rhs rhs;
    LhsScratch scratch;
    rhs.prepare(dtype,
                GemmOperand{bp + (trans_b ? cols.begin * k : cols.begin) * es, trans_b ? k : n,
                            trans_b},
                k, cols.size());
    for (int64_t r0 = rows.begin; r0 < rows.end; r0 += kRows) {
      const int64_t rr = std::min(kRows, rows.end - r0);
      const GemmOperand lhs{ap + (trans_a ? r0 : r0 * k) * es, trans_a ? m : k, trans_a};
      gemm_f32out(dtype, rr, cols.size(), k, lhs, rhs, false, cp + r0 * n + cols.begin, n,
                  scratch);
    }
  });
  return c;
}

}  // namespace flce::cpu
