// The bf16 rate an AMX GEMM kernel can reach on this CPU, one core, from its inner loop alone.
//
// A GEMM with AMX-BF16 holds its accumulators in tile registers. With 8 tiles the usual inner
// step (oneDNN's brgemm, and at the rates measured, MKL's) is a 2 x 2 block: 4 accumulator tiles
// of [16, 16] fp32, 2 A tiles of [16 rows, 32 k] bf16 and 2 B tiles of [16 k-pairs, 16, 2] bf16,
// loaded once per k-step of 32 and used twice each by 4 TDPBF16PS. This program times that step
// with the operand traffic switched on one part at a time, so that the documents' statements of
// what a CPU GEMM (or a GEMM with a fused epilogue) can reach rest on a measurement:
//   dp        4 TDPBF16PS per step, no loads: the tile unit's own rate
//   a         + 2 A-tile loads per step
//   ab        + 2 B-tile loads per step (the 2 x 2 kernel), operands cycling over SPAN bytes
//             (4 KiB: L1; 256 KiB: L2; 4 MiB: beyond L2 on most server cores)
//   ab_k512   ab over 16 KiB, and every 16 steps (K = 512) the accumulators are stored and
//             zeroed, as a kernel must do when its K is a hidden size of 512 (a logit tile)
// Prints GFLOP/s per core (2 * 16 * 16 * 32 flops per TDPBF16PS), the median of 5 repeats.
//
// Build and run (GCC >= 11 or Clang >= 12, Linux >= 5.16 for the AMX permission request):
//   g++ -O2 -mamx-tile -mamx-bf16 tools/probes/cpu_amx_bound.cpp -o /tmp/cpu_amx_bound
//   taskset -c 0 /tmp/cpu_amx_bound
// It exits with a message, not a fault, where AMX is absent or the kernel refuses it.
// Results: docs/benchmarks.md ("What bounds bf16 on AMX").
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cpuid.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSAVE feature
constexpr int kXfeatureXtiledata = 18;      // the AMX tile data state
constexpr double kFlopsPerDp = 2.0 * 16 * 16 * 32;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
}

// Every tile [16 rows, 64 bytes]: tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

enum class Mode { kDp, kA, kAb, kAbK512 };

// One timed run of `steps` k-steps; returns GFLOP/s. The operands cycle over `span` bytes of
// `buf` (bf16 1.0, so the accumulators stay finite), 4 KiB per step.
double run(Mode mode, const char* buf, size_t span, long steps) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  alignas(64) static float acc_out[4][16 * 16];
  size_t off = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < steps; ++i) {
    if (mode != Mode::kDp) {
      _tile_loadd(4, buf + off, 64);
      _tile_loadd(5, buf + off + 1024, 64);
    }
    if (mode == Mode::kAb || mode == Mode::kAbK512) {
      _tile_loadd(6, buf + off + 2048, 64);
      _tile_loadd(7, buf + off + 3072, 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    off = off + 8192 > span ? 0 : off + 4096;
    if (mode == Mode::kAbK512 && i % 16 == 15) {
      _tile_stored(0, acc_out[0], 64);
      _tile_stored(1, acc_out[1], 64);
      _tile_stored(2, acc_out[2], 64);
      _tile_stored(3, acc_out[3], 64);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  _tile_stored(0, acc_out[0], 64);  // the result is used: the loop cannot be dropped
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (acc_out[0][0] < 0.f) std::printf("unexpected negative accumulator\n");
  return steps * 4 * kFlopsPerDp / t / 1e9;
}

}  // namespace

int main() {
  if (!cpu_has_amx_bf16()) {
    std::printf("this CPU has no AMX-BF16: nothing to measure\n");
    return 0;
  }
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::printf("the kernel refused the AMX tile state (arch_prctl): nothing to measure\n");
    return 0;
  }
  configure_tiles();
  const size_t max_span = size_t{4} << 20;
  std::vector<uint16_t> data(max_span / 2 + 4096, 0x3f80);  // bf16 1.0
  const char* buf = reinterpret_cast<const char*>(data.data());
  struct Case {
    const char* name;
    Mode mode;
    size_t span;
  } cases[] = {
      {"dp", Mode::kDp, 4096},          {"a (L1)", Mode::kA, 4096},
      {"ab (L1)", Mode::kAb, 4096},     {"ab (256 KiB)", Mode::kAb, 256 << 10},
      {"ab (4 MiB)", Mode::kAb, max_span}, {"ab_k512 (16 KiB)", Mode::kAbK512, 16 << 10},
  };
  std::printf("%-18s %12s\n", "inner step", "GFLOP/s");
  for (const Case& c : cases) {
    std::vector<double> r;
    for (int rep = 0; rep < 5; ++rep) r.push_back(run(c.mode, buf, c.span, 1000000));
    std::sort(r.begin(), r.end());
    std::printf("%-18s %12.0f\n", c.name, r[2]);
  }
  _tile_release();
  return 0;
}
