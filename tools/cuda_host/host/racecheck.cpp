// The shared-memory race detector.
//
// The kernel translation units are compiled with -fsanitize=thread but linked without libtsan:
// the compiler's __tsan_read*/__tsan_write* calls before every memory access land here. Accesses
// outside the launch's dynamic shared memory (global memory, stacks, parameters) are ignored.
//
// Per byte of shared memory the shadow holds the last writer and the readers since the last
// barrier, stamped with the barrier interval ("epoch", counted across blocks, so that a new block
// starts with every byte unwritten). Within one epoch:
//   read  after a write by another thread            RAW
//   write after a read by another thread             WAR
//   write after a write by another thread            WAW
// and at any time: a read of a byte never written in this block, an access past the end of the
// dynamic shared memory.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "internal.h"

#pragma GCC visibility push(hidden)

namespace flce {
namespace host {
namespace detail {
namespace rc {

bool g_active = false;

namespace {

constexpr std::uint16_t kMany = 0xfffe;

struct Shadow {
  std::uint32_t w_epoch;
  std::uint32_t r_epoch;
  std::uint16_t w_tid;  // writer in w_epoch
  std::uint16_t r_tid;  // reader in r_epoch, or kMany
  const void* w_pc;
  const void* r_pc;
};

struct State {
  std::vector<Shadow> shadow;
  std::uintptr_t lo = 0;
  std::size_t size = 0;
  std::size_t guard = 0;
  std::uint32_t epoch = 0;
  std::uint32_t block_epoch = 0;  // first epoch of the running block
} s;

// Report texts are built in fixed buffers: the fiber that reports is abandoned, not unwound.
void who(char* out, std::size_t n, std::uint16_t tid, const void* pc) {
  std::string where = pc ? " at " + describe_pc(pc) : std::string();
  if (tid == kMany) {
    std::snprintf(out, n, "several threads%s", where.c_str());
  } else {
    std::snprintf(out, n, "thread %u%s", static_cast<unsigned>(tid), where.c_str());
  }
}

[[noreturn]] void report(const char* kind, const Fiber* f, std::size_t off, const char* access,
                         const char* relation, std::uint16_t other_tid, const void* other_pc,
                         const char* tail, const void* pc) {
  char detail[2048];
  {
    char other[1024] = "";
    if (relation != nullptr) who(other, sizeof(other), other_tid, other_pc);
    std::snprintf(detail, sizeof(detail), "%s by thread %d of shared byte %zu%s%s%s", access,
                  f->tid, off, relation ? relation : "", other, tail);
  }
  fail_abandon(cudaErrorLaunchFailure, kind, detail, pc, f);
}

void check_bounds(const Fiber* f, std::uintptr_t p, std::size_t n, const char* access,
                  const void* pc) {
  if (p < s.lo || p + n > s.lo + s.size) {
    char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "%s of %zu bytes at offset %lld of the %zu bytes of dynamic shared memory",
                  access, n, static_cast<long long>(p) - static_cast<long long>(s.lo), s.size);
    fail_abandon(cudaErrorIllegalAddress, "out-of-bounds shared-memory access", buf, pc, f);
  }
}

void on_read(const Fiber* f, std::uintptr_t p, std::size_t n, const void* pc) {
  check_bounds(f, p, n, "read", pc);
  const auto tid = static_cast<std::uint16_t>(f->tid);
  const std::size_t off = p - s.lo;
  for (std::size_t i = 0; i < n; ++i) {
    Shadow& b = s.shadow[off + i];
    if (b.w_epoch < s.block_epoch) {
      report("read of uninitialized shared memory", f, off + i, "read", nullptr, 0, nullptr,
             ", which no thread of this block has written", pc);
    }
    if (b.w_epoch == s.epoch && b.w_tid != tid) {
      report("shared-memory race (read after write)", f, off + i, "read", "; written by ",
             b.w_tid, b.w_pc, " with no barrier in between", pc);
    }
    if (b.r_epoch != s.epoch) {
      b.r_epoch = s.epoch;
      b.r_tid = tid;
      b.r_pc = pc;
    } else if (b.r_tid != tid) {
      b.r_tid = kMany;
    }
  }
}

void on_write(const Fiber* f, std::uintptr_t p, std::size_t n, const void* pc) {
  check_bounds(f, p, n, "write", pc);
  const auto tid = static_cast<std::uint16_t>(f->tid);
  const std::size_t off = p - s.lo;
  for (std::size_t i = 0; i < n; ++i) {
    Shadow& b = s.shadow[off + i];
    if (b.w_epoch == s.epoch && b.w_tid != tid) {
      report("shared-memory race (write after write)", f, off + i, "write", "; also written by ",
             b.w_tid, b.w_pc, " with no barrier in between", pc);
    }
    if (b.r_epoch == s.epoch && b.r_tid != tid) {
      report("shared-memory race (write after read)", f, off + i, "write", "; read by ", b.r_tid,
             b.r_pc, " with no barrier in between", pc);
    }
    b.w_tid = tid;
    b.w_epoch = s.epoch;
    b.w_pc = pc;
  }
}

// The tsan callbacks: only accesses of the running fiber to [lo, lo + size + guard) matter.
inline void access(const void* addr, std::size_t n, bool write, const void* pc) {
  if (!g_active || g_cur == nullptr) return;
  const auto p = reinterpret_cast<std::uintptr_t>(addr);
  if (p + n <= s.lo || p >= s.lo + s.size + s.guard) return;
  if (write) {
    on_write(g_cur, p, n, pc);
  } else {
    on_read(g_cur, p, n, pc);
  }
}

}  // namespace

void launch_begin(char* arena, std::size_t arena_size, std::size_t guard) {
  s.lo = reinterpret_cast<std::uintptr_t>(arena);
  s.size = arena_size;
  s.guard = guard;
  if (s.shadow.size() < arena_size) s.shadow.resize(arena_size);
  // Epochs are compared for equality and order: restart them (and the shadow) well before the
  // counter could wrap.
  if (s.epoch > 0xf0000000u) {
    s.epoch = 0;
    std::memset(s.shadow.data(), 0, s.shadow.size() * sizeof(Shadow));
  }
}

void block_begin() { s.block_epoch = ++s.epoch; }

void barrier() { ++s.epoch; }

}  // namespace rc
}  // namespace detail
}  // namespace host
}  // namespace flce

#pragma GCC visibility pop

// ---------------------------------------------------------------------------------------------
// The ThreadSanitizer instrumentation interface (what g++ -fsanitize=thread calls).
// ---------------------------------------------------------------------------------------------
using flce::host::detail::rc::access;

#define FLCE_TSAN_ACCESS(N)                                                          \
  void __tsan_read##N(void* a) { access(a, N, false, __builtin_return_address(0)); } \
  void __tsan_write##N(void* a) { access(a, N, true, __builtin_return_address(0)); } \
  void __tsan_unaligned_read##N(void* a) {                                           \
    access(a, N, false, __builtin_return_address(0));                                \
  }                                                                                  \
  void __tsan_unaligned_write##N(void* a) { access(a, N, true, __builtin_return_address(0)); }

extern "C" {
__attribute__((visibility("hidden"))) void __tsan_init() {}
__attribute__((visibility("hidden"))) void __tsan_func_entry(void*) {}
__attribute__((visibility("hidden"))) void __tsan_func_exit() {}
__attribute__((visibility("hidden"))) void __tsan_vptr_update(void**, void*) {}
__attribute__((visibility("hidden"))) void __tsan_vptr_read(void**) {}
__attribute__((visibility("hidden"))) void __tsan_read1(void* a) {
  access(a, 1, false, __builtin_return_address(0));
}
__attribute__((visibility("hidden"))) void __tsan_write1(void* a) {
  access(a, 1, true, __builtin_return_address(0));
}
#pragma GCC visibility push(hidden)
FLCE_TSAN_ACCESS(2)
FLCE_TSAN_ACCESS(4)
FLCE_TSAN_ACCESS(8)
FLCE_TSAN_ACCESS(16)
void __tsan_read_range(void* a, unsigned long n) { access(a, n, false, __builtin_return_address(0)); }
void __tsan_write_range(void* a, unsigned long n) { access(a, n, true, __builtin_return_address(0)); }
#pragma GCC visibility pop
}

// Atomics in instrumented code (static-local initialization guards in the test programs' and
// libstdc++'s inline code): performed as sequentially consistent atomics; they are not shared
// memory and not race-checked.
#define FLCE_TSAN_ATOMIC(N, T)                                                                   \
  T __tsan_atomic##N##_load(const volatile T* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); } \
  void __tsan_atomic##N##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                       \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                              \
  T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) {                                      \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                              \
  T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) {                                      \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                              \
  T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) {                                      \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                              \
  T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) {                                       \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                              \
  T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) {                                      \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                              \
  int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {           \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);      \
  }                                                                                              \
  int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {             \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
  }                                                                                              \
  T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                 \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);            \
    return c;                                                                                    \
  }

extern "C" {
#pragma GCC visibility push(hidden)
FLCE_TSAN_ATOMIC(8, char)
FLCE_TSAN_ATOMIC(16, short)
FLCE_TSAN_ATOMIC(32, int)
FLCE_TSAN_ATOMIC(64, long)
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
#pragma GCC visibility pop
}
