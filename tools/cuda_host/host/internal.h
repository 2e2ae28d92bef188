// Internals shared by the runtime's translation units (runtime.cpp, racecheck.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "fiber.h"
#include "runtime.h"
#include "simt.h"

#pragma GCC visibility push(hidden)

namespace flce {
namespace host {
namespace detail {

enum class State : std::uint8_t { kReady, kRunning, kBarrier, kWarp, kDone };

// What a lane hands to a warp collective; the lane that completes the collective computes every
// lane's result and writes it through `out` (the waiting lanes' stacks are live).
struct Deposit {
  std::uint32_t u[2];  // the value (a shuffle moves at most 8 bytes)
  int arg;
  int width;
  void* out;
};

struct Fiber {
  ThreadView view;
  int tid = 0;
  int warp = 0;
  int lane = 0;
  State state = State::kDone;
  Fiber* next = nullptr;  // ready queue
  Context ctx;
  // Where it waits (barrier or collective) and with what.
  const char* file = nullptr;
  unsigned line = 0;
  const void* pc = nullptr;
  Op op = Op::kShflIdx;
  unsigned mask = 0;
  Deposit dep{};
};

inline constexpr int kMaxPending = 8;
struct Pending {
  unsigned mask;
  unsigned arrived;
  Op op;
};
struct Warp {
  unsigned exists = 0;  // lanes that are threads of the block
  unsigned exited = 0;
  int npending = 0;
  Pending pending[kMaxPending];
};

// The running fiber (nullptr while the launcher runs).
extern Fiber* g_cur;

// End the launch with an error (inside a fiber: never returns; the launch call reports it).
// `blame`: the thread the report names (default: the running one).
[[noreturn]] void fail(cudaError_t code, const std::string& kind, const std::string& detail,
                       const void* pc, const Fiber* blame = nullptr);
// The same without unwinding, for callers that cannot throw (the __tsan_* callbacks: g++ treats
// them as nothrow): the running fiber is abandoned where it is. It must hold no objects that
// need destruction (pass plain strings).
[[noreturn]] void fail_abandon(cudaError_t code, const char* kind, const char* detail,
                               const void* pc, const Fiber* blame);

// A warp collective of the running lane: deposit `dep`, wait for the lanes of `mask`; the lane
// completing it calls compute(lanes of the warp, mask).
using Compute = void (*)(Fiber* const* lanes, unsigned mask, Op op);
void collective(Op op, unsigned mask, const Deposit& dep, Compute compute, const char* file,
                unsigned line, const void* pc);

const char* op_name(Op op);
std::string describe_pc(const void* pc);

// The race detector (racecheck.cpp), active for instrumented launches.
namespace rc {
extern bool g_active;
void launch_begin(char* arena, std::size_t arena_size, std::size_t guard);
void block_begin();
void barrier();
}  // namespace rc

}  // namespace detail
}  // namespace host
}  // namespace flce

#pragma GCC visibility pop
