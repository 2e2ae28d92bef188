// The CPU backend's parallelism: one parallel region per op phase, with static work ownership.
//
// Each op phase runs as T workers in a single at::parallel_for region (one index per thread).
// A worker owns a contiguous range of rows or of vocabulary columns for the whole phase and
// runs its tiles, GEMMs and epilogues on its own, single-threaded (BLAS included): no per-tile
// fork/join, no nested thread pools. Where the workers' results meet (a gradient that sums over
// the split axis), each worker fills its own partial and the partials are combined in worker
// order after a Barrier, which sleeps instead of spinning.
//
// Why: a fork/join per tile costs nothing on an idle machine and everything on a busy one. With
// one busy process per core, every join waits for a descheduled thread (a scheduler time slice,
// milliseconds), and a fork/join per tile meets thousands of them per forward + backward (a
// small forward 15x slower under load, docs/cpu-backend.md, "Parallelism"). One region per phase
// meets one join, and the backward one barrier per block of the outer axis. Results never depend
// on scheduling: which worker computes what, and in which order partials are added, is fixed by
// the shapes and the worker count.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>

namespace flce::cpu {

// [begin, end)
struct Span {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

// Worker w's part of [0, n) split into `parts` contiguous pieces whose boundaries are multiples
// of `align` (the last piece takes the remainder).
inline Span split(int64_t n, int64_t parts, int64_t w, int64_t align) {
  const int64_t units = (n + align - 1) / align;
  const int64_t u0 = units * w / parts, u1 = units * (w + 1) / parts;
  return {std::min(n, u0 * align), std::min(n, u1 * align)};
}

// The tiles of `span`: ceil(size / max_tile) tiles of about equal size, multiples of `align`
// but the last, so that a range a little over one tile is not cut into a full tile and a sliver.
struct Tiles {
  Span span;
  int64_t step;
  Tiles(Span s, int64_t max_tile, int64_t align) : span(s) {
    const int64_t count = std::max<int64_t>(1, (s.size() + max_tile - 1) / max_tile);
    const int64_t even = (s.size() + count - 1) / count;
    step = std::min(max_tile, std::max(align, (even + align - 1) / align * align));
  }
  template <typename F>
  void each(F f) const {
    for (int64_t b = span.begin; b < span.end; b += step) f(b, std::min(step, span.end - b));
  }
  int64_t count() const { return (span.size() + step - 1) / step; }
  // The index of the tile that starts at b.
  int64_t index(int64_t b) const { return (b - span.begin) / step; }
};

// Workers for `units` independent pieces of work: at most one per torch thread, and one where
// OpenMP might not give every worker a thread of its own (a call from inside a parallel region,
// dynamic team sizes, a thread limit): workers that wait at a Barrier must all run at once.
int64_t num_workers(int64_t units);

// Whether this parallel region's team has a thread per worker (checked inside the region).
bool team_has(int64_t workers);

// A barrier for `n` workers that blocks in the kernel (futex) rather than spinning: under
// oversubscription a spinning waiter would hold the core that the thread it waits for needs.
// abort() releases every waiter with an exception, so that a worker that throws does not leave
// the others waiting forever.
class Barrier {
 public:
  explicit Barrier(int64_t n) : n_(n) {}
  void wait();
  void abort();

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int64_t n_, count_ = 0, generation_ = 0;
  bool aborted_ = false;
};

// BLAS (MKL) single-threaded on this thread while in scope: flce's workers call it from inside
// their own parallel region, where its own threads would only compete with them.
class BlasSingleThread {
 public:
  BlasSingleThread();
  ~BlasSingleThread();
  BlasSingleThread(const BlasSingleThread&) = delete;
  BlasSingleThread& operator=(const BlasSingleThread&) = delete;

 private:
  int previous_;
};

// fn(w) for w in [0, workers), one worker per thread of one parallel region (serially when
// workers == 1). An exception in a worker aborts `barrier` (if given) and is rethrown here.
template <typename F>
void run_workers(int64_t workers, F fn, Barrier* barrier = nullptr) {
  auto body = [&](int64_t w) {
    BlasSingleThread single;
    try {
      fn(w);
    } catch (...) {
      if (barrier) barrier->abort();
      throw;
    }
  };
  if (workers == 1) {
    body(0);
    return;
  }
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    // Unreachable where num_workers() planned the count; never a deadlock if it is reached.
    TORCH_CHECK(team_has(workers), "flce: the OpenMP team is smaller than the ", workers,
                " workers planned");
    for (int64_t w = w0; w < w1; ++w) body(w);
  });
}

}  // namespace flce::cpu
