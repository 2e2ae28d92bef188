// Every size the CUDA backend chooses for its launch sequences, with the reason for each (the
// row kernels' tiles are in flce_rows.cu, beside the code they shape; their column splits here).
// Plain C++, no torch: the host tests call these functions as the binding and kernels do.
// Changing one changes performance or memory, never results beyond rounding; the tests that
// cross each boundary set FLCE_CUDA_WORKSPACE_MB small.
#pragma once

#include <algorithm>
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
// (tools/probes/accumulation.py), and fp32 GEMMs are slow enough that the compensated [V, D] add
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

// Rows per group (the gradient buffer [G, V]) and per logits sub-chunk (fp32 [S, V]) of the
// chunk driver.
struct ChunkPlan {
  int64_t group_rows = 0, sub_rows = 0;
  bool in_place = false;  // fp32: logits computed into the group buffer, dz written over them
};

// The chunk plan of n rows whose logits rows are ld floats apart, within `budget` bytes. fp32
// computes its logits into the group buffer and writes dz over them (one [G, ld] fp32 buffer,
// G at most kFp32GroupRows); 16-bit inputs hold the fp32 sub-chunk (its share of the budget)
// beside the group's 16-bit dz (twice for split: fp32 master weights take dz as hi + lo).
// Rows in multiples of kMinRows; must = false: no plan (0 rows) where fewer fit (the single pass
// then runs forward + recompute), must = true: at least one row.
inline ChunkPlan chunk_plan(int64_t n, int64_t ld, int64_t budget, bool fp32, bool split,
                            bool must) {
  auto rows = [must](int64_t r) {
    if (r >= kMinRows) return r / kMinRows * kMinRows;
    return must ? std::max<int64_t>(r, 1) : int64_t{0};
  };
  ChunkPlan plan;
  if (fp32) {
    plan.in_place = true;
    plan.group_rows = std::min(rows(budget / (4 * ld)), kFp32GroupRows);
    plan.sub_rows = plan.group_rows;
  } else {
    const int64_t scratch = std::min(budget / kSubChunkShare, kSubChunkMaxBytes);
    plan.sub_rows = rows(scratch / (4 * ld));
    const int64_t elt = 2 * (split ? 2 : 1);
    plan.group_rows = rows(std::max<int64_t>(budget - plan.sub_rows * ld * 4, 0) / (elt * ld));
  }
  if (plan.sub_rows < 1 || plan.group_rows < 1) return ChunkPlan{};
  plan.group_rows = std::min(plan.group_rows, std::max<int64_t>(n, 1));
  plan.sub_rows = std::min(plan.sub_rows, plan.group_rows);
  return plan;
}

// Column splits of a row kernel: `ctas` row CTAs over `tiles` column tiles, per_sm CTAs resident
// per SM. At least two waves of the resident CTAs (one wave leaves the GPU idle while its
// slowest CTA finishes), at most one split per tile, and among those the count whose last wave
// is fullest (a short last wave idles the rest of the GPU); at most 65535 (the grid's y).
inline int row_splits(int64_t ctas, int64_t tiles, int per_sm, int sm_count) {
  tiles = std::max<int64_t>(tiles, 1);
  const int64_t slots = static_cast<int64_t>(std::max(per_sm, 1)) * std::max(sm_count, 1);
  ctas = std::max<int64_t>(ctas, 1);
  const int64_t lo = std::min<int64_t>(std::max<int64_t>((2 * slots + ctas - 1) / ctas, 1), tiles);
  int64_t best = lo;
  double best_fill = -1;
  for (int64_t s = lo; s <= std::min<int64_t>(tiles, 2 * lo); ++s) {
    const int64_t total = ctas * s;
    const double fill = static_cast<double>(total) /
                        static_cast<double>((total + slots - 1) / slots * slots);
    if (fill > best_fill + 1e-9) {
      best = s;
      best_fill = fill;
    }
  }
  return static_cast<int>(std::min<int64_t>(best, 65535));
}

}  // namespace heuristics
}  // namespace binding
}  // namespace flce
