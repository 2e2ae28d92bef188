// Logit-tile mainloops (kernel traits + code). Each Tile type computes the raw dot products
// acc[r, c] = input[m0 + r] . weight[n0 + c] of one [kBlockN, kBlockV] tile in fp32 and leaves
// them in shared memory (`epi`, row stride kEpiLd floats) for an epilogue that applies bias and
// softcap. Rows >= n and columns >= v hold zeros (loads are zero-filled), so an epilogue only has
// to skip them.
//
//   MmaTile<T>  tensor cores, 3-stage cp.async ring, ldmatrix fragments, fp32 accumulators:
//               T = bf16/fp16: mma.sync m16n8k16; T = float: TF32 mma.sync m16n8k8 (operands
//               rounded to TF32 with cvt.rna), used only when torch's float32 matmul precision
//               allows it. The shared-memory layout is the same in bytes for every T (a 16-byte
//               chunk holds 8 halves or 4 floats; one mma step consumes 32 bytes of k).
//               Needs 16-byte aligned rows, unit column stride and d a multiple of one chunk
//               (the binding makes an aligned, zero-padded copy otherwise).
//   SimtTile    fp32, exact (FMA on CUDA cores, no TF32): any strides and alignment.
#pragma once

#include <cstdint>

#include "params.h"
#include "ptx.cuh"

namespace flce {
namespace cuda {

template <typename T>
struct MmaTile {
  static constexpr int kBlockN = 128;  // rows per CTA tile
  static constexpr int kBlockV = 128;  // vocab columns per CTA tile
  static constexpr int kBlockK = 64 / sizeof(T);  // reduction slice per stage: 64 bytes of k
  static constexpr int kMmaK = 32 / sizeof(T);     // k of one mma: 16 (bf16/fp16) or 8 (tf32)
  static constexpr int kStages = 3;
  static constexpr int kWarpsN = 2;  // warp grid over the tile: 2 x 4 warps of [64, 32]
  static constexpr int kWarpsV = 4;
  static constexpr int kThreads = kWarpsN * kWarpsV * 32;
  static constexpr int kWarpN = kBlockN / kWarpsN;  // 64 rows per warp = 4 m16 tiles
  static constexpr int kWarpV = kBlockV / kWarpsV;  // 32 cols per warp = 4 n8 tiles
  static constexpr int kMTiles = kWarpN / 16;
  static constexpr int kNTiles = kWarpV / 8;
  static constexpr int kElemsPerChunk = 16 / sizeof(T);  // one cp.async moves 16 bytes
  static constexpr int kChunksPerRow = kBlockK / kElemsPerChunk;
  // Rows padded by 16 bytes: the 80-byte row stride puts the 8 row addresses of an ldmatrix in
  // 8 distinct 16-byte bank groups (conflict-free) and keeps every row 16-byte aligned.
  static constexpr int kSmemRow = kBlockK + kElemsPerChunk;
  static constexpr int kStageElems = (kBlockN + kBlockV) * kSmemRow;  // A, B [128][80 bytes]
  static constexpr int kPipeBytes = kStages * kStageElems * static_cast<int>(sizeof(T));
  // fp32 epilogue tile [kBlockN, kEpiLd]; +8 floats keeps the float2 fragment stores of a half
  // warp on distinct banks.
  static constexpr int kEpiLd = kBlockV + 8;
  static constexpr int kEpiBytes = kBlockN * kEpiLd * 4;
  static constexpr int kSmemBytes = kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes;
  static constexpr int kEpiOffset = 0;  // epi aliases the pipeline ring

  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "16-bit operands or fp32 as TF32");
  static_assert((kSmemRow * sizeof(T)) % 16 == 0, "cp.async / ldmatrix need 16-byte smem rows");
  static_assert((kStageElems * sizeof(T)) % 16 == 0, "stages must stay 16-byte aligned");
  static_assert((kBlockN * kChunksPerRow) % kThreads == 0, "A tile loads split evenly");
  static_assert((kBlockV * kChunksPerRow) % kThreads == 0, "B tile loads split evenly");
  static_assert(kBlockK % kMmaK == 0 && kNTiles % 2 == 0, "whole mma steps, n8 tile pairs");

  // Issue the cp.async copies of k-slice [k0, k0 + kBlockK) of rows [0, rows) of src (row stride
  // ld) into dst [kRows][kSmemRow]; missing rows and columns >= d are zero-filled.
  template <int kRows>
  __device__ static void load_slice(T* dst, const T* src, int64_t ld, int64_t rows, int64_t d,
                                    int64_t k0) {
#pragma unroll
    for (int i = 0; i < kRows * kChunksPerRow / kThreads; ++i) {
      const int id = static_cast<int>(threadIdx.x) + i * kThreads;
      const int r = id / kChunksPerRow;
      const int c = id % kChunksPerRow;
      const int64_t k = k0 + c * kElemsPerChunk;
      const bool valid = r < rows && k < d;  // d % kElemsPerChunk == 0: chunks are all-or-none
      const T* g = valid ? src + r * ld + k : src;
      cp_async_16(smem_addr(dst + r * kSmemRow + c * kElemsPerChunk), g, valid);
    }
  }

  // acc += A_slice [kBlockN, kBlockK] * B_slice^T for this warp's [64, 32] part. ldmatrix moves
  // 8x8 b16 matrices = 8 rows of 16 bytes; for fp32 a thread's 32-bit word is then one float,
  // which is exactly the TF32 m16n8k8 fragment layout.
  __device__ static void mma_slice(const T* sA, const T* sB, float (&acc)[kMTiles][kNTiles][4],
                                   int warp_n, int warp_v, int lane) {
#pragma unroll
    for (int kk = 0; kk < kBlockK; kk += kMmaK) {
      uint32_t af[kMTiles][4];  // [16, kMmaK] A fragments
      uint32_t bf[kNTiles][2];  // [8 n, kMmaK k] B fragments
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        // matrices 0..3 = (rows 0-7, chunk 0), (rows 8-15, chunk 0), (rows 0-7, chunk 1),
        // (rows 8-15, chunk 1), a chunk being 16 bytes of k
        const int row = warp_n * kWarpN + mi * 16 + (lane % 16);
        const int col = kk + (lane / 16) * kElemsPerChunk;
        ldmatrix_x4(af[mi], smem_addr(sA + row * kSmemRow + col));
        to_mma_operand<T>(af[mi]);
      }
#pragma unroll
      for (int nj = 0; nj < kNTiles / 2; ++nj) {
        // matrices 0..3 = (n 0-7, chunk 0), (n 0-7, chunk 1), (n 8-15, chunk 0), (n 8-15, chunk 1)
        const int row = warp_v * kWarpV + nj * 16 + (lane % 8) + (lane / 16) * 8;
        const int col = kk + ((lane / 8) % 2) * kElemsPerChunk;
        uint32_t r[4];
        ldmatrix_x4(r, smem_addr(sB + row * kSmemRow + col));
        to_mma_operand<T>(r);
        bf[2 * nj][0] = r[0];
        bf[2 * nj][1] = r[1];
        bf[2 * nj + 1][0] = r[2];
        bf[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) mma_step<T>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
      }
    }
  }

  // Tile (m0, n0) -> epi. Ends with a __syncthreads(); the caller must __syncthreads() between
  // the epilogue's last read of epi and the next compute() (epi aliases the pipeline buffers).
  __device__ static void compute(const LinearArgs& a, int64_t m0, int64_t n0, char* smem,
                                 float* epi) {
    T* pipe = reinterpret_cast<T*>(smem);
    const T* A = static_cast<const T*>(a.input) + m0 * a.input_row_stride;   // [rows_a, d]
    const T* B = static_cast<const T*>(a.weight) + n0 * a.weight_row_stride;  // [rows_b, d]
    const int64_t rows_a = a.n - m0 < kBlockN ? a.n - m0 : kBlockN;
    const int64_t rows_b = a.v - n0 < kBlockV ? a.v - n0 : kBlockV;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_n = warp % kWarpsN, warp_v = warp / kWarpsN;

    float acc[kMTiles][kNTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;

    const int64_t ktiles = (a.d + kBlockK - 1) / kBlockK;
    // Prologue: slices 0 .. kStages-2 in flight; one commit group per slice (empty ones too, so
    // that wait_group counts stay uniform).
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < ktiles) {
        T* st = pipe + s * kStageElems;
        load_slice<kBlockN>(st, A, a.input_row_stride, rows_a, a.d, s * kBlockK);
        load_slice<kBlockV>(st + kBlockN * kSmemRow, B, a.weight_row_stride, rows_b, a.d,
                            s * kBlockK);
      }
      cp_async_commit();
    }
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      cp_async_wait<kStages - 2>();  // slice kt has landed (for this thread) ...
      __syncthreads();               // ... for all threads, and slice kt-1's stage is free
      const int64_t next = kt + kStages - 1;
      if (next < ktiles) {
        T* st = pipe + (next % kStages) * kStageElems;
        load_slice<kBlockN>(st, A, a.input_row_stride, rows_a, a.d, next * kBlockK);
        load_slice<kBlockV>(st + kBlockN * kSmemRow, B, a.weight_row_stride, rows_b, a.d,
                            next * kBlockK);
      }
      cp_async_commit();
      const T* st = pipe + (kt % kStages) * kStageElems;
      mma_slice(st, st + kBlockN * kSmemRow, acc, warp_n, warp_v, lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // all warps are done with the pipeline buffers: epi may overwrite them

    // Accumulator fragment (mi, ni): c0, c1 at (row g, cols 2q, 2q+1), c2, c3 at row g + 8.
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) {
        const int row = warp_n * kWarpN + mi * 16 + g;
        const int col = warp_v * kWarpV + ni * 8 + 2 * q;
        *reinterpret_cast<float2*>(epi + row * kEpiLd + col) =
            make_float2(acc[mi][ni][0], acc[mi][ni][1]);
        *reinterpret_cast<float2*>(epi + (row + 8) * kEpiLd + col) =
            make_float2(acc[mi][ni][2], acc[mi][ni][3]);
      }
    }
    __syncthreads();
  }
};

struct SimtTile {
  static constexpr int kBlockN = 64;
  static constexpr int kBlockV = 64;
  static constexpr int kBlockK = 16;
  static constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
  static constexpr int kPerThread = 4;
  static constexpr int kSmemLd = kBlockN + 4;  // As/Bs are k-major: [kBlockK][kSmemLd]
  static constexpr int kEpiLd = kBlockV + 8;
  static constexpr int kLoadBytes = 2 * kBlockK * kSmemLd * 4;
  static constexpr int kEpiBytes = kBlockN * kEpiLd * 4;
  static constexpr int kSmemBytes = kLoadBytes + kEpiBytes;  // epi separate: no aliasing needed
  static constexpr int kEpiOffset = kLoadBytes;

  static_assert(kBlockN == kBlockV, "one smem row length for both operands");
  static_assert(16 * kPerThread == kBlockN, "16 x 16 threads cover the tile");
  static_assert((kBlockN * kBlockK) % kThreads == 0, "loads split evenly");

  __device__ static void compute(const LinearArgs& a, int64_t m0, int64_t n0, char* smem,
                                 float* epi) {
    float* As = reinterpret_cast<float*>(smem);  // [kBlockK][kSmemLd]: As[k][r] = A[m0 + r, k]
    float* Bs = As + kBlockK * kSmemLd;          // [kBlockK][kSmemLd]: Bs[k][c] = B[n0 + c, k]
    const float* A = static_cast<const float*>(a.input);
    const float* B = static_cast<const float*>(a.weight);
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[kPerThread][kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) acc[i][j] = 0.f;

    for (int64_t k0 = 0; k0 < a.d; k0 += kBlockK) {
#pragma unroll
      for (int i = 0; i < kBlockN * kBlockK / kThreads; ++i) {
        const int e = static_cast<int>(threadIdx.x) + i * kThreads;
        const int r = e / kBlockK, kk = e % kBlockK;  // consecutive threads: consecutive k
        const int64_t k = k0 + kk;
        const bool kin = k < a.d;
        As[kk * kSmemLd + r] = (kin && m0 + r < a.n)
                                   ? A[(m0 + r) * a.input_row_stride + k * a.input_col_stride]
                                   : 0.f;
        Bs[kk * kSmemLd + r] = (kin && n0 + r < a.v)
                                   ? B[(n0 + r) * a.weight_row_stride + k * a.weight_col_stride]
                                   : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kBlockK; ++kk) {
        float av[kPerThread], bv[kPerThread];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) av[i] = As[kk * kSmemLd + ty + 16 * i];
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) bv[j] = Bs[kk * kSmemLd + tx + 16 * j];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i)
#pragma unroll
          for (int j = 0; j < kPerThread; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) epi[(ty + 16 * i) * kEpiLd + tx + 16 * j] = acc[i][j];
    __syncthreads();
  }
};

// Element type of a Tile's operands.
template <typename Tile>
struct TileElem;
template <typename T>
struct TileElem<MmaTile<T>> {
  using type = T;
};
template <>
struct TileElem<SimtTile> {
  using type = float;
};

// The tile traits of a compute dtype, as a tag: f(Tile{}) for the kernels of that dtype.
template <typename F>
cudaError_t with_tile(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16:
      return f(MmaTile<__nv_bfloat16>{});
    case DType::kFloat16:
      return f(MmaTile<__half>{});
    case DType::kFloat32:
      return f(SimtTile{});
    case DType::kFloat32Tf32:
      return f(MmaTile<float>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace flce
