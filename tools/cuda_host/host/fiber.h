// Fibers for the host SIMT emulation: a stack and a saved context per emulated CUDA thread.
//
// Two context switches: a hand-written x86-64 one (saves the six callee-saved registers and the
// stack pointer; no signal mask, no FP environment: fibers never change either) and glibc's
// swapcontext, which also saves the signal mask with a sigprocmask system call per switch. The
// first is the default where it exists; set_fiber_impl() selects the other for comparison.
//
// Under AddressSanitizer every switch is announced with __sanitizer_start_switch_fiber /
// __sanitizer_finish_switch_fiber so that ASan tracks the current stack.
#pragma once

#include <ucontext.h>

#include <cstddef>

#include "runtime.h"

namespace flce {
namespace host {
namespace detail {

struct Stack {
  char* lo = nullptr;  // lowest usable address (a PROT_NONE guard page lies below it)
  std::size_t size = 0;
  char* map = nullptr;  // the whole mapping, guard page included
  std::size_t map_size = 0;
};
Stack allocate_stack(std::size_t size);
void free_stack(Stack& s);

struct Context {
  void* sp = nullptr;  // asm switch: the saved stack pointer
  ucontext_t uc;       // ucontext switch
  const void* stack_lo = nullptr;  // for ASan: the stack this context runs on
  std::size_t stack_size = 0;
  void* asan_fake_stack = nullptr;
};

// Prepare `ctx` to run entry() on `stack` at its first switch-in. entry must never return.
void context_init(Context& ctx, const Stack& stack, void (*entry)(), FiberImpl impl);
// The launcher's own context (the OS thread's stack); switch targets it to return there.
void context_init_main(Context& ctx);
// Save the current context into `from` and resume `to`. `from_exits`: `from` is never resumed
// (ASan then releases its fake stack).
void context_switch(Context& from, Context& to, FiberImpl impl, bool from_exits);
// Called first thing on a fresh fiber (ASan bookkeeping of the switch that started it).
void context_started(Context& self);
// A stack whose fiber was abandoned mid-call (a launch ended by an error) may be reused.
void stack_reset_after_abort(const Stack& s);

}  // namespace detail
}  // namespace host
}  // namespace flce
