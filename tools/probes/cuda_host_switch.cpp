// The cost of a fiber context switch in the host SIMT emulation (tools/cuda_host), for the
// hand-written x86-64 switch and glibc's swapcontext, measured two ways:
//   raw      ping-pong between the launcher and one fiber (two switches per round trip)
//   kernel   a 256-thread kernel doing nothing but warp shuffles: every shuffle blocks 31 lanes
//            and the runtime switches to the next lane (time per switch, scheduler included)
// Median of 5 repeats each. Built by the cuda-host CMake configuration:
//   build-ctest/tests/cuda_host/flce_host_bench_switch
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "device.cuh"
#include "host/fiber.h"

namespace {

using flce::host::FiberImpl;
using namespace flce::host::detail;

Context g_main, g_fiber;
FiberImpl g_impl;
long g_rounds;

void ping_pong_entry() {
  context_started(g_fiber);
  for (;;) context_switch(g_fiber, g_main, g_impl, false);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double raw_ns_per_switch(FiberImpl impl) {
  g_impl = impl;
  Stack stack = allocate_stack(64 * 1024);
  context_init_main(g_main);
  context_init(g_fiber, stack, &ping_pong_entry, impl);
  g_rounds = 1000000;
  std::vector<double> t;
  for (int rep = 0; rep < 5; ++rep) {
    const auto a = std::chrono::steady_clock::now();
    for (long i = 0; i < g_rounds; ++i) context_switch(g_main, g_fiber, impl, false);
    const auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::nano>(b - a).count() / (2.0 * g_rounds));
  }
  // The fiber stays parked in its loop; its stack is not freed (the process ends soon).
  return median(t);
}

__global__ void shuffle_kernel(float* out, int iters) {
  float v = static_cast<float>(threadIdx.x);
  for (int i = 0; i < iters; ++i) v += __shfl_xor_sync(0xffffffffu, v, 1 + i % 16);
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

double kernel_ns_per_switch(FiberImpl impl) {
  flce::host::set_fiber_impl(impl);
  std::vector<float> out(4 * 256);
  std::vector<double> t;
  for (int rep = 0; rep < 5; ++rep) {
    const auto s0 = flce::host::stats().switches;
    const auto a = std::chrono::steady_clock::now();
    flce::cuda::launch_kernel<shuffle_kernel>(dim3(4), dim3(256), 0, nullptr, out.data(), 200);
    const auto b = std::chrono::steady_clock::now();
    if (cudaGetLastError() != cudaSuccess) {
      std::fprintf(stderr, "%s\n", flce::host::last_error_message().c_str());
      return -1;
    }
    const double switches = static_cast<double>(flce::host::stats().switches - s0);
    t.push_back(std::chrono::duration<double, std::nano>(b - a).count() / switches);
  }
  return median(t);
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, model = "unknown CPU", isa = "";
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0 && model == "unknown CPU") {
      model = line.substr(line.find(':') + 2);
    }
    if (line.rfind("flags", 0) == 0 && isa.empty()) {
      isa = line.find(" avx512f") != std::string::npos ? "AVX-512"
            : line.find(" avx2") != std::string::npos ? "AVX2"
                                                      : "no AVX2";
    }
  }
  return model + ", " + isa;
}

}  // namespace

int main() {
  std::printf("cpu: %s\n", cpu_model().c_str());
  std::printf("%-10s %14s %14s\n", "switch", "raw ns/switch", "kernel ns/switch");
  for (FiberImpl impl : {FiberImpl::kAsm, FiberImpl::kUcontext}) {
    const double raw = raw_ns_per_switch(impl);
    const double kern = kernel_ns_per_switch(impl);
    std::printf("%-10s %14.1f %14.1f\n", impl == FiberImpl::kAsm ? "asm" : "ucontext", raw, kern);
  }
  return 0;
}
