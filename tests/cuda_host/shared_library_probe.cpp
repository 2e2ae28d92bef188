// A kernel TU built into a shared library with the runtime, loaded by Python (ctypes) as the
// emulated torch binding will be: launches run, and a detected race comes back as an error code
// and a report, not as an abort of the process.
#include <cstring>
#include <string>

#include "device.cuh"
#include "params.h"

namespace {

__global__ void probe_kernel(float* out, int racy) {
  FLCE_DYNAMIC_SHARED(smem);
  float* s = reinterpret_cast<float*>(smem);
  s[threadIdx.x] = static_cast<float>(threadIdx.x);
  if (!racy) __syncthreads();
  out[threadIdx.x] = s[threadIdx.x > 0 ? threadIdx.x - 1 : 0];  // the previous thread's
}

std::string g_report;

}  // namespace

// 0: a clean launch and a launcher of params.h; 1: a shared-memory race. Returns the
// cudaError_t of the launch.
extern "C" int flce_host_probe(int racy) {
  float out[64] = {};
  flce::cuda::launch_kernel<probe_kernel>(dim3(2), dim3(64), 64 * sizeof(float), nullptr, out,
                                          racy);
  const cudaError_t e = cudaGetLastError();
  g_report = flce::host::last_error_message();
  if (e != cudaSuccess || racy) return static_cast<int>(e);
  float sum[4] = {1, 2, 3, 4}, comp[4] = {}, x[4] = {1e-8f, 1e-8f, 1e-8f, 1e-8f};
  return static_cast<int>(flce::cuda::launch_kahan_accumulate(sum, comp, x, 4, nullptr, nullptr));
}

extern "C" const char* flce_host_probe_report() { return g_report.c_str(); }
