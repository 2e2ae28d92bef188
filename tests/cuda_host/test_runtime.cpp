// Tests of the host SIMT runtime itself (tools/cuda_host): thread indexing, barriers, warp
// shuffles and votes, launch limits, the shared-memory race detector, and every error the runtime
// must report instead of hanging or answering wrong. Tests named race_* need the race-checked
// build (kernels compiled with -fsanitize=thread) and are registered only there.
//
// Each error test also runs the corrected kernel, so that it shows the report is caused by the
// planted bug and not by the runtime rejecting everything.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "device.cuh"
#include "harness.h"

using flce::cuda::launch_kernel;
using harness::DeviceBuffer;
using harness::failed_with;

namespace {

template <auto K, typename... A>
cudaError_t run(dim3 grid, dim3 block, std::size_t smem, const A&... args) {
  launch_kernel<K>(grid, block, smem, nullptr, args...);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Thread and block indexing
// ---------------------------------------------------------------------------------------------

__global__ void index_kernel(uint32_t* out) {
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned nt = blockDim.x * blockDim.y * blockDim.z;
  uint32_t* o = out + 4 * (b * nt + t);
  o[0] = threadIdx.x | threadIdx.y << 8 | threadIdx.z << 16;
  o[1] = blockIdx.x | blockIdx.y << 8 | blockIdx.z << 16;
  o[2] = blockDim.x | blockDim.y << 8 | blockDim.z << 16;
  o[3] = gridDim.x | gridDim.y << 8 | gridDim.z << 16;
}

TEST(indexing_3d) {
  const dim3 grid(3, 2, 2), block(8, 4, 3);
  const int nb = 12, nt = 96;
  DeviceBuffer<uint32_t> out(4 * nb * nt, 0xdeadbeefu);
  EXPECT(run<index_kernel>(grid, block, 0, out.data()) == cudaSuccess, "launch");
  int bad = 0;
  for (unsigned bz = 0; bz < 2; ++bz)
    for (unsigned by = 0; by < 2; ++by)
      for (unsigned bx = 0; bx < 3; ++bx)
        for (unsigned tz = 0; tz < 3; ++tz)
          for (unsigned ty = 0; ty < 4; ++ty)
            for (unsigned tx = 0; tx < 8; ++tx) {
              const unsigned b = bx + 3 * (by + 2 * bz), t = tx + 8 * (ty + 4 * tz);
              const uint32_t* o = &out[4 * (b * nt + t)];
              bad += o[0] != (tx | ty << 8 | tz << 16);
              bad += o[1] != (bx | by << 8 | bz << 16);
              bad += o[2] != (8u | 4u << 8 | 3u << 16);
              bad += o[3] != (3u | 2u << 8 | 2u << 16);
            }
  EXPECT(bad == 0, "%d wrong index values", bad);
}

// ---------------------------------------------------------------------------------------------
// Barriers and dynamic shared memory
// ---------------------------------------------------------------------------------------------

// Block-wide tree sum through shared memory: needs every barrier.
__global__ void block_sum_kernel(const float* x, float* out) {
  FLCE_DYNAMIC_SHARED(smem);
  float* s = reinterpret_cast<float*>(smem);
  const unsigned t = threadIdx.x;
  s[t] = x[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (t < half) s[t] += s[t + half];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

TEST(barrier_tree_sum) {
  const int blocks = 5, threads = 256;
  std::vector<float> x(blocks * threads);
  for (float& v : x) v = static_cast<float>(static_cast<int>(check::uniform(-100, 100)));
  DeviceBuffer<float> dx(x), out(blocks, harness::qnan());
  EXPECT(run<block_sum_kernel>(dim3(blocks), dim3(threads), threads * 4, dx.data(), out.data()) ==
             cudaSuccess,
         "launch: %s", flce::host::last_error_message().c_str());
  for (int b = 0; b < blocks; ++b) {
    const float ref = std::accumulate(x.begin() + b * threads, x.begin() + (b + 1) * threads, 0.f);
    EXPECT(out[b] == ref, "block %d: %g vs %g", b, out[b], ref);  // integers: exact
  }
}

// The arena is poisoned (0xff bytes: NaN) before every block, so a read of shared memory that
// no thread of this block wrote sees NaN, even where an earlier block left a value.
__global__ void stale_smem_kernel(float* out) {
  FLCE_DYNAMIC_SHARED(smem);
  float* s = reinterpret_cast<float*>(smem);
  if (blockIdx.x == 0) s[threadIdx.x] = 1.f;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
}

TEST(smem_poisoned_per_block) {
  if (harness::race_checked_build()) return;  // there the read itself is reported (race_*)
  DeviceBuffer<float> out(64, 0.f);
  EXPECT(run<stale_smem_kernel>(dim3(2), dim3(32), 128, out.data()) == cudaSuccess, "launch");
  for (int i = 0; i < 32; ++i) EXPECT(out[i] == 1.f, "block 0 [%d] = %g", i, out[i]);
  for (int i = 32; i < 64; ++i) EXPECT(std::isnan(out[i]), "block 1 [%d] = %g", i, out[i]);
  uint32_t bits;
  std::memcpy(&bits, &out[40], 4);
  EXPECT(bits == 0xffffffffu, "poison pattern 0x%08x", bits);
}

__global__ void early_return_kernel(int* out, int bad) {
  if (bad && threadIdx.x >= 200) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

TEST(partial_barrier_reported) {
  DeviceBuffer<int> out(256, 0);
  EXPECT(run<early_return_kernel>(dim3(1), dim3(256), 0, out.data(), 0) == cudaSuccess, "clean");
  EXPECT(failed_with(run<early_return_kernel>(dim3(1), dim3(256), 0, out.data(), 1),
                     cudaErrorLaunchFailure, "barrier reached by only part of the block"),
         "partial barrier");
  EXPECT(flce::host::last_error_message().find("threads 200-255 exited") != std::string::npos,
         "names the exited threads: %s", flce::host::last_error_message().c_str());
}

__global__ void divergent_barrier_kernel(int* out, int bad) {
  if (bad && threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

TEST(divergent_barrier_reported) {
  DeviceBuffer<int> out(64, 0);
  EXPECT(run<divergent_barrier_kernel>(dim3(1), dim3(64), 0, out.data(), 0) == cudaSuccess,
         "clean");
  EXPECT(failed_with(run<divergent_barrier_kernel>(dim3(1), dim3(64), 0, out.data(), 1),
                     cudaErrorLaunchFailure, "divergent __syncthreads"),
         "divergent");
}

// Half of warp 0 waits in a shuffle for the other half, which waits at a barrier for it.
__global__ void deadlock_kernel(int* out, int bad) {
  int v = static_cast<int>(threadIdx.x);
  if (bad && threadIdx.x < 16) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else if (bad) {
    __syncthreads();
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

TEST(deadlock_reported) {
  DeviceBuffer<int> out(64, 0);
  EXPECT(run<deadlock_kernel>(dim3(1), dim3(64), 0, out.data(), 0) == cudaSuccess, "clean");
  EXPECT(failed_with(run<deadlock_kernel>(dim3(1), dim3(64), 0, out.data(), 1),
                     cudaErrorLaunchFailure, "deadlock"),
         "deadlock");
  const std::string msg = flce::host::last_error_message();
  EXPECT(msg.find("lanes 0-15 in __shfl_xor_sync") != std::string::npos &&
             msg.find("lanes 16-31 at __syncthreads") != std::string::npos &&
             msg.find("deadlock_kernel") != std::string::npos,
         "the report names the kernel and what each warp waits on:\n%s", msg.c_str());
}

// ---------------------------------------------------------------------------------------------
// Warp shuffles and votes
// ---------------------------------------------------------------------------------------------

__global__ void shfl_kernel(int* out, int width) {
  const int v = static_cast<int>(threadIdx.x) * 7 + 3;
  int* o = out + 8 * threadIdx.x;
  o[0] = __shfl_sync(0xffffffffu, v, static_cast<int>(threadIdx.x) * 5 + 1, width);
  o[1] = __shfl_up_sync(0xffffffffu, v, 3, width);
  o[2] = __shfl_down_sync(0xffffffffu, v, 3, width);
  o[3] = __shfl_xor_sync(0xffffffffu, v, 5, width);
  o[4] = __any_sync(0xffffffffu, threadIdx.x == 37);
  o[5] = __all_sync(0xffffffffu, threadIdx.x < 64);
  o[6] = static_cast<int>(__ballot_sync(0xffffffffu, threadIdx.x % 3 == 0));
  const double d = __shfl_xor_sync(0xffffffffu, 0.5 + threadIdx.x, 16);
  o[7] = static_cast<int>(d * 2);
}

TEST(shuffles_and_votes) {
  for (int width : {32, 16, 8, 4, 2, 1}) {
    DeviceBuffer<int> out(64 * 8, -1);
    EXPECT(run<shfl_kernel>(dim3(1), dim3(64), 0, out.data(), width) == cudaSuccess, "launch");
    for (int t = 0; t < 64; ++t) {
      const int lane = t % 32, warp = t / 32, seg = lane / width * width, li = lane - seg;
      auto val = [&](int l) { return (warp * 32 + l) * 7 + 3; };
      const int* o = &out[8 * t];
      EXPECT(o[0] == val(seg + (lane * 5 + 1) % width), "idx w%d t%d", width, t);
      EXPECT(o[1] == (li >= 3 ? val(lane - 3) : val(lane)), "up w%d t%d", width, t);
      EXPECT(o[2] == (li + 3 < width ? val(lane + 3) : val(lane)), "down w%d t%d", width, t);
      const int x = lane ^ 5;
      EXPECT(o[3] == (x < seg + width ? val(x) : val(lane)), "xor w%d t%d", width, t);
      EXPECT(o[4] == (warp == 1), "any t%d", t);
      EXPECT(o[5] == 1, "all t%d", t);
      unsigned ballot = 0;
      for (int l = 0; l < 32; ++l) ballot |= ((warp * 32 + l) % 3 == 0 ? 1u : 0u) << l;
      EXPECT(static_cast<unsigned>(o[6]) == ballot, "ballot t%d", t);
      EXPECT(o[7] == 2 * (warp * 32 + (lane ^ 16)) + 1, "double xor t%d: %d", t, o[7]);
    }
  }
}

// Two half-warps run independent collectives with disjoint masks.
__global__ void half_warp_kernel(int* out) {
  const unsigned mask = threadIdx.x < 16 ? 0x0000ffffu : 0xffff0000u;
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x < 16) {
    v = __shfl_xor_sync(mask, v, 1);
  } else {
    v = static_cast<int>(__ballot_sync(mask, threadIdx.x % 2));
  }
  out[threadIdx.x] = v;
}

TEST(disjoint_masks) {
  DeviceBuffer<int> out(32, -1);
  EXPECT(run<half_warp_kernel>(dim3(1), dim3(32), 0, out.data()) == cudaSuccess, "%s",
         flce::host::last_error_message().c_str());
  for (int t = 0; t < 16; ++t) EXPECT(out[t] == (t ^ 1), "lane %d", t);
  for (int t = 16; t < 32; ++t) EXPECT(static_cast<unsigned>(out[t]) == 0xaaaa0000u, "lane %d", t);
}

__global__ void exited_lane_kernel(int* out, unsigned mask, int lane5_exits) {
  if (lane5_exits && threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(mask, 1, 0);
}

TEST(collective_with_exited_lane_reported) {
  DeviceBuffer<int> out(32, 0);
  EXPECT(run<exited_lane_kernel>(dim3(1), dim3(31), 0, out.data(), 0x7fffffffu, 0) == cudaSuccess,
         "%s", flce::host::last_error_message().c_str());
  EXPECT(failed_with(run<exited_lane_kernel>(dim3(1), dim3(31), 0, out.data(), 0xffffffffu, 0),
                     cudaErrorLaunchFailure, "not threads of this block"),
         "a full mask in a 31-thread block names a lane that does not exist");
  EXPECT(run<exited_lane_kernel>(dim3(1), dim3(32), 0, out.data(), 0xffffffdfu, 1) == cudaSuccess,
         "%s", flce::host::last_error_message().c_str());
  EXPECT(failed_with(run<exited_lane_kernel>(dim3(1), dim3(32), 0, out.data(), 0xffffffffu, 1),
                     cudaErrorLaunchFailure, "warp collective with an exited lane"),
         "exited lane");
}

__global__ void divergent_collective_kernel(int* out) {
  int v = 1;
  if (threadIdx.x == 3) {
    v = static_cast<int>(__ballot_sync(0xffffffffu, 1));
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  }
  out[threadIdx.x] = v;
}

TEST(divergent_collective_reported) {
  DeviceBuffer<int> out(32, 0);
  EXPECT(failed_with(run<divergent_collective_kernel>(dim3(1), dim3(32), 0, out.data()),
                     cudaErrorLaunchFailure, "divergent warp collectives"),
         "divergent collective");
}

__global__ void shfl_outside_mask_kernel(int* out, unsigned mask) {
  if (mask >> threadIdx.x & 1u) out[threadIdx.x] = __shfl_xor_sync(mask, 1, 1);
}

TEST(shuffle_source_outside_mask_reported) {
  DeviceBuffer<int> out(32, 0);
  EXPECT(run<shfl_outside_mask_kernel>(dim3(1), dim3(32), 0, out.data(), 0x0000000fu) ==
             cudaSuccess,
         "clean");
  EXPECT(failed_with(run<shfl_outside_mask_kernel>(dim3(1), dim3(32), 0, out.data(), 0x00000007u),
                     cudaErrorLaunchFailure, "shuffle from a lane outside the mask"),
         "lane 2 reads lane 3, which is not in the mask");
}

// ---------------------------------------------------------------------------------------------
// Launch limits and the CUDA runtime calls
// ---------------------------------------------------------------------------------------------

__global__ void smem_touch_kernel(int* out) {
  FLCE_DYNAMIC_SHARED(smem);
  smem[threadIdx.x] = 1;
  __syncthreads();
  out[threadIdx.x] = smem[threadIdx.x];
}
__global__ void smem_touch_kernel2(int* out) {
  FLCE_DYNAMIC_SHARED(smem);
  smem[threadIdx.x] = 2;
  __syncthreads();
  out[threadIdx.x] = smem[threadIdx.x];
}

TEST(launch_limits) {
  DeviceBuffer<int> out(1024, 0);
  EXPECT(run<smem_touch_kernel>(dim3(1), dim3(1024), 1024, out.data()) == cudaSuccess, "1024 ok");
  EXPECT(failed_with(run<smem_touch_kernel>(dim3(1), dim3(1025), 2048, out.data()),
                     cudaErrorInvalidConfiguration, "block dimension 0 is 1025"),
         "1025 threads");
  EXPECT(failed_with(run<smem_touch_kernel>(dim3(1), dim3(32, 33), 2048, out.data()),
                     cudaErrorInvalidConfiguration, "1056 threads per block"),
         "32 x 33 threads");
  EXPECT(run<smem_touch_kernel>(dim3(1), dim3(1, 1, 65), 64, out.data()) ==
             cudaErrorInvalidConfiguration,
         "block z 65");
  EXPECT(run<smem_touch_kernel>(dim3(1, 65536), dim3(32), 64, out.data()) ==
             cudaErrorInvalidConfiguration,
         "grid y 65536");
  EXPECT(run<smem_touch_kernel>(dim3(0), dim3(32), 64, out.data()) ==
             cudaErrorInvalidConfiguration,
         "empty grid");
  // Dynamic shared memory: 48 KiB without the attribute, up to 227 KiB with it, per kernel.
  EXPECT(run<smem_touch_kernel2>(dim3(1), dim3(32), 48 * 1024, out.data()) == cudaSuccess, "48K");
  EXPECT(failed_with(run<smem_touch_kernel2>(dim3(1), dim3(32), 48 * 1024 + 16, out.data()),
                     cudaErrorInvalidValue, "cudaFuncAttributeMaxDynamicSharedMemorySize"),
         "48K + 16 without the attribute");
  EXPECT(cudaFuncSetAttribute(smem_touch_kernel2, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              227 * 1024 + 1) == cudaErrorInvalidValue,
         "more than the device's 227 KiB");
  EXPECT(cudaGetLastError() == cudaErrorInvalidValue, "the failed call is the last error");
  EXPECT(cudaGetLastError() == cudaSuccess, "cudaGetLastError resets");
  EXPECT(cudaFuncSetAttribute(smem_touch_kernel2, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              100 * 1024) == cudaSuccess,
         "opt in");
  EXPECT(run<smem_touch_kernel2>(dim3(1), dim3(32), 100 * 1024, out.data()) == cudaSuccess,
         "100K after the attribute");
  EXPECT(run<smem_touch_kernel2>(dim3(1), dim3(32), 100 * 1024 + 16, out.data()) ==
             cudaErrorInvalidValue,
         "beyond the attribute");
  EXPECT(run<smem_touch_kernel>(dim3(1), dim3(32), 100 * 1024, out.data()) ==
             cudaErrorInvalidValue,
         "the attribute is per kernel");
  // A failed launch is reported by cudaGetErrorString with its full text.
  run<smem_touch_kernel>(dim3(1), dim3(1000, 2), 0, out.data());
  EXPECT(cudaPeekAtLastError() == cudaSuccess, "run() already read the error");
  launch_kernel<smem_touch_kernel>(dim3(1), dim3(1000, 2), 0, nullptr, out.data());
  const cudaError_t e = cudaPeekAtLastError();
  EXPECT(e == cudaErrorInvalidConfiguration && cudaGetLastError() == e &&
             std::strstr(cudaGetErrorString(e), "2000 threads per block") != nullptr,
         "peek keeps, get resets, the string is the report: %s", cudaGetErrorString(e));
  int sms = 0;
  EXPECT(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess &&
             sms == flce::host::device_properties().multi_processor_count,
         "SM count");
}

// A write one element past the dynamic shared memory is found after the block (plain builds:
// canary), on the access (race-checked builds) or by ASan (the arena is exact-size there).
__global__ void smem_overrun_kernel(int* out, int n) {
  FLCE_DYNAMIC_SHARED(smem);
  int* s = reinterpret_cast<int*>(smem);
  s[threadIdx.x] = 1;
  if (threadIdx.x == 0 && n > 32) s[32] = 2;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}

TEST(smem_overrun_reported) {
#if defined(__SANITIZE_ADDRESS__)
  return;  // ASan itself reports it (and ends the process)
#endif
  DeviceBuffer<int> out(32, 0);
  EXPECT(run<smem_overrun_kernel>(dim3(1), dim3(32), 128, out.data(), 32) == cudaSuccess, "clean");
  EXPECT(run<smem_overrun_kernel>(dim3(1), dim3(32), 128, out.data(), 33) ==
             cudaErrorIllegalAddress,
         "overrun: %s", flce::host::last_error_message().c_str());
  EXPECT(flce::host::last_error_message().find("out-of-bounds shared-memory") != std::string::npos,
         "%s", flce::host::last_error_message().c_str());
}

__global__ void cvta_kernel(int* out, const int* global) {
  FLCE_DYNAMIC_SHARED(smem);
  out[threadIdx.x] = static_cast<int>(__cvta_generic_to_shared(global ? global : out));
  (void)smem;
}

TEST(cvta_of_global_pointer_reported) {
  DeviceBuffer<int> out(32, 0);
  EXPECT(failed_with(run<cvta_kernel>(dim3(1), dim3(32), 64, out.data(), out.data()),
                     cudaErrorIllegalAddress, "not a shared-memory address"),
         "cvta");
}

// ---------------------------------------------------------------------------------------------
// The race detector (race-checked build only)
// ---------------------------------------------------------------------------------------------

// mode 0: clean. 1: RAW (thread 1 reads thread 0's write, no barrier). 2: WAR (thread 1 writes
// what thread 0 read). 3: WAW. 4: read of a byte nobody wrote.
__global__ void racy_kernel(float* out, int mode) {
  FLCE_DYNAMIC_SHARED(smem);
  float* s = reinterpret_cast<float*>(smem);
  const unsigned t = threadIdx.x;
  s[t] = static_cast<float>(t);
  __syncthreads();
  float v = 0.f;
  switch (mode) {
    case 1:
      if (t == 0) s[100] = 1.f;
      if (t == 1) v = s[100];
      break;
    case 2:
      if (t == 0) v = s[100];
      if (t == 1) s[100] = 2.f;
      break;
    case 3:
      if (t == 0) s[100] = 1.f;
      if (t == 1) s[100] = 2.f;
      break;
    case 4:
      v = s[blockDim.x + t];
      break;
    default:
      v = s[(t + 1) % blockDim.x];
      break;
  }
  __syncthreads();
  out[t] = v + s[t];
}

void expect_race(int mode, const char* kind) {
  DeviceBuffer<float> out(256, 0.f);
  const cudaError_t e = run<racy_kernel>(dim3(1), dim3(256), 256 * 4 + 256 * 4, out.data(), mode);
  EXPECT(failed_with(e, cudaErrorLaunchFailure, kind), "mode %d", mode);
}

TEST(race_detector_reports) {
  if (!harness::race_checked_build()) return;
  DeviceBuffer<float> out(256, 0.f);
  EXPECT(run<racy_kernel>(dim3(2), dim3(256), 2048, out.data(), 0) == cudaSuccess,
         "clean kernel: %s", flce::host::last_error_message().c_str());
  expect_race(1, "shared-memory race (read after write)");
  expect_race(2, "shared-memory race (write after read)");
  expect_race(3, "shared-memory race (write after write)");
  expect_race(4, "read of uninitialized shared memory");
  // The report names the access and the conflicting one with source locations.
  expect_race(1, "written by thread 0 at");
  EXPECT(flce::host::last_error_message().find("test_runtime.cpp") != std::string::npos,
         "symbolized: %s", flce::host::last_error_message().c_str());
  flce::host::set_racecheck(false);
  EXPECT(run<racy_kernel>(dim3(1), dim3(256), 2048, out.data(), 1) == cudaSuccess,
         "set_racecheck(false) turns the detector off");
  flce::host::set_racecheck(true);
}

// ---------------------------------------------------------------------------------------------
// The fiber implementations agree
// ---------------------------------------------------------------------------------------------

TEST(ucontext_fibers_agree) {
  const int blocks = 3, threads = 128;
  std::vector<float> x(blocks * threads);
  for (float& v : x) v = static_cast<float>(static_cast<int>(check::uniform(-100, 100)));
  DeviceBuffer<float> dx(x), a(blocks, 0.f), b(blocks, 1.f);
  const flce::host::FiberImpl before = flce::host::fiber_impl();
  flce::host::set_fiber_impl(flce::host::FiberImpl::kUcontext);
  EXPECT(run<block_sum_kernel>(dim3(blocks), dim3(threads), threads * 4, dx.data(), a.data()) ==
             cudaSuccess,
         "ucontext");
  flce::host::set_fiber_impl(flce::host::FiberImpl::kAsm);
  EXPECT(run<block_sum_kernel>(dim3(blocks), dim3(threads), threads * 4, dx.data(), b.data()) ==
             cudaSuccess,
         "asm");
  flce::host::set_fiber_impl(before);
  for (int i = 0; i < blocks; ++i) EXPECT(a[i] == b[i], "block %d: %g vs %g", i, a[i], b[i]);
}

}  // namespace

int main(int argc, char** argv) { return check::run_all(argc, argv); }
