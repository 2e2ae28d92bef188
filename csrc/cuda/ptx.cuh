// Thin wrappers over the sm_80 PTX the tile kernels use: cp.async (global -> shared, bypassing
// registers), ldmatrix (shared -> mma fragments) and mma.sync m16n8k16 with fp32 accumulators.
// Under the host emulation (no __CUDACC__) each instruction calls its host implementation in
// csrc/cuda/host (same operands, same fragment layouts).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device.cuh"

namespace flce {
namespace cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; valid = false zero-fills the destination without reading src (src must
// still be a mapped address, callers pass the tensor base).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
#if defined(__CUDACC__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
#else
  ::flce::host::ptx::cp_async_cg_16(dst, src, src_bytes);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDACC__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
  ::flce::host::ptx::cp_async_commit_group();
#endif
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDACC__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#else
  ::flce::host::ptx::cp_async_wait_group(kPending);
#endif
}

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDACC__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  ::flce::host::ptx::ldmatrix_x4(r, addr);
#endif
}

// d += a * b for one tile: A row-major [16, k], B "col" ([8 n][k], k contiguous); k = 16 for
// bf16/fp16 (m16n8k16), 8 for TF32 (m16n8k8, operands are fp32 bit patterns rounded to TF32).
template <typename T>
__device__ __forceinline__ void mma_step(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);

template <>
__device__ __forceinline__ void mma_step<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDACC__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  ::flce::host::ptx::mma_m16n8k16_bf16(d, a, b0, b1);
#endif
}

template <>
__device__ __forceinline__ void mma_step<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
#if defined(__CUDACC__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  ::flce::host::ptx::mma_m16n8k16_f16(d, a, b0, b1);
#endif
}

template <>
__device__ __forceinline__ void mma_step<float>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1) {
#if defined(__CUDACC__)
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  ::flce::host::ptx::mma_m16n8k8_tf32(d, a, b0, b1);
#endif
}

// Fragments as loaded by ldmatrix -> mma operands: 16-bit types are used as is; fp32 is rounded
// to TF32 (nearest, ties away, as cuBLAS does) instead of letting the mma truncate.
template <typename T>
__device__ __forceinline__ void to_mma_operand(uint32_t (&)[4]) {}

template <>
__device__ __forceinline__ void to_mma_operand<float>(uint32_t (&r)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#if defined(__CUDACC__)
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r[i]) : "f"(__uint_as_float(r[i])));
#else
    r[i] = ::flce::host::ptx::cvt_rna_tf32(__uint_as_float(r[i]));
#endif
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}

}  // namespace cuda
}  // namespace flce
