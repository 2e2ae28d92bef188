// The fused logits GEMM for Hopper (sm_90a): acc = x . w^T on CUTLASS's TMA + WGMMA
// warp-specialized persistent mainloop, with an epilogue that keeps no logits. For every (row,
// 256-column tile) it stores E softcap'(z), E = exp(z - r_tile), in bf16 and one partial
// (m, s, z_t, 0, 0); the
// arithmetic is flce/tile_epilogue.h's (the SIMT stand-in launch_logits_epilogue computes the same
// from cuBLAS' fp32 logits, and is what this kernel is checked against).
//
// Built by setup.py / CMake where the arch list has sm_90a and CUTLASS's headers are found
// (FLCE_WITH_CUTLASS_SM90; flce_fused.cu has the stub otherwise), for every gencode of the build
// (sm_80, sm_90a, sm_100): only the sm_90a pass holds the real kernel; the other device passes
// compile CUTLASS's stub body (ENABLE_SM90_KERNEL_LEVEL unset), and the host refuses them at run
// time (fused_logits_sm90_supported below).
//
// NDEBUG (defined below for this file) is required for performance, not correctness: without it
// CUTLASS's device code keeps
// its assert()s, e.g. assert(k_tile_count >= 1) inside the mainloop's mma()
// (sm90_mma_tma_gmma_ss_warpspecialized.hpp), a call to the extern __assertfail in the middle of
// the wgmma pipeline, and ptxas serializes every wgmma.mma_async of the kernel: advisory C7510
// "wgmma.mma_async instructions are serialized due to wgmma pipeline crossing function boundary
// at a function call" (this file without -DNDEBUG prints it; with it, none). Anything else in
// the epilogue that is not inlined (printf, a __noinline__ helper) would do the same: the whole
// persistent kernel is one function to ptxas, epilogue included.
#ifndef NDEBUG
#define NDEBUG  // before any include: CUTLASS's device assert()s would serialize the WGMMAs
#endif

#include "cuda/params.h"
#include "flce/tile_epilogue.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>

// CUTLASS 4.2's sm100 collectives (pulled in by the builder's umbrella header) trip nvcc's
// C++20 warning on implicit `this` captures (#2908); not ours to fix.
#pragma nv_diagnostic push
#pragma nv_diag_suppress 2908
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#pragma nv_diagnostic pop

namespace flce {
namespace cuda {
namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// What the epilogue reads, per launch, and the CUTLASS plumbing of an operator-style collective
// epilogue that stores E and the partials itself: no C / D tensor for CUTLASS to load or store,
// no workspace, its parameters as given.
// ---------------------------------------------------------------------------------------------
struct EpilogueParams {
  const float* bias;  // [v] or nullptr
  float softcap;      // <= 0: none
  float temperature;
  const int64_t* target;
  int64_t target_stride;
  int64_t col_offset;
  int64_t ignore_index;
  int64_t v;
  __nv_bfloat16* e;  // [n, v], row stride e_ld
  int64_t e_ld;
  float* partials;   // [n, tiles, kPartialCols]
  int64_t tiles;     // ceil(v / kFusedTileCols)
};

// The operands' type (x, w and E alike) and the elements of one 16-byte access of it: TMA's
// rule for x's and w's base pointers and row strides.
using Element = cutlass::bfloat16_t;
constexpr int kAlignment = 16 / sizeof(Element);

struct EpilogueBase {
  using ElementC = Element;
  using ElementD = Element;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = cute::Stride<int64_t, cute::_1, int64_t>;
  using ThreadEpilogueOp = void;
  struct SharedStorage {};
  using Arguments = EpilogueParams;
  using Params = EpilogueParams;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
};

// ---------------------------------------------------------------------------------------------
// Configuration.
// ---------------------------------------------------------------------------------------------

// CTA tile [BLOCK_M=128 rows (tokens), BLOCK_N=256 vocab columns, BLOCK_K=64]: BLOCK_N is the
// partials' column tile (kFusedTileCols), so one CTA tile is one (row block, partial tile) and
// the epilogue needs no cross-CTA reduction. 128 x 256 fp32 accumulators over the 2 consumer
// warpgroups of the cooperative schedule = 128 registers per thread, leaving ~100 of the 232 a
// consumer gets (setmaxnreg) for the epilogue.
constexpr int BLOCK_M = 128;
constexpr int BLOCK_N = kFusedTileCols;
constexpr int BLOCK_K = 64;
static_assert(BLOCK_N == 256, "the partials' tile is the CTA tile's N");

// Shared memory per stage: A [128 x 64] + B [256 x 64] bf16 = 16 KiB + 32 KiB = 48 KiB; 4 stages
// = 192 KiB of the 227 KiB an sm_90 CTA may have (the epilogue uses none, the pipeline barriers
// and the scheduler a few hundred bytes). A fifth stage would not fit.
constexpr int kNumStages = 4;

// Cluster 1 x 1: a 2 x 1 cluster would multicast each W tile (the larger operand, 32 KiB per
// stage) to two M tiles, halving W's L2 -> SM traffic, but the persistent scheduler rounds the
// M tiles up to the cluster: the chunks of few rows this path sees (n <= 128 at the end of a
// sequence, or decode-sized batches) would run a second, fully masked CTA per cluster, i.e.
// twice the tensor-core work. 128 x 256 tiles are compute-bound on H100 without the multicast.
using ClusterShape = Shape<_1, _1, _1>;
using TileShape = Shape<Int<BLOCK_M>, Int<BLOCK_N>, Int<BLOCK_K>>;

using ElementX = Element;  // A operand: x [n, d], K-major
using ElementW = Element;  // B operand: w [v, d], K-major
using ElementAccumulator = float;

// ---------------------------------------------------------------------------------------------
// The accumulator fragment viewed as (row, column).
//
// An SM90 GMMA accumulator fragment partitioned by the TiledMma is ((V0, V1, V2), MMA_M, MMA_N):
// V0 = 2 adjacent columns, V1 = 2 rows 8 apart, V2 = BLOCK_N / 8 column groups; MMA_M and MMA_N
// repeat the TiledMma over the CTA tile (1 and 1 here). The same transform applied to the
// fragment and to the partitioned identity tensor keeps element i of one at element i of the
// other, so the coordinates are read from CuTe, never computed by hand;
// verify_row_quads below checks the structure the epilogue relies on.
// ---------------------------------------------------------------------------------------------
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout const& l) {
  static_assert(decltype(rank<0>(l))::value == 3 && decltype(size<0, 0>(l))::value == 2 &&
                    decltype(size<0, 1>(l))::value == 2,
                "expected an SM90 GMMA accumulator fragment ((2, 2, N/8), MMA_M, MMA_N)");
  // ((V0, V1, V2), MMA_M, MMA_N) -> ((V1, MMA_M), (V0, V2, MMA_N))
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// Compile-time proof, from the TiledMma's own (thread, value) -> (m, n) layout, of what the
// epilogue assumes about the (row, column) view of each thread's fragment:
//   a. along a row of the view the tile row is constant;
//   b. along a column of the view the tile column is constant (one bias load per column);
//   c. view columns 2k and 2k + 1 are adjacent tile columns (paired bf16 stores);
//   d. the kRowThreads threads t ^ mask (mask < kRowThreads, consecutive lanes of one warp) hold
//      the same rows;
//   e. distinct quads hold distinct rows, and all BLOCK_M rows are held: a row is reduced over
//      its quad and nothing else (the TV layout is a bijection, so the quad holds all its columns).
template <class TiledMma, class FragLayout, int kRowThreads>
constexpr bool verify_row_quads() {
  constexpr auto tv = TiledMma{}.get_layoutC_TV();  // (thread, value) -> m + BLOCK_M * n
  constexpr auto rc = acc_rowcol(FragLayout{});     // (row, col) -> value
  constexpr int kThreads = size<0>(tv);
  constexpr int kValues = size<1>(tv);
  constexpr int kRows = size<0>(rc);
  constexpr int kCols = size<1>(rc);
  static_assert(size(FragLayout{}) == kValues, "one fragment = one TiledMma C tile");
  static_assert(kThreads % kRowThreads == 0 && kCols % 2 == 0);
  // A layout's index is the sum of its modes' indices: tv(t, v) = tv_t(t) + tv_v(v). Tabulating
  // the two halves once keeps the check within the compiler's constexpr budget.
  int thr_off[kThreads] = {};
  int val_off[kRows][kCols] = {};
  for (int t = 0; t < kThreads; ++t) thr_off[t] = int(layout<0>(tv)(t));
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) val_off[r][c] = int(layout<1>(tv)(int(rc(r, c))));
  }
  bool seen[BLOCK_M] = {};
  for (int t = 0; t < kThreads; ++t) {
    for (int r = 0; r < kRows; ++r) {
      const int m = (thr_off[t] + val_off[r][0]) % BLOCK_M;
      for (int c = 0; c < kCols; ++c) {
        const int idx = thr_off[t] + val_off[r][c];
        const int idx_r0 = thr_off[t] + val_off[0][c];
        if (idx % BLOCK_M != m) return false;                                     // a
        if (idx / BLOCK_M != idx_r0 / BLOCK_M) return false;                      // b
        if (c % 2 == 1 && idx / BLOCK_M != (thr_off[t] + val_off[r][c - 1]) / BLOCK_M + 1) {
          return false;                                                           // c
        }
      }
      for (int mask = 1; mask < kRowThreads; mask <<= 1) {
        if ((thr_off[t ^ mask] + val_off[r][0]) % BLOCK_M != m) return false;     // d
      }
      if (t % kRowThreads == 0) {
        if (seen[m]) return false;                                                // e
        seen[m] = true;
      }
    }
  }
  for (int m = 0; m < BLOCK_M; ++m) {
    if (!seen[m]) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// The epilogue (an operator-style collective epilogue, run by each consumer thread on its
// accumulator fragment; Sm90TmaWarpSpecializedAdapter plugs it into the sm90 warp-specialized
// kernels: no epilogue producer warp, no shared memory).
// ---------------------------------------------------------------------------------------------

class FusedLogitsEpilogue : public EpilogueBase {
 public:
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;

  // E, the partials and the targets given, N the shard's columns, and E's rows 4-byte aligned
  // for the paired bf16 stores (operands_ok checks 16).
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return args.e != nullptr && args.partials != nullptr && args.target != nullptr &&
           args.e_ld % 2 == 0 && reinterpret_cast<uintptr_t>(args.e) % 4 == 0 &&
           args.v == int64_t(cute::get<1>(problem_shape));
  }

  CUTLASS_HOST_DEVICE
  FusedLogitsEpilogue(Params const& params, SharedStorage const& = SharedStorage()) : p_(params) {}

  // Threads that share the rows of a fragment: the lanes of a quad (butterfly partners 1, 2);
  // verify_row_quads proves it for the TiledMma at hand.
  enum : int { kRowThreads = 4 };

  // accumulators: this thread's share of the CTA tile, [BLOCK_M=128, BLOCK_N=256] fp32 in all,
  // per consumer warpgroup 64 x 256, per thread 2 rows x 64 columns (128 values).
  // residue_mnk: rows / columns of the tile inside the problem (may exceed the tile).
  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK residue_mnk, int thread_idx,
                                 char*) {
    static_assert(is_static<FrgLayout>::value, "accumulators live in registers");
    static_assert(size<0>(BlockShapeMNK{}) == BLOCK_M && size<1>(BlockShapeMNK{}) == BLOCK_N);
    static_assert(verify_row_quads<TiledMma, FrgLayout, kRowThreads>(),
                  "the accumulator layout is not the quad-per-row layout the epilogue reduces");

    const int m_tile = int(get<0>(blk_coord_mnkl));
    const int n_tile = int(get<1>(blk_coord_mnkl));
    const int residue_m = int(get<0>(residue_mnk));  // rows < residue_m are in the problem
    const int residue_n = int(get<1>(residue_mnk));  // columns < residue_n are in the problem
    const int64_t row0 = int64_t(m_tile) * BLOCK_M;
    const int64_t col0 = int64_t(n_tile) * BLOCK_N;

    // [BLOCK_M, BLOCK_N] -> (m, n) tile coordinates, partitioned like the accumulators.
    Tensor cD = make_identity_tensor(take<0, 2>(blk_shape_mnk));
    Tensor tCcD = tiled_mma.get_thread_slice(thread_idx).partition_C(cD);
    // (ROW=2, COL=64) views of this thread's fragment and of its coordinates.
    Tensor acc = make_tensor(accumulators.data(), acc_rowcol(accumulators.layout()));
    Tensor crd = make_tensor(tCcD.data(), acc_rowcol(tCcD.layout()));
    constexpr int kRows = size<0>(decltype(acc.layout()){});
    constexpr int kCols = size<1>(decltype(acc.layout()){});

    // Each row's target column within this tile (-1: not here, ignored, or out of range).
    int tcol[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int m = get<0>(crd(r, 0));
      tcol[r] = m < residue_m ? epi_tile_target(p_.target[(row0 + m) * p_.target_stride],
                                                p_.ignore_index, p_.col_offset, p_.v, col0,
                                                BLOCK_N)
                              : -1;
    }

    // Step 1: the logits z (kept in a register fragment of the accumulators' shape, which the
    // accumulators' registers become) and each thread's share of the row statistics.
    Tensor z = make_tensor<float>(acc.layout());  // (ROW, COL) fp32
    EpiRow st[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) st[r] = epi_row_empty();
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const int n = get<1>(crd(0, c));  // the column is the same for every row (check b)
      const bool col_in = n < residue_n;
      const float b = (p_.bias != nullptr && col_in) ? p_.bias[col0 + n] : 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        z(r, c) = epi_logit(acc(r, c), b, p_.softcap, p_.temperature);
        if (col_in) epi_see(st[r], z(r, c), n == tcol[r]);
      }
    }
    // Merge over the row's quad (checks d, e): a butterfly, so that all four end with the
    // same (m, z_t) (epi_merge is symmetric).
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int mask = 1; mask < kRowThreads; mask <<= 1) {
        EpiRow other;
        other.m = __shfl_xor_sync(0xffffffffu, st[r].m, mask);
        other.zt = __shfl_xor_sync(0xffffffffu, st[r].zt, mask);
        st[r] = epi_merge(st[r], other);
      }
    }

    // Steps 2-3: E = exp(z - r_tile) (0 at the target), its fp32 row sum, and the bf16 stores
    // of E softcap'(z) (epi_stored: E itself without softcap).
    // The stores go straight from registers to global memory, two adjacent columns (4 bytes) per
    // store (check c): a quad writes 16 contiguous bytes of a row. Staging the tile in shared
    // memory for a TMA store would write full lines; left for later (it needs a 64 KiB bf16
    // tile of shared memory next to the 192 KiB mainloop stages, i.e. one stage less, or a
    // sub-tiled store pipeline).
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int m = get<0>(crd(r, 0));
      const bool row_in = m < residue_m;
      const int64_t i = row0 + m;
      const float ref = epi_ref(st[r].m);
      __nv_bfloat16* e_row = p_.e + i * p_.e_ld + col0;
      float s = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kCols; c += 2) {
        const int n = get<1>(crd(r, c));  // even; n + 1 is column c + 1's (check c)
        const bool in0 = n < residue_n, in1 = n + 1 < residue_n;
        const float e0 = in0 ? epi_exp(z(r, c), ref, n == tcol[r]) : 0.f;
        const float e1 = in1 ? epi_exp(z(r, c + 1), ref, n + 1 == tcol[r]) : 0.f;
        s += e0;
        s += e1;
        const float q0 = epi_stored(e0, z(r, c), p_.softcap, p_.temperature);
        const float q1 = epi_stored(e1, z(r, c + 1), p_.softcap, p_.temperature);
        if (row_in && in1) {
          __nv_bfloat162 pair;
          pair.x = __float2bfloat16_rn(q0);
          pair.y = __float2bfloat16_rn(q1);
          *reinterpret_cast<__nv_bfloat162*>(e_row + n) = pair;
        } else if (row_in && in0) {
          e_row[n] = __float2bfloat16_rn(q0);
        }
      }
      // The row's sum over its quad in a fixed order; every lane ends with the same bits (fp32
      // addition is commutative, and the pairs are summed as pairs on all four lanes).
      CUTLASS_PRAGMA_UNROLL
      for (int mask = 1; mask < kRowThreads; mask <<= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, mask);
      }
      if (row_in && thread_idx % kRowThreads == 0) {
        epi_store_partial(p_.partials + (i * p_.tiles + n_tile) * kPartialCols, st[r].m, s,
                          st[r].zt);
      }
    }
  }

 private:
  Params p_;
};

// ---------------------------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------------------------
using CollectiveEpilogue =
    cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<FusedLogitsEpilogue>;

// x [n, d] row-major is A = (M, K) K-major (RowMajor); w [v, d] row-major is B = (N, K) K-major,
// which CUTLASS's (K, N) convention calls ColumnMajor.
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementX, cutlass::layout::RowMajor, kAlignment,
    ElementW, cutlass::layout::ColumnMajor, kAlignment,
    ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCount<kNumStages>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

// Persistent (one CTA per SM, tiles from the static persistent scheduler): its workspace is 0.
using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>,  // (M = n, N = v, K = d, L = 1)
    CollectiveMainloop, CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

static_assert(GemmKernel::SharedStorageSize <= 227 * 1024, "kNumStages do not fit");

// ---------------------------------------------------------------------------------------------
// The host side.
// ---------------------------------------------------------------------------------------------
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Shapes CUTLASS takes as int, and TMA's 16-byte rule for x, w and E.
bool operands_ok(const FusedLogitsParams& p) {
  if (p.n <= 0 || p.v <= 0 || p.d <= 0 || p.n > INT_MAX || p.v > INT_MAX || p.d > INT_MAX) {
    return false;
  }
  return aligned16(p.x) && aligned16(p.w) && aligned16(p.e) && p.x_ld % kAlignment == 0 &&
         p.w_ld % kAlignment == 0 && p.e_ld % kAlignment == 0 && p.d % kAlignment == 0 &&
         p.x_ld >= p.d && p.w_ld >= p.d && p.e_ld >= p.v;
}

int sm_count_of(int device) {
  int sm_count = 0;
  if (cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return sm_count;
}

// Whether the device runs this module's sm_90a kernel, asked once per device and process (a few
// microseconds of host work, no stream work: safe under graph capture). An sm_90a cubin reports
// binary and PTX version 9.0; anything else here (an sm_80 cubin, PTX of another arch
// JIT-compiled) would run CUTLASS's stub body, which prints an error and stores nothing. (An
// sm_90 cubin or compute_90 PTX without 'a' would report 9.0 / 9.0 as well: the build leaves
// this file out when the arch list has one, python/flce/_build.py cutlass_include.)
bool device_runs_kernel(int device) {
  static std::atomic<int> known[64] = {};  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= 64) return false;
  const int k = known[device].load(std::memory_order_relaxed);
  if (k != 0) return k == 1;
  int major = 0, minor = 0;
  cudaFuncAttributes attr{};
  const bool yes =
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
      major == 9 && minor == 0 &&
      cudaFuncGetAttributes(&attr, cutlass::device_kernel<GemmKernel>) == cudaSuccess &&
      attr.binaryVersion == 90 && attr.ptxVersion == 90;
  (void)cudaGetLastError();  // a failed query is not the next launch's error
  known[device].store(yes ? 1 : 2, std::memory_order_relaxed);
  return yes;
}

// CUTLASS's arguments for p on a device of sm_count SMs: x [n, d] is A = (M, K) K-major, w [v, d]
// is B = (N, K) K-major.
Gemm::Arguments make_args(const FusedLogitsParams& p, int device, int sm_count) {
  Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = cute::make_shape(int(p.n), int(p.v), int(p.d), 1);
  args.mainloop.ptr_A = static_cast<const ElementX*>(p.x);
  args.mainloop.dA = cute::make_stride(p.x_ld, cute::_1{}, int64_t(0));
  args.mainloop.ptr_B = static_cast<const ElementW*>(p.w);
  args.mainloop.dB = cute::make_stride(p.w_ld, cute::_1{}, int64_t(0));
  args.epilogue = EpilogueParams{p.bias,          p.softcap,
                                 p.temperature,   p.target,
                                 p.target_stride, p.col_offset,
                                 p.ignore_index,  p.v,
                                 static_cast<__nv_bfloat16*>(p.e), p.e_ld,
                                 p.partials,      (p.v + kFusedTileCols - 1) / kFusedTileCols};
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

cudaError_t status_error(cutlass::Status s) {
  if (s == cutlass::Status::kSuccess) return cudaSuccess;
  const cudaError_t last = cudaGetLastError();
  return last != cudaSuccess ? last : cudaErrorUnknown;
}

}  // namespace

// The operands, the device, then CUTLASS's own checks and no workspace (there is no allocator
// here: a configuration that needed one is refused rather than run without it). The caller may
// ask before it has E, the partials or the targets: stand-ins at an aligned address (only their
// alignment is read).
bool fused_logits_sm90_supported(const FusedLogitsParams& p) {
  if (!operands_ok(p)) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const int sm_count = sm_count_of(device);
  if (sm_count <= 0 || !device_runs_kernel(device)) return false;
  FusedLogitsParams q = p;
  void* const stand_in = reinterpret_cast<void*>(uintptr_t{256});
  if (q.e == nullptr) q.e = stand_in;
  if (q.partials == nullptr) q.partials = static_cast<float*>(stand_in);
  if (q.target == nullptr) q.target = static_cast<const int64_t*>(stand_in);
  const Gemm::Arguments args = make_args(q, device, sm_count);
  return Gemm::get_workspace_size(args) == 0 &&
         Gemm::can_implement(args) == cutlass::Status::kSuccess;
}

cudaError_t launch_fused_logits_sm90(const FusedLogitsParams& p, cudaStream_t stream) {
  if (p.e == nullptr || p.partials == nullptr || p.target == nullptr ||
      !fused_logits_sm90_supported(p)) {
    return cudaErrorNotSupported;
  }
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  Gemm gemm;
  cutlass::Status s = gemm.initialize(make_args(p, device, sm_count_of(device)), nullptr, stream);
  if (s != cutlass::Status::kSuccess) return status_error(s);
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return status_error(s);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace flce
