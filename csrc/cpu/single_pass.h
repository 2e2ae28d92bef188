// The sizes of the CPU single pass's row-block logits (flce_cpu.cpp, sum_and_grad_cpu), defined
// here once. Python's model of the pass's memory (flce/_common.py, cpu_single_pass_bytes, which
// picks the default path and which tests/cpu/test_cpu_memory.py holds the measured growth to) reads
// them through the op flce::cpu_single_pass_layout (ops.cpp) instead of keeping copies.
#pragma once

#include <cstdint>

namespace flce::cpu {

// Vocabulary columns per tile of 16-bit inputs and of the single pass (flce_cpu.cpp,
// Operands::block_v, which says why).
constexpr int64_t BLOCK_V_WIDE = 2048;
// Tile buffers' rows are TILE_PAD floats longer than their columns, so that the row stride is not
// a power of two: the dC GEMM reads the gradient tile transposed, and a column of a 2^k-strided
// tile maps to a single cache set.
constexpr int64_t TILE_PAD = 16;

// Rows per block of the single pass: a row block keeps its logits for the whole vocabulary, tile
// by tile ([tiles, rows, block_v + TILE_PAD] fp32 per worker, at most ceil(V / block_v) +
// workers tiles in all), within kFusedWorkspaceBytes (kFusedWorkspaceBytes16 for 16-bit inputs).
// Up to FUSED_BLOCK_N rows: every row block streams dW's accumulators (V * D fp32 sums and bf16
// compensations) through memory once, which a taller block does less often; 1024 rows were the
// fastest of 128-1024 measured, for more logits held (docs/cpu-backend.md, "Forward + backward
// in one pass"). A block never has more rows than N (rounded up to 16): a short batch holds no
// logits it does not have.
constexpr int64_t FUSED_BLOCK_N = 1024;
// fp32: 1024 rows of V = 32768 on 2 workers, (16 + 2) tiles of 2064 floats per row. 16-bit
// inputs' single pass also holds the gradients in fp32 and the weight packed twice: their logits
// keep 72 MiB (about 500 rows there), so that at that shape the pass stays within the default
// memory budget (flce/_common.py) where it is the default (bf16 without AMX).
constexpr int64_t kFusedWorkspaceBytes = int64_t(152) << 20;
constexpr int64_t kFusedWorkspaceBytes16 = int64_t(72) << 20;

}  // namespace flce::cpu
