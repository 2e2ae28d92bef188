// The host SIMT runtime: launches, the fiber scheduler, barriers, warp shuffles and votes, error
// reports, and the host versions of the CUDA runtime calls the kernels' launchers make.
//
// Scheduling: the threads of a block are fibers on the launching OS thread, run from a FIFO ready
// queue. A fiber runs until it waits (barrier, warp collective) or exits, then switches straight
// to the next ready fiber. The last thread to reach a barrier, or the last lane to reach a warp
// collective, completes it and continues without a switch. When the queue is empty with threads
// still waiting, nothing can ever run again: a deadlock, reported with what each warp waits on.
#include <dlfcn.h>
#include <elf.h>
#include <link.h>

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "internal.h"

#pragma GCC visibility push(hidden)

namespace flce {
namespace host {
namespace detail {

ExecView g_view{};
Fiber* g_cur = nullptr;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr std::size_t kDefaultStack = 256 * 1024;
#else
constexpr std::size_t kDefaultStack = 64 * 1024;
#endif
// Bytes past the end of the dynamic shared memory that are checked after every block (plain
// builds) or on every access (race-checked builds); ASan builds allocate the arena exact-size.
constexpr std::size_t kGuard = 256;
constexpr unsigned char kPoison = 0xFF;  // NaN in fp32, bf16 and fp16
constexpr unsigned char kCanary = 0xA5;

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char buf[1024];
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

struct Settings {
  DeviceProperties props;
  bool abort_on_error = false;
  bool racecheck = true;
  std::size_t stack_size = kDefaultStack;
#if defined(__x86_64__)
  FiberImpl impl = FiberImpl::kAsm;
#else
  FiberImpl impl = FiberImpl::kUcontext;
#endif
  std::unordered_map<const void*, int> max_dynamic_smem;  // cudaFuncSetAttribute
  Stats stats;
};

Settings& settings() {
  static Settings s = [] {
    Settings init;
    if (const char* env = std::getenv("FLCE_HOST_FIBERS")) {
      if (std::strcmp(env, "ucontext") == 0) init.impl = FiberImpl::kUcontext;
    }
    return init;
  }();
  return s;
}

std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

// The state of the launch in progress (one at a time: launch_mutex).
struct Engine {
  const LaunchSpec* spec = nullptr;
  void (*thunk)(void*) = nullptr;
  void* params = nullptr;
  FiberImpl impl = FiberImpl::kAsm;
  std::vector<Fiber> fibers;
  std::vector<Stack> stacks;
  std::size_t stack_size = 0;
  std::vector<Warp> warps;
  int nthreads = 0;
  int live = 0;
  int exited = 0;
  int arrived = 0;  // threads waiting at __syncthreads
  Context main;
  Fiber* head = nullptr;
  Fiber* tail = nullptr;
  bool aborted = false;
  cudaError_t error = cudaSuccess;
  std::string message;
  char* arena = nullptr;
  std::size_t arena_size = 0;
};
Engine g;

thread_local cudaError_t t_last_error = cudaSuccess;
thread_local cudaError_t t_failed_code = cudaSuccess;
thread_local std::string t_failed_message;

void set_error(cudaError_t code, const std::string& message) {
  t_last_error = code;
  t_failed_code = code;
  t_failed_message = message;
  if (settings().abort_on_error) {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::abort();
  }
}

const char* standard_error_string(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorMisalignedAddress:
      return "misaligned address";
    case cudaErrorInvalidDeviceFunction:
      return "invalid device function";
    default:
      return "unknown error";
  }
}

const char* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorMisalignedAddress:
      return "cudaErrorMisalignedAddress";
    case cudaErrorInvalidDeviceFunction:
      return "cudaErrorInvalidDeviceFunction";
    default:
      return "cudaErrorUnknown";
  }
}

// "flce::cuda::(anon)::partial_stats_kernel<...>" from kernel_signature's __PRETTY_FUNCTION__.
std::string kernel_name(const char* signature) {
  std::string s = signature;
  const std::size_t a = s.find("kKernel = ");
  if (a == std::string::npos) return s;
  std::size_t b = s.rfind(']');
  if (b == std::string::npos || b < a) b = s.size();
  return s.substr(a + 10, b - a - 10);
}

// "0-7, 12, 30-31"
std::string lane_list(unsigned bits) {
  std::string out;
  for (int i = 0; i < 32;) {
    if (!(bits >> i & 1u)) {
      ++i;
      continue;
    }
    int j = i;
    while (j + 1 < 32 && (bits >> (j + 1) & 1u)) ++j;
    if (!out.empty()) out += ", ";
    out += i == j ? format("%d", i) : format("%d-%d", i, j);
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

std::string thread_list(const std::vector<int>& tids) {
  std::string out;
  for (std::size_t i = 0; i < tids.size();) {
    std::size_t j = i;
    while (j + 1 < tids.size() && tids[j + 1] == tids[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += i == j ? format("%d", tids[i]) : format("%d-%d", tids[i], tids[j]);
    i = j + 1;
    if (out.size() > 200) {
      out += ", ...";
      break;
    }
  }
  return out;
}

std::string where(const char* file, unsigned line) {
  if (file == nullptr) return "?";
  const char* slash = std::strrchr(file, '/');
  return format("%s:%u", slash ? slash + 1 : file, line);
}

std::string launch_context(const Fiber* f) {
  std::string s = "  kernel " + kernel_name(g.spec->signature);
  s += format("\n  block (%u, %u, %u) of grid (%u, %u, %u), block size (%u, %u, %u)",
              g_view.block_idx.x, g_view.block_idx.y, g_view.block_idx.z, g.spec->grid.x,
              g.spec->grid.y, g.spec->grid.z, g.spec->block.x, g.spec->block.y, g.spec->block.z);
  if (f != nullptr) {
    s += format("\n  thread (%u, %u, %u) = thread %d, warp %d, lane %d", f->view.idx.x,
                f->view.idx.y, f->view.idx.z, f->tid, f->warp, f->lane);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Scheduling
// ---------------------------------------------------------------------------------------------

void push_ready(Fiber* f) {
  f->state = State::kReady;
  f->next = nullptr;
  if (g.tail) {
    g.tail->next = f;
  } else {
    g.head = f;
  }
  g.tail = f;
}

Fiber* pop_ready() {
  Fiber* f = g.head;
  if (f) {
    g.head = f->next;
    if (!g.head) g.tail = nullptr;
    f->next = nullptr;
  }
  return f;
}

// Switch from `from` (nullptr: the launcher) to `to` (nullptr: the launcher).
void transfer(Fiber* from, Fiber* to, bool from_exits) {
  g_cur = to;
  if (to) {
    to->state = State::kRunning;
    g_view.thread = &to->view;
  }
  ++settings().stats.switches;
  context_switch(from ? from->ctx : g.main, to ? to->ctx : g.main, g.impl, from_exits);
}

// The running fiber stops (it waits, or it has exited): run the next ready one, or return to the
// launcher when there is none.
void run_next(Fiber* self, bool exiting) { transfer(self, pop_ready(), exiting); }

// Thrown by fail() inside a fiber and caught by fiber_entry at the bottom of the same stack, so
// that the frames of the failing thread are unwound (their strings freed) before it is abandoned.
struct LaunchAborted {};

void exit_checks(Fiber* self);

void fiber_entry() {
  Fiber* self = g_cur;
  context_started(self->ctx);
  bool aborted = false;
  try {
    g.thunk(g.params);
    exit_checks(self);
  } catch (const LaunchAborted&) {
    aborted = true;
  }
  if (aborted) {
    transfer(self, nullptr, true);  // back to the launcher, which reports; never resumed
  } else {
    run_next(self, true);
  }
  __builtin_unreachable();
}

// The thread has returned from the kernel: anything that waits for it now waits forever.
void exit_checks(Fiber* self) {
  self->state = State::kDone;
  --g.live;
  ++g.exited;
  Warp& w = g.warps[self->warp];
  w.exited |= 1u << self->lane;
  for (int i = 0; i < w.npending; ++i) {
    const Pending& p = w.pending[i];
    if (p.mask >> self->lane & 1u) {
      fail(cudaErrorLaunchFailure, "warp collective with an exited lane",
           format("lane %d exited while lanes %s of warp %d wait in %s with mask 0x%08x, which "
                  "names it",
                  self->lane, lane_list(p.arrived).c_str(), self->warp, op_name(p.op), p.mask),
           nullptr);
    }
  }
  if (g.arrived > 0 && g.arrived == g.live) {
    std::vector<int> gone;
    for (const Fiber& f : g.fibers) {
      if (f.state == State::kDone) gone.push_back(f.tid);
    }
    const Fiber* any = nullptr;
    for (const Fiber& f : g.fibers) {
      if (f.state == State::kBarrier) any = &f;
    }
    fail(cudaErrorLaunchFailure, "barrier reached by only part of the block",
         format("%d of %d threads wait at __syncthreads (%s); threads %s exited without reaching "
                "it",
                g.arrived, g.nthreads, where(any->file, any->line).c_str(),
                thread_list(gone).c_str()),
         nullptr, any);
  }
}

void release_barrier(Fiber* last) {
  if (g.exited > 0) {
    std::vector<int> gone;
    for (const Fiber& f : g.fibers) {
      if (f.state == State::kDone) gone.push_back(f.tid);
    }
    fail(cudaErrorLaunchFailure, "barrier reached by only part of the block",
         format("%d of %d threads wait at __syncthreads (%s); threads %s exited without reaching "
                "it",
                g.arrived, g.nthreads, where(last->file, last->line).c_str(),
                thread_list(gone).c_str()),
         nullptr);
  }
  for (const Fiber& f : g.fibers) {
    if (f.state == State::kBarrier &&
        (f.line != last->line || std::strcmp(f.file, last->file) != 0)) {
      fail(cudaErrorLaunchFailure, "divergent __syncthreads",
           format("threads of one block wait at different barriers: thread %d at %s, thread %d "
                  "at %s",
                  f.tid, where(f.file, f.line).c_str(), last->tid,
                  where(last->file, last->line).c_str()),
           nullptr);
    }
  }
  for (Fiber& f : g.fibers) {
    if (f.state == State::kBarrier && &f != last) push_ready(&f);
  }
  last->state = State::kRunning;
  g.arrived = 0;
  if (rc::g_active) rc::barrier();
}

std::string deadlock_report() {
  std::string s;
  for (std::size_t w = 0; w < g.warps.size(); ++w) {
    // Group the lanes of the warp by what they wait on.
    struct Group {
      std::string what;
      unsigned lanes;
    };
    std::vector<Group> groups;
    for (int lane = 0; lane < 32; ++lane) {
      const std::size_t tid = w * 32 + lane;
      if (tid >= g.fibers.size()) break;
      const Fiber& f = g.fibers[tid];
      std::string what;
      switch (f.state) {
        case State::kBarrier:
          what = "at __syncthreads (" + where(f.file, f.line) + ")";
          break;
        case State::kWarp:
          what = format("in %s with mask 0x%08x", op_name(f.op), f.mask) +
                 (f.file ? " (" + where(f.file, f.line) + ")" : std::string(""));
          break;
        case State::kDone:
          what = "exited";
          break;
        default:
          what = "runnable";
          break;
      }
      auto it = std::find_if(groups.begin(), groups.end(),
                             [&](const Group& gr) { return gr.what == what; });
      if (it == groups.end()) {
        groups.push_back({what, 1u << lane});
      } else {
        it->lanes |= 1u << lane;
      }
    }
    s += format("\n  warp %zu:", w);
    for (const Group& gr : groups) {
      s += " lanes " + lane_list(gr.lanes) + " " + gr.what + ";";
    }
  }
  return s;
}

void poison_arena() {
  std::memset(g.arena, kPoison, g.arena_size);
#if !defined(__SANITIZE_ADDRESS__)
  std::memset(g.arena + g.arena_size, kCanary, kGuard);
#endif
}

// Runs the block g_view.block_idx; false when the launch failed.
bool run_block() {
  ++settings().stats.blocks;
  settings().stats.threads += static_cast<std::uint64_t>(g.nthreads);
  g.live = g.nthreads;
  g.exited = 0;
  g.arrived = 0;
  g.head = g.tail = nullptr;
  for (std::size_t w = 0; w < g.warps.size(); ++w) {
    const int n = std::min(32, g.nthreads - static_cast<int>(w) * 32);
    g.warps[w] = Warp{};
    g.warps[w].exists = n == 32 ? 0xffffffffu : (1u << n) - 1u;
  }
  poison_arena();
  if (rc::g_active) rc::block_begin();
  for (int i = 0; i < g.nthreads; ++i) {
    Fiber& f = g.fibers[i];
    f.file = nullptr;
    f.line = 0;
    context_init(f.ctx, g.stacks[i], &fiber_entry, g.impl);
    push_ready(&f);
  }
  transfer(nullptr, pop_ready(), false);
  if (g.aborted) {
    for (const Stack& s : g.stacks) stack_reset_after_abort(s);
    return false;
  }
  if (g.live > 0) {
    g.error = cudaErrorLaunchFailure;
    g.message = "flce host emulation: deadlock\n  no thread of the block can continue:" +
                deadlock_report() + "\n" + launch_context(nullptr);
    return false;
  }
#if !defined(__SANITIZE_ADDRESS__)
  for (std::size_t i = 0; i < kGuard; ++i) {
    if (static_cast<unsigned char>(g.arena[g.arena_size + i]) != kCanary) {
      g.error = cudaErrorIllegalAddress;
      g.message = format(
                      "flce host emulation: out-of-bounds shared-memory write\n  byte %zu past the "
                      "end of the %zu bytes of dynamic shared memory was written\n",
                      i, g.arena_size) +
                  launch_context(nullptr);
      return false;
    }
  }
#endif
  return true;
}

cudaError_t check_config(const LaunchSpec& spec, std::string& why) {
  const DeviceProperties& p = settings().props;
  const unsigned b[3] = {spec.block.x, spec.block.y, spec.block.z};
  const unsigned gr[3] = {spec.grid.x, spec.grid.y, spec.grid.z};
  const std::uint64_t threads = std::uint64_t{b[0]} * b[1] * b[2];
  for (int i = 0; i < 3; ++i) {
    if (b[i] == 0 || b[i] > static_cast<unsigned>(p.max_block_dim[i])) {
      why = format("block dimension %d is %u (allowed 1..%d)", i, b[i], p.max_block_dim[i]);
      return cudaErrorInvalidConfiguration;
    }
    if (gr[i] == 0 || gr[i] > static_cast<unsigned>(p.max_grid_dim[i])) {
      why = format("grid dimension %d is %u (allowed 1..%d)", i, gr[i], p.max_grid_dim[i]);
      return cudaErrorInvalidConfiguration;
    }
  }
  if (threads > static_cast<std::uint64_t>(p.max_threads_per_block)) {
    why = format("%" PRIu64 " threads per block (at most %d)", threads, p.max_threads_per_block);
    return cudaErrorInvalidConfiguration;
  }
  std::size_t limit = p.shared_mem_per_block;
  const auto it = settings().max_dynamic_smem.find(spec.kernel);
  if (it != settings().max_dynamic_smem.end()) limit = static_cast<std::size_t>(it->second);
  if (spec.dynamic_smem > limit) {
    why = format("%zu bytes of dynamic shared memory requested, %zu allowed for this kernel%s",
                 spec.dynamic_smem, limit,
                 it == settings().max_dynamic_smem.end()
                     ? " (more needs cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemory"
                       "Size))"
                     : "");
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

void prepare_launch(const LaunchSpec& spec) {
  Settings& st = settings();
  g.impl = st.impl;
  g.nthreads = static_cast<int>(spec.block.x * spec.block.y * spec.block.z);
  if (g.stack_size != st.stack_size) {
    for (Stack& s : g.stacks) free_stack(s);
    g.stacks.clear();
    g.stack_size = st.stack_size;
  }
  while (g.stacks.size() < static_cast<std::size_t>(g.nthreads)) {
    g.stacks.push_back(allocate_stack(g.stack_size));
  }
  if (g.fibers.size() != static_cast<std::size_t>(g.nthreads)) {
    g.fibers = std::vector<Fiber>(static_cast<std::size_t>(g.nthreads));
  }
  for (int i = 0; i < g.nthreads; ++i) {
    Fiber& f = g.fibers[i];
    f.tid = i;
    f.warp = i / 32;
    f.lane = i % 32;
    f.view.idx = uint3{static_cast<unsigned>(i) % spec.block.x,
                       static_cast<unsigned>(i) / spec.block.x % spec.block.y,
                       static_cast<unsigned>(i) / (spec.block.x * spec.block.y)};
  }
  g.warps.assign(static_cast<std::size_t>((g.nthreads + 31) / 32), Warp{});
  // The arena: exact size under ASan (its redzone catches overruns), else followed by a canary.
  std::free(g.arena);
  g.arena_size = spec.dynamic_smem;
#if defined(__SANITIZE_ADDRESS__)
  const std::size_t bytes = std::max<std::size_t>(g.arena_size, 1);
#else
  const std::size_t bytes = g.arena_size + kGuard;
#endif
  void* arena = nullptr;
  if (posix_memalign(&arena, 128, bytes) != 0) throw std::bad_alloc();
  g.arena = static_cast<char*>(arena);
  g_view.dynamic_smem = g.arena;
  g_view.block_dim = spec.block;
  g_view.grid_dim = spec.grid;
  context_init_main(g.main);
  g.aborted = false;
  g.error = cudaSuccess;
  g.message.clear();
  rc::g_active = spec.instrumented && st.racecheck;
  if (rc::g_active) rc::launch_begin(g.arena, g.arena_size, kGuard);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Shared with racecheck.cpp
// ---------------------------------------------------------------------------------------------

namespace {
void record_failure(cudaError_t code, const char* kind, const char* detail, const void* pc,
                    const Fiber* blame) {
  g.aborted = true;
  g.error = code;
  g.message = std::string("flce host emulation: ") + kind + "\n  " + detail + "\n" +
              launch_context(blame);
  if (pc != nullptr) g.message += "\n  at " + describe_pc(pc);
}
}  // namespace

void fail(cudaError_t code, const std::string& kind, const std::string& detail, const void* pc,
          const Fiber* blame) {
  Fiber* self = g_cur;
  if (self == nullptr) {
    // Device code called outside a launch: a programming error of the caller, not of a kernel.
    throw std::logic_error("flce host emulation: " + kind + ": " + detail +
                           " (outside a kernel launch)");
  }
  record_failure(code, kind.c_str(), detail.c_str(), pc, blame ? blame : self);
  // The failing thread unwinds to fiber_entry and returns to the launcher; the other fibers of
  // the block are abandoned where they wait (no runtime frame of theirs owns memory).
  throw LaunchAborted{};
}

void fail_abandon(cudaError_t code, const char* kind, const char* detail, const void* pc,
                  const Fiber* blame) {
  Fiber* self = g_cur;
  record_failure(code, kind, detail, pc, blame ? blame : self);
  transfer(self, nullptr, true);
  __builtin_unreachable();
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kShflIdx:
      return "__shfl_sync";
    case Op::kShflUp:
      return "__shfl_up_sync";
    case Op::kShflDown:
      return "__shfl_down_sync";
    case Op::kShflXor:
      return "__shfl_xor_sync";
    case Op::kVoteAny:
      return "__any_sync";
    case Op::kVoteAll:
      return "__all_sync";
    case Op::kVoteBallot:
      return "__ballot_sync";
  }
  return "?";
}

void collective(Op op, unsigned mask, const Deposit& dep, Compute compute, const char* file,
                unsigned line, const void* pc) {
  Fiber* self = g_cur;
  if (self == nullptr) throw std::logic_error("flce host emulation: warp collective outside a kernel");
  Warp& w = g.warps[self->warp];
  const unsigned bit = 1u << self->lane;
  if (!(mask & bit)) {
    fail(cudaErrorLaunchFailure, "warp collective with a bad mask",
         format("%s with mask 0x%08x, which does not name the calling lane %d", op_name(op), mask,
                self->lane),
         pc);
  }
  if (mask & ~w.exists) {
    fail(cudaErrorLaunchFailure, "warp collective with a bad mask",
         format("%s with mask 0x%08x names lanes %s, which are not threads of this block",
                op_name(op), mask, lane_list(mask & ~w.exists).c_str()),
         pc);
  }
  if (mask & w.exited) {
    fail(cudaErrorLaunchFailure, "warp collective with an exited lane",
         format("%s with mask 0x%08x names lanes %s, which have exited", op_name(op), mask,
                lane_list(mask & w.exited).c_str()),
         pc);
  }
  Pending* p = nullptr;
  for (int i = 0; i < w.npending; ++i) {
    if (w.pending[i].mask == mask) {
      p = &w.pending[i];
    } else if (w.pending[i].mask & mask) {
      fail(cudaErrorLaunchFailure, "warp collective with inconsistent masks",
           format("lane %d calls %s with mask 0x%08x while lanes %s wait in %s with mask 0x%08x",
                  self->lane, op_name(op), mask, lane_list(w.pending[i].arrived).c_str(),
                  op_name(w.pending[i].op), w.pending[i].mask),
           pc);
    }
  }
  if (p == nullptr) {
    if (w.npending == kMaxPending) {
      fail(cudaErrorLaunchFailure, "warp collective with inconsistent masks",
           "too many concurrent warp collectives with disjoint masks", pc);
    }
    p = &w.pending[w.npending++];
    *p = Pending{mask, 0u, op};
  }
  if (p->op != op) {
    fail(cudaErrorLaunchFailure, "divergent warp collectives",
         format("lane %d calls %s while lanes %s of its warp wait in %s (same mask 0x%08x)",
                self->lane, op_name(op), lane_list(p->arrived).c_str(), op_name(p->op), mask),
         pc);
  }
  self->dep = dep;
  self->op = op;
  self->mask = mask;
  self->file = file;
  self->line = line;
  self->pc = pc;
  p->arrived |= bit;
  if (p->arrived != mask) {
    self->state = State::kWarp;
    run_next(self, false);
    return;  // completed by the last lane: the result is in place
  }
  Fiber* lanes[32] = {};
  for (int l = 0; l < 32; ++l) {
    if (mask >> l & 1u) lanes[l] = &g.fibers[static_cast<std::size_t>(self->warp) * 32 + l];
  }
  *p = w.pending[--w.npending];  // remove (order of the pending list is irrelevant)
  compute(lanes, mask, op);
  for (int l = 0; l < 32; ++l) {
    if (lanes[l] != nullptr && lanes[l] != self) push_ready(lanes[l]);
  }
}

// "function at file:line" by addr2line on the object holding pc, or "object+0xoffset".
std::string describe_pc(const void* pc) {
  Dl_info info{};
  // A return address points after the call; the call itself is one byte earlier.
  const auto addr = reinterpret_cast<std::uintptr_t>(pc) - 1;
  if (dladdr(reinterpret_cast<void*>(addr), &info) == 0 || info.dli_fname == nullptr) {
    return format("pc 0x%" PRIxPTR, addr);
  }
  auto base = reinterpret_cast<std::uintptr_t>(info.dli_fbase);
  const auto* ehdr = reinterpret_cast<const ElfW(Ehdr)*>(info.dli_fbase);
  const std::uintptr_t off = ehdr->e_type == ET_DYN ? addr - base : addr;
  std::string obj = info.dli_fname;
  if (obj.empty()) obj = "/proc/self/exe";
  const char* sym = std::getenv("FLCE_HOST_SYMBOLIZE");
  if (sym == nullptr || std::strcmp(sym, "0") != 0) {
    const std::string cmd =
        format("addr2line -C -f -i -e '%s' 0x%" PRIxPTR " 2>/dev/null", obj.c_str(), off);
    if (FILE* pipe = popen(cmd.c_str(), "r")) {
      std::string out;
      char line[512];
      int n = 0;
      while (std::fgets(line, sizeof(line), pipe) != nullptr) {
        std::string l = line;
        while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
        out += (n % 2 == 0 ? (n == 0 ? "" : "\n     inlined into ") : " at ") + l;
        ++n;
      }
      pclose(pipe);
      if (n >= 2 && out.find("??") == std::string::npos) return out;
    }
  }
  return format("%s+0x%" PRIxPTR, obj.c_str(), off);
}

// ---------------------------------------------------------------------------------------------
// Device-side entry points (simt.h)
// ---------------------------------------------------------------------------------------------

void syncthreads(const char* file, unsigned line) {
  Fiber* self = g_cur;
  if (self == nullptr) throw std::logic_error("flce host emulation: __syncthreads outside a kernel");
  self->state = State::kBarrier;
  self->file = file;
  self->line = line;
  self->pc = nullptr;
  ++g.arrived;
  if (g.arrived == g.live) {
    release_barrier(self);
  } else {
    run_next(self, false);
  }
}

namespace {

void shfl_compute(Fiber* const* lanes, unsigned mask, Op op) {
  // Sources first, results after: a lane's result overwrites its own value.
  std::uint64_t result[32];
  for (int l = 0; l < 32; ++l) {
    const Fiber* f = lanes[l];
    if (f == nullptr) continue;
    const int width = f->dep.width;
    const int arg = f->dep.arg;
    const int seg = l & ~(width - 1);  // first lane of this lane's width-segment
    int src = l;
    switch (op) {
      case Op::kShflIdx:
        src = seg + (arg & (width - 1));
        break;
      case Op::kShflUp:
        src = (l - seg) >= arg ? l - arg : l;
        break;
      case Op::kShflDown:
        src = (l - seg) + arg < width ? l + arg : l;
        break;
      case Op::kShflXor:
        src = l ^ arg;
        if (src >= seg + width) src = l;  // later segments are out of reach: own value
        break;
      default:
        break;
    }
    if (src < 0 || src > 31 || !(mask >> src & 1u)) {
      fail(cudaErrorLaunchFailure, "shuffle from a lane outside the mask",
           format("lane %d reads lane %d in %s with mask 0x%08x (the value would be undefined)", l,
                  src, op_name(op), mask),
           f->pc, f);
    }
    std::memcpy(&result[l], lanes[src]->dep.u, sizeof(std::uint64_t));
  }
  for (int l = 0; l < 32; ++l) {
    if (lanes[l] != nullptr) std::memcpy(lanes[l]->dep.out, &result[l], sizeof(result[l]));
  }
}

void vote_compute(Fiber* const* lanes, unsigned mask, Op op) {
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l) {
    if (lanes[l] != nullptr && lanes[l]->dep.arg != 0) ballot |= 1u << l;
  }
  unsigned r = ballot;
  if (op == Op::kVoteAny) r = ballot != 0 ? 1u : 0u;
  if (op == Op::kVoteAll) r = ballot == mask ? 1u : 0u;
  for (int l = 0; l < 32; ++l) {
    if (lanes[l] != nullptr) *static_cast<unsigned*>(lanes[l]->dep.out) = r;
  }
}

bool valid_width(int w) { return w >= 1 && w <= 32 && (w & (w - 1)) == 0; }

}  // namespace

void shfl(Op op, unsigned mask, void* value, int bytes, int arg, int width, const char* file,
          unsigned line) {
  const void* pc = __builtin_return_address(0);
  if (!valid_width(width)) {
    fail(cudaErrorLaunchFailure, "shuffle with an invalid width",
         format("%s with width %d (must be a power of two in [1, 32])", op_name(op), width), pc);
  }
  Deposit d{};
  std::memcpy(d.u, value, static_cast<std::size_t>(bytes));
  d.arg = arg;
  d.width = width;
  std::uint64_t out = 0;
  d.out = &out;
  collective(op, mask, d, &shfl_compute, file, line, pc);
  std::memcpy(value, &out, static_cast<std::size_t>(bytes));
}

unsigned vote(Op op, unsigned mask, int pred, const char* file, unsigned line) {
  Deposit d{};
  d.arg = pred != 0 ? 1 : 0;
  unsigned out = 0;
  d.out = &out;
  collective(op, mask, d, &vote_compute, file, line, __builtin_return_address(0));
  return out;
}

std::size_t cvta_generic_to_shared(const void* p, const void* pc) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const auto lo = reinterpret_cast<std::uintptr_t>(g.arena);
  if (g_cur == nullptr || a < lo || a > lo + g.arena_size) {
    if (g_cur == nullptr) {
      throw std::logic_error("flce host emulation: __cvta_generic_to_shared outside a kernel");
    }
    fail(cudaErrorIllegalAddress, "not a shared-memory address",
         format("__cvta_generic_to_shared(%p): not in the %zu bytes of dynamic shared memory at "
                "%p (static __shared__ variables have no shared-window address here)",
                p, g.arena_size, static_cast<void*>(g.arena)),
         pc);
  }
  return a - lo;
}

void run_launch(const LaunchSpec& spec, void (*thunk)(void*), void* params) {
  std::lock_guard<std::mutex> lock(launch_mutex());
  ++settings().stats.launches;
  std::string why;
  const cudaError_t config = check_config(spec, why);
  if (config != cudaSuccess) {
    set_error(config, "flce host emulation: invalid launch (" +
                          std::string(standard_error_string(config)) + ")\n  " + why +
                          "\n  kernel " + kernel_name(spec.signature));
    return;
  }
  g.spec = &spec;
  g.thunk = thunk;
  g.params = params;
  prepare_launch(spec);
  bool ok = true;
  for (unsigned z = 0; ok && z < spec.grid.z; ++z) {
    for (unsigned y = 0; ok && y < spec.grid.y; ++y) {
      for (unsigned x = 0; ok && x < spec.grid.x; ++x) {
        g_view.block_idx = uint3{x, y, z};
        ok = run_block();
      }
    }
  }
  rc::g_active = false;
  g_view.thread = nullptr;
  g.spec = nullptr;
  if (!ok) set_error(g.error, g.message);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// runtime.h
// ---------------------------------------------------------------------------------------------

const DeviceProperties& device_properties() { return detail::settings().props; }
void set_device_properties(const DeviceProperties& props) { detail::settings().props = props; }


std::string last_error_message() { return detail::t_failed_message; }
void set_abort_on_error(bool on) { detail::settings().abort_on_error = on; }
void set_racecheck(bool on) { detail::settings().racecheck = on; }
bool racecheck_enabled() { return detail::settings().racecheck; }
void set_stack_size(std::size_t bytes) { detail::settings().stack_size = bytes; }

void set_fiber_impl(FiberImpl impl) {
#if defined(__x86_64__)
  detail::settings().impl = impl;
#else
  (void)impl;
#endif
}
FiberImpl fiber_impl() { return detail::settings().impl; }
Stats stats() { return detail::settings().stats; }

}  // namespace host
}  // namespace flce

// ---------------------------------------------------------------------------------------------
// The CUDA runtime calls of the launchers (cudart is not linked).
// ---------------------------------------------------------------------------------------------

using flce::host::detail::t_failed_code;
using flce::host::detail::t_failed_message;
using flce::host::detail::t_last_error;

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return t_last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  // The launch that failed last on this thread has a full report.
  if (error != cudaSuccess && error == t_failed_code && !t_failed_message.empty()) {
    return t_failed_message.c_str();
  }
  return flce::host::detail::standard_error_string(error);
}

const char* cudaGetErrorName(cudaError_t error) { return flce::host::detail::error_name(error); }

cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }

cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  auto& st = flce::host::detail::settings();
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<std::size_t>(value) > st.props.shared_mem_per_block_optin) {
      t_last_error = cudaErrorInvalidValue;
      return cudaErrorInvalidValue;
    }
    std::lock_guard<std::mutex> lock(flce::host::detail::launch_mutex());
    st.max_dynamic_smem[func] = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
  t_last_error = cudaErrorInvalidValue;
  return cudaErrorInvalidValue;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  const flce::host::DeviceProperties& p = flce::host::device_properties();
  if (value == nullptr || device != 0) {
    t_last_error = cudaErrorInvalidValue;
    return cudaErrorInvalidValue;
  }
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = p.multi_processor_count;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = static_cast<int>(p.shared_mem_per_block);
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(p.shared_mem_per_block_optin);
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = p.max_threads_per_block;
      return cudaSuccess;
    case cudaDevAttrWarpSize:
      *value = 32;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = p.major;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = p.minor;
      return cudaSuccess;
    default:
      t_last_error = cudaErrorInvalidValue;
      return cudaErrorInvalidValue;
  }
}

}  // extern "C"

#pragma GCC visibility pop
