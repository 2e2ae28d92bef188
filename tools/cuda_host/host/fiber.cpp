#include "fiber.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__)
// void flce_host_switch(void** save_sp, void* new_sp): push the callee-saved registers, save the
// stack pointer, load the other one, pop its registers and return into it. A fresh stack is
// prepared (context_init) so that this `ret` enters the fiber's entry function.
asm(R"(
  .text
  .p2align 4
  .globl flce_host_switch
  .hidden flce_host_switch
  .type flce_host_switch, @function
flce_host_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size flce_host_switch, .-flce_host_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
extern "C" void flce_host_switch(void** save_sp, void* new_sp);
#endif

#pragma GCC visibility push(hidden)

namespace flce {
namespace host {
namespace detail {

Stack allocate_stack(std::size_t size) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  size = (size + page - 1) / page * page;
  Stack s;
  s.map_size = size + page;
  void* m = mmap(nullptr, s.map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    std::fprintf(stderr, "flce host emulation: cannot map a %zu-byte fiber stack\n", s.map_size);
    std::abort();  // out of address space: nothing sensible to continue with
  }
  s.map = static_cast<char*>(m);
  // The lowest page traps a stack overflow instead of letting it run into the next stack.
  mprotect(s.map, page, PROT_NONE);
  s.lo = s.map + page;
  s.size = size;
  return s;
}

void free_stack(Stack& s) {
  if (s.map != nullptr) munmap(s.map, s.map_size);
  s = Stack{};
}

void context_init(Context& ctx, const Stack& stack, void (*entry)(), FiberImpl impl) {
#if defined(__SANITIZE_ADDRESS__)
  // The frames a finished fiber never returned from (its entry and the final switch, at the top
  // of the stack) keep their redzones poisoned; clear them before the stack is reused.
  const std::size_t top = stack.size < 32768 ? stack.size : 32768;
  ASAN_UNPOISON_MEMORY_REGION(stack.lo + stack.size - top, top);
#endif
  ctx.stack_lo = stack.lo;
  ctx.stack_size = stack.size;
  ctx.asan_fake_stack = nullptr;
#if defined(__x86_64__)
  if (impl == FiberImpl::kAsm) {
    auto top = reinterpret_cast<std::uintptr_t>(stack.lo + stack.size) & ~std::uintptr_t{15};
    auto* slot = reinterpret_cast<void**>(top);
    slot[-1] = nullptr;                          // entry()'s return address: it never returns
    slot[-2] = reinterpret_cast<void*>(entry);   // popped by flce_host_switch's ret
    for (int i = 3; i <= 8; ++i) slot[-i] = nullptr;  // rbp rbx r12 r13 r14 r15
    ctx.sp = slot - 8;                           // entry runs with rsp = top - 8, as after a call
    return;
  }
#endif
  (void)impl;
  getcontext(&ctx.uc);
  ctx.uc.uc_stack.ss_sp = stack.lo;
  ctx.uc.uc_stack.ss_size = stack.size;
  ctx.uc.uc_link = nullptr;
  makecontext(&ctx.uc, entry, 0);
}

void context_init_main(Context& ctx) {
  ctx.sp = nullptr;
  ctx.stack_lo = nullptr;
  ctx.stack_size = 0;
  ctx.asan_fake_stack = nullptr;
#if defined(__SANITIZE_ADDRESS__)
  // ASan must be told the bounds of the stack a switch returns to.
  pthread_attr_t attr;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    void* lo = nullptr;
    std::size_t size = 0;
    pthread_attr_getstack(&attr, &lo, &size);
    ctx.stack_lo = lo;
    ctx.stack_size = size;
    pthread_attr_destroy(&attr);
  }
#endif
}

void context_switch(Context& from, Context& to, FiberImpl impl, bool from_exits) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(from_exits ? nullptr : &from.asan_fake_stack, to.stack_lo,
                                 to.stack_size);
#else
  (void)from_exits;
#endif
#if defined(__x86_64__)
  if (impl == FiberImpl::kAsm) {
    flce_host_switch(&from.sp, to.sp);
  } else {
    swapcontext(&from.uc, &to.uc);
  }
#else
  (void)impl;
  swapcontext(&from.uc, &to.uc);
#endif
#if defined(__SANITIZE_ADDRESS__)
  // Back in `from`: learn the bounds of the stack we came from (the launcher's stack is known
  // only this way).
  const void* prev_lo = nullptr;
  std::size_t prev_size = 0;
  __sanitizer_finish_switch_fiber(from.asan_fake_stack, &prev_lo, &prev_size);
#endif
}

void context_started(Context& self) {
#if defined(__SANITIZE_ADDRESS__)
  const void* prev_lo = nullptr;
  std::size_t prev_size = 0;
  __sanitizer_finish_switch_fiber(nullptr, &prev_lo, &prev_size);
#endif
  (void)self;
}

void stack_reset_after_abort(const Stack& s) {
#if defined(__SANITIZE_ADDRESS__)
  // Frames that never returned keep their redzones poisoned.
  ASAN_UNPOISON_MEMORY_REGION(s.lo, s.size);
#else
  (void)s;
#endif
}

}  // namespace detail
}  // namespace host
}  // namespace flce

#pragma GCC visibility pop
