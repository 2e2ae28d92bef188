// Large per-worker scratch arrays of the CPU backend (MiBs), on transparent huge pages:
// HugeVector<T>, a std::vector whose allocator asks for them.
//
// The single pass holds a row block's logits per worker (up to 152 MiB in all): the dC GEMM
// reads each tile transposed, a column at a time across ~1000 rows 8 KiB apart, so with 4 KiB
// pages every row is a page of its own (a TLB miss per row). Huge pages (2 MiB) cover 250 rows
// each, which saves a few percent of the fp32 single pass (docs/cpu-backend.md, "Forward +
// backward in one pass"). Where the kernel grants huge pages only on request (THP "madvise"
// mode) madvise asks; where THP is off the pages stay 4 KiB and nothing else changes.
//
// The array starts 16 bytes past its 2 MiB boundary, where glibc puts a large std::vector's
// data (a page boundary plus its 16-byte header): starting on the boundary itself is slower
// (same section), as a page-aligned std::vector-sized array is, for reasons not pinned down (4
// KiB aliasing between the tile rows, 8256 bytes apart, and MKL's page-aligned packing buffers
// is one candidate). Value-initialized (zeroed) by the worker that allocates it: the page faults
// happen in one tight loop, not inside the GEMM that first writes each page.
#pragma once

#include <cstddef>
#include <vector>

namespace flce::cpu {

// A 2 MiB-aligned block of whole huge pages, with madvise(MADV_HUGEPAGE); the pointer returned
// is 16 bytes past the block's start. huge_alloc throws std::bad_alloc when out of memory.
void* huge_alloc(size_t bytes);
void huge_free(void* p);

template <typename T>
struct HugeAllocator {
  using value_type = T;
  HugeAllocator() = default;
  template <typename U>
  HugeAllocator(const HugeAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(huge_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t) { huge_free(p); }
  template <typename U>
  bool operator==(const HugeAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const HugeAllocator<U>&) const { return false; }
};

template <typename T>
using HugeVector = std::vector<T, HugeAllocator<T>>;

}  // namespace flce::cpu
