// flce host SIMT emulation: the C++ API for code that drives emulated kernels (the host tests and
// the emulated torch binding). The kernels themselves see tools/cuda_host/host/simt.h instead.
//
// Model: each CUDA thread of a block runs as a fiber on the calling OS thread; the blocks of a
// grid run one after another; a launch runs to completion inside the launch call (synchronous).
// Launches of different OS threads are serialized. See tools/cuda_host/README.md.
//
// Errors: a detected error (shared-memory race, read of uninitialized or out-of-bounds shared
// memory, partial or divergent barrier, warp collective with a missing lane, deadlock, non-shared
// address, bad launch configuration) ends the launch. The launch's cudaError_t is then what
// cudaGetLastError() / cudaPeekAtLastError() return (as after a real launch), and
// cudaGetErrorString() of that code, like last_error_message(), is the full report. Nothing here
// aborts the process unless set_abort_on_error(true) asked for it (standalone test binaries).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace flce {
namespace host {

// The emulated device. Defaults: an H100/H200 (132 SMs, 48 KiB of shared memory per block
// without opt-in, 227 KiB with cudaFuncAttributeMaxDynamicSharedMemorySize).
struct DeviceProperties {
  int multi_processor_count = 132;
  std::size_t shared_mem_per_block = 48 * 1024;
  std::size_t shared_mem_per_block_optin = 227 * 1024;
  int max_threads_per_block = 1024;
  int max_block_dim[3] = {1024, 1024, 64};
  int max_grid_dim[3] = {0x7fffffff, 65535, 65535};
  int major = 9;
  int minor = 0;
};
const DeviceProperties& device_properties();
void set_device_properties(const DeviceProperties& props);

// The report of the last failed launch of this OS thread ("" if none failed yet).
std::string last_error_message();

// Print the report and abort() at the first detected error (for standalone test binaries only).
void set_abort_on_error(bool on);

// The shared-memory race detector. It is active for launches of kernels compiled with
// -fsanitize=thread (see README.md: the kernel TUs are instrumented, the runtime is not and
// supplies the __tsan_* callbacks); set_racecheck(false) turns it off for all launches.
void set_racecheck(bool on);
bool racecheck_enabled();

// Fiber stack size for every emulated thread (default 64 KiB; 256 KiB under ASan). Takes effect
// at the next launch.
void set_stack_size(std::size_t bytes);

// Context switch implementation: the hand-written x86-64 switch (default where available) or
// glibc's swapcontext (for comparison: it makes a sigprocmask system call per switch).
enum class FiberImpl { kAsm, kUcontext };
void set_fiber_impl(FiberImpl impl);
FiberImpl fiber_impl();

// Counters since the start of the process.
struct Stats {
  std::uint64_t launches = 0;
  std::uint64_t blocks = 0;
  std::uint64_t threads = 0;
  std::uint64_t switches = 0;  // fiber context switches (including to and from the launcher)
};
Stats stats();

}  // namespace host
}  // namespace flce
