#include "cpu/tile_gemm.h"

#include <dlfcn.h>

namespace flce::cpu {
namespace {

// CBLAS enums (values fixed by the CBLAS standard).
constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

// MKL ILP64 vs LP64: torch's MKL is LP64 (int indices). These prototypes are MKL's.
using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                          int, float, float*, int);
using lowp_gemm_fn = void (*)(int, int, int, int, int, int, float, const void*, int, const void*,
                              int, float, float*, int);

struct Blas {
  sgemm_fn sgemm = nullptr;
  lowp_gemm_fn bf16 = nullptr;
  lowp_gemm_fn f16 = nullptr;
};

// Resolve the BLAS torch itself links (MKL on x86-64 wheels) from the already loaded
// libtorch_cpu; nothing is loaded that was not there.
const Blas& blas() {
  static const Blas b = [] {
    Blas r;
    void* h = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (h == nullptr) h = RTLD_DEFAULT;
    r.sgemm = reinterpret_cast<sgemm_fn>(dlsym(h, "cblas_sgemm"));
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

}  // namespace

void gemm_f32out(at::ScalarType dtype, int64_t m, int64_t n, int64_t k, float alpha,
                 GemmOperand a, GemmOperand b, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  at::Tensor cv = at::from_blob(c, {m, n}, {ldc, 1}, at::TensorOptions().dtype(at::kFloat));
  if (k == 0) {
    // BLAS leaves C untouched for k = 0 only when beta = 1; be explicit.
    if (beta == 0.f) cv.zero_(); else cv.mul_(beta);
    return;
  }
  const Blas& bl = blas();
  const bool ints = fits_int(m) && fits_int(n) && fits_int(k) && fits_int(a.ld) &&
                    fits_int(b.ld) && fits_int(ldc);
  const int ta = a.trans ? kTrans : kNoTrans;
  const int tb = b.trans ? kTrans : kNoTrans;
  if (ints) {
    if (dtype == at::kFloat && bl.sgemm) {
      bl.sgemm(kRowMajor, ta, tb, int(m), int(n), int(k), alpha,
               static_cast<const float*>(a.ptr), int(a.ld), static_cast<const float*>(b.ptr),
               int(b.ld), beta, c, int(ldc));
      return;
    }
    lowp_gemm_fn f = dtype == at::kBFloat16 ? bl.bf16 : dtype == at::kHalf ? bl.f16 : nullptr;
    if (f) {
      f(kRowMajor, ta, tb, int(m), int(n), int(k), alpha, a.ptr, int(a.ld), b.ptr, int(b.ld),
        beta, c, int(ldc));
      return;
    }
  }
  // Portable path: fp32 operands (a tile-sized conversion for bf16/fp16), ATen's fp32 matmul.
  at::Tensor av = operand_view(a, m, k, dtype).to(at::kFloat);
  at::Tensor bv = operand_view(b, k, n, dtype).to(at::kFloat);
  if (beta == 0.f) {
    at::mm_out(cv, av, bv);
    if (alpha != 1.f) cv.mul_(alpha);
  } else {
    cv.mul_(beta).addmm_(av, bv, 1.0, alpha);
  }
}

}  // namespace flce::cpu
