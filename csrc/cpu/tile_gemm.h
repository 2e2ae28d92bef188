// Tile GEMMs with fp32 results for the CPU backend: C[m, n] = alpha op(A) op(B) + beta C.
//
// A and B are row-major float, bfloat16 or float16; C is always float32. bf16/fp16 operands use
// the BLAS mixed-precision GEMMs (MKL's cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32, AMX or
// AVX-512 BF16/FP16 where the CPU has them) when the BLAS that torch links exports them;
// otherwise the tile is converted to fp32 and multiplied with ATen's fp32 matmul. Either way the
// products and their accumulation are fp32: logits are never rounded to the input dtype.
#pragma once

#include <ATen/ATen.h>

namespace flce::cpu {

struct GemmOperand {
  const void* ptr;
  int64_t ld;  // row stride of the stored (untransposed) row-major matrix
  bool trans;  // use the stored matrix transposed
};

// C [m, n] (row-major, leading dimension ldc) = alpha * op(A) [m, k] @ op(B) [k, n] + beta * C.
void gemm_f32out(at::ScalarType dtype, int64_t m, int64_t n, int64_t k, float alpha,
                 GemmOperand a, GemmOperand b, float beta, float* c, int64_t ldc);

}  // namespace flce::cpu
