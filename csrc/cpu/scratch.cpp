#include "cpu/scratch.h"

#include <cstdlib>
#include <new>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flce::cpu {

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kOffset = 16;  // bytes past the block's start (scratch.h)
}  // namespace

void* huge_alloc(size_t bytes) {
  const size_t size = (bytes + kOffset + kHugePage - 1) / kHugePage * kHugePage;
  void* block = nullptr;
  if (posix_memalign(&block, kHugePage, size) != 0) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(block, size, MADV_HUGEPAGE);  // a request: refused, or without THP, 4 KiB pages
#endif
  return static_cast<char*>(block) + kOffset;
}

void huge_free(void* p) {
  if (p != nullptr) std::free(static_cast<char*>(p) - kOffset);
}

}  // namespace flce::cpu
