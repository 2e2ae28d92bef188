#include "cpu/workers.h"

#include <dlfcn.h>
#include <omp.h>

namespace flce::cpu {

int64_t num_workers(int64_t units) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || units <= 1 || at::in_parallel_region() || omp_get_dynamic()) return 1;
  return std::min({threads, units, static_cast<int64_t>(omp_get_thread_limit())});
}

bool team_has(int64_t workers) { return omp_get_num_threads() >= workers; }

void Barrier::wait() {
  std::unique_lock<std::mutex> lock(m_);
  TORCH_CHECK(!aborted_, "flce: a worker failed");
  const int64_t gen = generation_;
  if (++count_ == n_) {
    count_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
  TORCH_CHECK(!aborted_, "flce: a worker failed");
}

void Barrier::abort() {
  std::lock_guard<std::mutex> lock(m_);
  aborted_ = true;
  cv_.notify_all();
}

namespace {

// MKL's per-thread thread count (mkl_set_num_threads_local: returns the previous one, 0 meaning
// "the global setting"), resolved from the already loaded libtorch_cpu; absent with another
// BLAS, which torch's CPU wheels do not ship. The C entry point is MKL_Set_Num_Threads_Local
// (mkl.h maps the lower-case name to it); the exported lower-case symbol is the Fortran one,
// which takes a pointer.
using set_local_fn = int (*)(int);

set_local_fn mkl_set_local() {
  static const set_local_fn f = [] {
    void* h = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (h == nullptr) h = RTLD_DEFAULT;
    return reinterpret_cast<set_local_fn>(dlsym(h, "MKL_Set_Num_Threads_Local"));
  }();
  return f;
}

}  // namespace

BlasSingleThread::BlasSingleThread() : previous_(-1) {
  if (set_local_fn f = mkl_set_local()) previous_ = f(1);
}

BlasSingleThread::~BlasSingleThread() {
  if (previous_ >= 0) mkl_set_local()(previous_);
}

}  // namespace flce::cpu
