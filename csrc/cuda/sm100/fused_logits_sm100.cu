// The fused logits GEMM for Blackwell (sm_100a): acc = x . w^T on CUTLASS 4.2's sm100 TMA + UMMA
// (tcgen05) warp-specialized persistent mainloop with TMEM accumulators, and an epilogue of our
// own that keeps no logits. For every (row, 256-column tile) it stores E softcap'(z),
// E = exp(z - r_tile), in bf16 and one partial (m, s, z_t, 0, 0); the arithmetic is
// flce/tile_epilogue.h's, exactly as in the sm_90a kernel (csrc/cuda/sm90/fused_logits_sm90.cu),
// and the SIMT stand-in launch_logits_epilogue is what it is to be checked against.
//
// Where the accumulators come from. The sm100 kernel (cutlass/gemm/kernel/
// sm100_gemm_tma_warpspecialized.hpp) runs warp 0 = MMA (one thread issues tcgen05.mma into
// TMEM), warp 1 = CLC tile scheduler, warp 2 = TMA loads, warp 3 = epilogue loads (idle here),
// warps 4-7 = 128 epilogue threads. Per tile, the epilogue warps call
// CollectiveEpilogue::store(..., accumulator_pipeline, state, ..., accumulators (a TMEM tensor),
// ...). cutlass::epilogue::collective::detail::Sm100TmaWarpSpecializedAdapter<Op> (detail.hpp)
// turns an operator-style epilogue Op into that interface: it waits for the accumulator stage
// (acc_pipeline.consumer_wait) and calls Op::operator()<ReuseTmem>(acc_pipeline, state,
// problem_shape, cta_tile, cta_coord, accumulators, smem) - the TMEM tensor itself, not
// registers. Op must load TMEM (tcgen05.ld), release the stage (tcgen05.wait::ld, then
// acc_pipeline.consumer_release) and return the advanced state. This is the same hook that
// CUTLASS's own Sm100NoSmemWarpSpecialized epilogue uses (sm100_epilogue_nosmem.hpp); ours
// replaces its body. No CUTLASS header is modified and no CUTLASS code is copied.
//
// Two passes over TMEM. 128 x 256 fp32 accumulators over 128 epilogue threads are 256 values per
// thread: more than the 255 registers a thread may have, so the tile cannot sit in registers at
// once (sm90's 2 consumer warpgroups held 128 each). The tile's max is needed before the first
// E, so the epilogue reads the tile from TMEM twice, in 8 chunks of 32 columns each time:
// pass 1 computes z and the row's (m, z_t); pass 2 reloads, recomputes z (bias, softcap,
// temperature: a few FLOPs, cheaper than a third round trip to store z) and computes E, s and
// the stores. TMEM stays allocated to this tile until the last load of pass 2; the MMA warp
// meanwhile fills the other accumulator stage (2 stages x 256 columns = the 512 TMEM columns).
//
// Thread -> row. The TMEM load is SM100_TMEM_LOAD_32dp32b32x (tcgen05.ld.32x32b.x32): each
// thread reads one TMEM lane (data path), 32 consecutive 32-bit columns. For the 1-SM M=128 UMMA
// a TMEM lane is a tile row, so every thread owns whole rows: no shuffle, no cross-thread
// reduction at all. verify_row_per_thread proves it at compile time from CuTe's own partition.
//
// Built by setup.py / CMake where the arch list has 10.0a and CUTLASS's headers are found
// (FLCE_WITH_CUTLASS_SM100; flce_fused.cu has the stub otherwise), for every gencode of the
// build (sm_80, sm_90a, sm_100, sm_100a): CUTLASS's sm100 kernel
// has no arch guard of its own (unlike the sm90 ones' ENABLE_SM90_KERNEL_LEVEL), so
// Sm100aOnlyKernel below compiles the real body only where __CUDA_ARCH_FEAT_SM100_ALL is defined
// (the sm_100a device pass) and a stub everywhere else. The stub carries a static shared-memory
// marker, which is how the host tells the images apart (device_runs_kernel).
//
// NDEBUG (defined below for this file) keeps CUTLASS's device assert()s (an extern __assertfail
// call) out of the warp-specialized kernel; see the sm90 file for what they cost there.
#ifndef NDEBUG
#define NDEBUG  // before any include: CUTLASS's device assert()s
#endif

#include "cuda/params.h"
#include "flce/tile_epilogue.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

// CUTLASS 4.2's sm100 collectives trip nvcc's C++20 warning on implicit `this` captures (#2908);
// not ours to fix.
#pragma nv_diagnostic push
#pragma nv_diag_suppress 2908
#include "cute/atom/copy_traits_sm100.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#pragma nv_diagnostic pop

#include "cuda/fused_gemm_host.h"

// The real kernel is compiled in the sm_100a device pass only; make sure CuTe compiled its
// tcgen05 instructions there (without these it silently compiles 'brkpt' fallbacks).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM100_ALL)
#if !defined(CUTLASS_ARCH_MMA_SM100A_ENABLED) || !defined(CUTE_ARCH_TCGEN05_TMEM_ENABLED) || \
    !defined(CUTE_ARCH_TCGEN05_F16F32_MMA_ENABLED) || !defined(CUTLASS_ARCH_CLC_ENABLED)
#error "sm_100a pass without CUTLASS's tcgen05 / CLC support (CUDA >= 12.8 and CUTLASS >= 3.8)"
#endif
#define FLCE_SM100A_DEVICE_PASS 1
#endif

namespace flce {
namespace cuda {
namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// Configuration.
// ---------------------------------------------------------------------------------------------

// MMA / CTA tile [BLOCK_M=128 rows (tokens), BLOCK_N=256 vocab columns, BLOCK_K=64]: BLOCK_N is
// the partials' column tile (kFusedTileCols), so one CTA tile is one (row block, partial tile)
// and the epilogue needs no cross-CTA reduction. One 1-SM tcgen05.mma of 128 x 256 x 16 per
// K step; the accumulator is 128 TMEM lanes x 256 columns (fp32), two stages = all 512 columns.
constexpr int BLOCK_M = 128;
constexpr int BLOCK_N = kFusedTileCols;
constexpr int BLOCK_K = 64;
static_assert(BLOCK_N == 256, "the partials' tile is the CTA tile's N");

// Shared memory per stage: A [128 x 64] + B [256 x 64] bf16 = 16 KiB + 32 KiB = 48 KiB; 4 stages
// = 192 KiB of the 227 KiB an sm_100 CTA may have (the epilogue uses none; barriers, CLC
// responses and the TMEM base pointer a few hundred bytes). A fifth stage would not fit. This is
// also what the builder's StageCountAuto computes.
constexpr int kNumStages = 4;

// Cluster 1 x 1 and the 1-SM MMA, as on sm90: a 2-SM MMA (M = 256 over a CTA pair) or a
// multicast cluster would round the rows up to 256 (or the cluster), a second fully masked CTA
// for the chunks of <= 128 rows this path sees.
using ClusterShape = Shape<_1, _1, _1>;
using MmaTileShape = Shape<Int<BLOCK_M>, Int<BLOCK_N>, Int<BLOCK_K>>;

using ElementX = fused_gemm::Element;  // A operand: x [n, d], K-major
using ElementW = fused_gemm::Element;  // B operand: w [v, d], K-major
using ElementAccumulator = float;
constexpr int kAlignment = fused_gemm::kAlignment;  // TMA: 16-byte aligned rows

// The epilogue's TMEM -> register step: chunks of [128 rows, 32 columns], one tcgen05.ld
// 32x32b.x32 per warp and chunk (each warp reads its 32 TMEM lanes, each thread one lane).
constexpr int kChunkCols = 32;
constexpr int kChunks = BLOCK_N / kChunkCols;
static_assert(kChunks * kChunkCols == BLOCK_N, "whole chunks");
constexpr int kEpilogueThreads = 128;  // warps 4-7 of the sm100 kernel
using EpilogueTile = Shape<Int<BLOCK_M>, Int<kChunkCols>>;
using CopyOpT2R = SM100_TMEM_LOAD_32dp32b32x;
// The stores: 8 bf16 = one 16-byte store per thread.
constexpr int kStoreCols = 8;
static_assert(kChunkCols % kStoreCols == 0 && BLOCK_N % kChunkCols == 0);

// ---------------------------------------------------------------------------------------------
// Compile-time proof, from CuTe's partition of the CTA tile by the TMEM load (the same
// make_tmem_copy / tidfrg_D that partitions the TMEM tensor and the coordinate tensor at run
// time), of what the epilogue assumes about each thread's fragment of chunk j:
//   a. all values a thread holds, in every chunk, lie in one tile row;
//   b. the 128 threads hold 128 distinct rows (so all BLOCK_M rows; with a: a thread holds all
//      256 columns of its row, since the partition is a bijection of 128 x 256 values);
//   c. value v of chunk j is tile column j * kChunkCols + v, for every thread (so the column is
//      a compile-time constant, the bias one uniform load, and 8 consecutive values 8
//      consecutive bf16 in memory: 16-byte stores).
// A row therefore needs no cross-thread reduction at all: each thread folds its own row.
// ---------------------------------------------------------------------------------------------
template <class TiledT2R>
constexpr bool verify_row_per_thread() {
  // (m, n) -> m + BLOCK_M * n over the CTA tile, divided into the chunks as the TMEM tensor is.
  using Full = Layout<Shape<Int<BLOCK_M>, Int<BLOCK_N>>>;
  constexpr auto tiled = flat_divide(Full{}, EpilogueTile{});  // (128, 32, 1, kChunks)
  // (thread, value, rest) -> m + BLOCK_M * n, as ThrCopy::partition_D builds it.
  constexpr auto part = TiledT2R::tidfrg_D(tiled);
  constexpr auto thr = layout<0>(part);
  // One thread's fragment: (T2R, T2R_M, T2R_N, EPI_M, EPI_N) -> offset, as at run time.
  constexpr auto frag = part(0, _, repeat<4>(_));
  static_assert(decltype(rank(frag))::value == 5, "(T2R, T2R_M, T2R_N, EPI_M, EPI_N)");
  constexpr auto chunk = take<0, 3>(frag);  // one chunk's values
  constexpr int kThreads = decltype(size(thr))::value;
  constexpr int kValues = decltype(size(chunk))::value;
  static_assert(kThreads == kEpilogueThreads, "one TMEM lane per epilogue thread");
  static_assert(kValues == kChunkCols, "a chunk is 32 values per thread");
  static_assert(decltype(size<3>(frag))::value == 1 &&
                    decltype(size<4>(frag))::value == kChunks,
                "the chunks tile N only");
  int thr_off[kThreads] = {};
  int val_off[kValues] = {};
  int chunk_off[kChunks] = {};
  for (int t = 0; t < kThreads; ++t) thr_off[t] = int(thr(t));
  for (int v = 0; v < kValues; ++v) val_off[v] = int(chunk(v));
  for (int j = 0; j < kChunks; ++j) chunk_off[j] = int(layout<4>(frag)(j));
  bool seen[BLOCK_M] = {};
  for (int t = 0; t < kThreads; ++t) {
    const int m = thr_off[t] % BLOCK_M;
    for (int j = 0; j < kChunks; ++j) {
      for (int v = 0; v < kValues; ++v) {
        const int idx = thr_off[t] + chunk_off[j] + val_off[v];
        if (idx % BLOCK_M != m) return false;                       // a
        if (idx / BLOCK_M != j * kChunkCols + v) return false;      // c
      }
    }
    if (seen[m]) return false;                                      // b
    seen[m] = true;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// The epilogue (operator-style, plugged in by Sm100TmaWarpSpecializedAdapter; no shared memory,
// no epilogue load warp, no workspace).
// ---------------------------------------------------------------------------------------------

class FusedLogitsEpilogue : public fused_gemm::EpilogueBase {
 public:
  // What the sm100 kernel and the device adapter name besides the base's.
  using EpilogueTile = flce::cuda::EpilogueTile;
  using CopyOpT2R = flce::cuda::CopyOpT2R;  // also handed to the scheduler's (no-op) fixup
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using DispatchPolicy = cutlass::epilogue::NoSmemWarpSpecialized1Sm;
  static constexpr int ThreadCount = kEpilogueThreads;
  static constexpr uint32_t TmaTransactionBytes = 0;  // no epilogue loads

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    // 16-byte stores of 8 bf16: E's base and row stride 16-byte aligned.
    return args_ok(problem_shape, args, kStoreCols);
  }

  CUTLASS_HOST_DEVICE
  FusedLogitsEpilogue(Params const& params, SharedStorage const& = SharedStorage()) : p_(params) {}

  // One (row block, column tile): accumulators is the TMEM tensor ((128, 256), 1, 1) of this
  // tile's accumulator stage, already waited for (consumer_wait) by the adapter.
  template <bool ReuseTmem, class AccumulatorPipeline, class AccumulatorPipelineState,
            class ProblemShapeMNKL, class CtaTileMNK, class CtaCoordMNKL, class AccEngine,
            class AccLayout>
  CUTLASS_DEVICE auto operator()(AccumulatorPipeline acc_pipeline,
                                 AccumulatorPipelineState acc_pipe_consumer_state,
                                 ProblemShapeMNKL problem_shape_mnkl, CtaTileMNK,
                                 CtaCoordMNKL cta_coord_mnkl,
                                 cute::Tensor<AccEngine, AccLayout> const& accumulators,
                                 SharedStorage&) {
    static_assert(!ReuseTmem, "overlapping accumulators (1 TMEM stage) are not handled");
    static_assert(is_tmem<AccEngine>::value, "accumulators live in TMEM");
    static_assert(is_same_v<typename AccEngine::value_type, float>, "fp32 accumulators");
    static_assert(size<0>(CtaTileMNK{}) == BLOCK_M && size<1>(CtaTileMNK{}) == BLOCK_N);
    static_assert(rank(ProblemShapeMNKL{}) == 4 && rank(CtaCoordMNKL{}) == 4);

    const int thread_idx = int(threadIdx.x % ThreadCount);  // warp w % 4 reads TMEM lanes 32 w..
    const int m_tile = int(get<0>(cta_coord_mnkl));
    const int n_tile = int(get<1>(cta_coord_mnkl));
    const int64_t row0 = int64_t(m_tile) * BLOCK_M;
    const int64_t col0 = int64_t(n_tile) * BLOCK_N;
    // Rows / columns of the tile inside the problem (may exceed the tile). TMA zero-fills the
    // operands' out-of-bounds rows, so the accumulators there are 0: finite, and never stored.
    const int residue_m = int(get<0>(problem_shape_mnkl)) - m_tile * BLOCK_M;
    const int residue_n = int(get<1>(problem_shape_mnkl)) - n_tile * BLOCK_N;

    // The tile (CTA_M, CTA_N) in TMEM, its chunks (CTA_M, 32, 1, kChunks), and this thread's
    // share: (T2R, T2R_M, T2R_N, EPI_M, EPI_N), for TMEM and for the (m, n) coordinates alike.
    Tensor tAcc = accumulators(make_coord(_, _), _0{}, _0{});
    static_assert(decltype(size<0>(tAcc))::value == BLOCK_M &&
                  decltype(size<1>(tAcc))::value == BLOCK_N);
    Tensor tAcc_epi = flat_divide(tAcc, EpilogueTile{});
    auto tiled_t2r = make_tmem_copy(CopyOpT2R{}, tAcc_epi(_, _, _0{}, _0{}));
    static_assert(verify_row_per_thread<decltype(tiled_t2r)>(),
                  "the TMEM load does not give each thread one whole row in column order");
    auto thr_t2r = tiled_t2r.get_slice(thread_idx);
    Tensor tTR_tAcc = thr_t2r.partition_S(tAcc_epi);
    Tensor cD_epi = flat_divide(make_identity_tensor(make_shape(Int<BLOCK_M>{}, Int<BLOCK_N>{})),
                                EpilogueTile{});
    Tensor tTR_cD = thr_t2r.partition_D(cD_epi);
    Tensor tTR_rAcc = make_tensor<float>(shape(tTR_cD(_, _, _, _0{}, _0{})));  // 32 fp32
    static_assert(decltype(size(tTR_rAcc))::value == kChunkCols);

    // This thread's row (check a: the same for all its values) and its target column.
    const int m = int(get<0>(tTR_cD(0)));
    const bool row_in = m < residue_m;
    const int64_t i = row0 + m;
    // the target's column within this tile; -1: not here, ignored, out of range
    const int tcol = row_in ? epi_tile_target(p_.target[i * p_.target_stride], p_.ignore_index,
                                              p_.col_offset, p_.v, col0, BLOCK_N)
                            : -1;
    const float* bias = p_.bias != nullptr ? p_.bias + col0 : nullptr;

    // Pass 1: the logits z and the row's (m, z_t) over the whole 256-column tile. The column
    // conditions are uniform over the CTA (residue_n), and every tcgen05.ld below is executed by
    // all 32 lanes of each warp (.sync.aligned), whatever the row.
    EpiRow st = epi_row_empty();
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kChunks; ++j) {
      copy(tiled_t2r, tTR_tAcc(_, _, _, _0{}, j), tTR_rAcc);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kChunkCols; ++c) {
        const int n = j * kChunkCols + c;  // check c
        if (n < residue_n) {
          const float b = bias != nullptr ? bias[n] : 0.f;
          epi_see(st, epi_logit(tTR_rAcc(c), b, p_.softcap, p_.temperature), n == tcol);
        }
      }
    }

    // Pass 2: reload, E = exp(z - r_tile) (0 at the target), its fp32 row sum in column order,
    // and the bf16 stores of E softcap'(z). The accumulator stage goes back to the MMA warp
    // after the last TMEM load (tcgen05.wait::ld first: the loads must have read TMEM before
    // the next tile's MMAs overwrite it), before the last chunk's arithmetic and stores.
    const float ref = epi_ref(st.m);
    __nv_bfloat16* e_row = p_.e + i * p_.e_ld + col0;
    float s = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kChunks; ++j) {
      copy(tiled_t2r, tTR_tAcc(_, _, _, _0{}, j), tTR_rAcc);
      if (j == kChunks - 1) {
        cutlass::arch::fence_view_async_tmem_load();
        acc_pipeline.consumer_release(acc_pipe_consumer_state);
        ++acc_pipe_consumer_state;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kChunkCols; g += kStoreCols) {
        const int n0 = j * kChunkCols + g;
        uint32_t packed[kStoreCols / 2];
        float q[kStoreCols];
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kStoreCols; ++k) {
          const int n = n0 + k;
          const bool col_in = n < residue_n;
          const float b = (bias != nullptr && col_in) ? bias[n] : 0.f;
          const float z = epi_logit(tTR_rAcc(g + k), b, p_.softcap, p_.temperature);
          const float e = col_in ? epi_exp(z, ref, n == tcol) : 0.f;
          s += e;
          q[k] = epi_stored(e, z, p_.softcap, p_.temperature);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kStoreCols; k += 2) {
          const __nv_bfloat162 pair = __floats2bfloat162_rn(q[k], q[k + 1]);
          packed[k / 2] = reinterpret_cast<const uint32_t&>(pair);
        }
        if (row_in) {
          if (n0 + kStoreCols <= residue_n) {
            // 16 bytes: e (16-byte aligned), e_ld % 8 == 0, col0 % 256 == 0, n0 % 8 == 0.
            *reinterpret_cast<uint4*>(e_row + n0) =
                make_uint4(packed[0], packed[1], packed[2], packed[3]);
          } else {
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < kStoreCols; ++k) {
              if (n0 + k < residue_n) e_row[n0 + k] = __float2bfloat16_rn(q[k]);
            }
          }
        }
      }
    }
    if (row_in) {
      epi_store_partial(p_.partials + (i * p_.tiles + n_tile) * kPartialCols, st.m, s, st.zt);
    }
    return cute::make_tuple(acc_pipe_consumer_state);
  }

 private:
  Params p_;
};

// ---------------------------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------------------------
static_assert(FusedLogitsEpilogue::TmaTransactionBytes == 0, "no epilogue TMA loads");

using CollectiveEpilogue =
    cutlass::epilogue::collective::detail::Sm100TmaWarpSpecializedAdapter<FusedLogitsEpilogue>;

// x [n, d] row-major is A = (M, K) K-major (RowMajor); w [v, d] row-major is B = (N, K) K-major,
// which CUTLASS's (K, N) convention calls ColumnMajor.
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp,
    ElementX, cutlass::layout::RowMajor, kAlignment,
    ElementW, cutlass::layout::ColumnMajor, kAlignment,
    ElementAccumulator, MmaTileShape, ClusterShape,
    cutlass::gemm::collective::StageCount<kNumStages>,
    cutlass::gemm::KernelTmaWarpSpecialized1SmSm100>::CollectiveOp;

// Persistent, tiles from the CLC (cluster launch control) scheduler: the grid is one CTA per
// tile and running CTAs steal the tiles of CTAs not yet started. Its workspace is 0.
using GemmKernelBase = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>,  // (M = n, N = v, K = d, L = 1)
    CollectiveMainloop, CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;

static_assert(!GemmKernelBase::IsOverlappingAccum, "two TMEM accumulator stages");
static_assert(GemmKernelBase::AccumulatorPipelineStageCount == 2);
static_assert(GemmKernelBase::NumEpilogueThreads == kEpilogueThreads);
static_assert(GemmKernelBase::SharedStorageSize <= cutlass::arch::sm100_smem_capacity_bytes,
              "kNumStages do not fit");

// Static shared memory of the stub image (bytes); the real one has none (its shared memory is
// all dynamic: SharedStorageSize).
constexpr int kStubMarkerWords = 24;
static_assert(kStubMarkerWords > 0, "the stub's marker must be visible in sharedSizeBytes");

// CUTLASS's sm100 kernel with the body compiled in the sm_100a device pass only; every other
// pass (sm_80, sm_90a, plain sm_100, or PTX JIT-compiled from them) gets a stub that stores
// nothing and declares kStubMarkerWords words of static shared memory that
// cudaFuncGetAttributes reports (sharedSizeBytes) and the host checks (it never launches it).
struct Sm100aOnlyKernel : GemmKernelBase {
  CUTLASS_DEVICE void operator()(typename GemmKernelBase::Params const& params, char* smem_buf) {
#if defined(__CUDA_ARCH__)
#if defined(FLCE_SM100A_DEVICE_PASS)
    GemmKernelBase::operator()(params, smem_buf);
#else
    (void)params;
    (void)smem_buf;
    __shared__ uint32_t stub_marker[kStubMarkerWords];
    volatile uint32_t* const marker = stub_marker;  // volatile: ptxas keeps the array
    if (threadIdx.x < kStubMarkerWords) marker[threadIdx.x] = threadIdx.x;
#endif
#endif
  }
};

using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Sm100aOnlyKernel>;

// Whether the current device runs this module's sm_100a kernel, asked once per device
// (fused_gemm::once_per_device). On a 10.0 device the driver picks one image of this module:
// the sm_100a cubin (the real kernel) or, where the build also has plain sm_100 SASS or
// compute_100 PTX, possibly that one, which compiled the stub. Both
// report binary and PTX version 10.0, so the check is the stub's static shared memory
// (sharedSizeBytes = 4 * kStubMarkerWords; the real kernel declares none): it relies on the
// sm_100a pass being the only one that compiles the real body (FLCE_SM100A_DEVICE_PASS, i.e.
// __CUDA_ARCH_FEAT_SM100_ALL), which this file guarantees whatever the gencode list.
bool device_runs_kernel(int device) {
  static std::atomic<int> known[64] = {};
  return fused_gemm::once_per_device(known, device, [](int dev) {
    int major = 0, minor = 0;
    fused_gemm::capability(dev, major, minor);
    cudaFuncAttributes attr{};
    return major == 10 && minor == 0 &&
           cudaFuncGetAttributes(&attr, cutlass::device_kernel<Sm100aOnlyKernel>) ==
               cudaSuccess &&
           attr.binaryVersion == 100 && attr.ptxVersion == 100 && attr.sharedSizeBytes == 0;
  });
}

}  // namespace

bool fused_logits_sm100_supported(const FusedLogitsParams& p) {
  return fused_gemm::supported<Gemm>(p, device_runs_kernel);
}

cudaError_t launch_fused_logits_sm100(const FusedLogitsParams& p, cudaStream_t stream) {
  if (p.e == nullptr || p.partials == nullptr || p.target == nullptr ||
      !fused_logits_sm100_supported(p)) {
    return cudaErrorNotSupported;
  }
  return fused_gemm::launch<Gemm>(p, stream);
}

}  // namespace cuda
}  // namespace flce
