// Every size the CUDA binding chooses for its launch sequences, with the reason for each (the
// row kernels' own tile and split choices are in flce_rows.cu, beside the code they shape).
// Changing one changes performance or memory, never results beyond rounding; the tests that
// cross each boundary set FLCE_CUDA_WORKSPACE_MB small.
#pragma once

#include <cstdint>

namespace flce {
namespace binding {
namespace heuristics {

// The workspace budget when FLCE_CUDA_WORKSPACE_MB is unset: one group of 4096 rows of a 128k
// vocabulary in bf16 (1.0 GiB) plus its fp32 logits sub-chunk, about what peers hold for bf16
// logits of the same rows (quack: 0.98 GiB).
constexpr double kWorkspaceMb = 1536.0;

// Rows are planned in multiples of this: fewer rows per GEMM leave cuBLAS's tiles mostly empty,
// so a single pass that cannot fit kMinRows rows runs forward + recompute instead.
constexpr int64_t kMinRows = 64;

// The single pass' (and the recompute backward's) fp32 logits sub-chunk takes this share of the
// budget, at most kSubChunkMaxBytes: 256 rows of a 128k vocabulary, enough for the logits GEMM
// (M = S) to stay compute-bound while each sub-chunk re-reads W; the rest holds the group's dz.
constexpr int64_t kSubChunkShare = 12;
constexpr int64_t kSubChunkMaxBytes = int64_t{128} << 20;

// fp32 inputs: dW sums a group's rows inside one cuBLAS GEMM (fp32 accumulation) and the groups
// with Neumaier compensation; groups of at most this many rows keep the first term small
// (benchmarks/accumulation.py), and fp32 GEMMs are slow enough that the compensated [V, D] add
// per group costs little beside them.
constexpr int64_t kFp32GroupRows = 1024;

// fp32 inputs: dE sums over the vocabulary in pieces of this many columns, Neumaier-added: one
// fp32 GEMM over a 128k vocabulary would carry its k-loop's rounding.
constexpr int64_t kFp32PieceCols = 8192;

// Vocabulary rows of one fp32 dW piece: 32 MiB at D = 4096, while the piece's GEMM
// (2048 x D x G) is still large enough for cuBLAS.
constexpr int64_t kDwPiece = 2048;

// Rows of one bias column-sum block of row_grad (8-row CTAs): the [ceil(S / 8), V] partial
// sums stay small beside the sub-chunk's logits and are reduced in order (deterministic).
constexpr int kBiasRows = 8;

// A host more than this many target checks ahead of its GPU waits for the oldest one: the
// pinned copies stay bounded.
constexpr size_t kMaxPendingChecks = 64;

}  // namespace heuristics
}  // namespace binding
}  // namespace flce
