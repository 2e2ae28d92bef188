// Shared helpers of the cuda-host test programs: exact-size "device" buffers (so that ASan sees
// every overrun), launch helpers and error-report matchers. The test framework is tests/cpp/check.h.
#pragma once

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../cpp/check.h"
#include "host/runtime.h"

namespace harness {

// An exact-size heap buffer standing for a global allocation.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : data_(n) {}
  DeviceBuffer(std::size_t n, const T& fill) : data_(n, fill) {}
  explicit DeviceBuffer(const std::vector<T>& v) : data_(v) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() { return data_.empty() ? nullptr : data_.data(); }
  const T* data() const { return data_.empty() ? nullptr : data_.data(); }
  std::size_t size() const { return data_.size(); }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  std::vector<T>& vec() { return data_; }

 private:
  std::vector<T> data_;
};

// The launch error, read (and reset) as a launcher does.
inline cudaError_t last_launch_error() { return cudaGetLastError(); }

// The launch failed with `code` and a report containing `kind`.
inline bool failed_with(cudaError_t got, cudaError_t code, const char* kind) {
  const std::string msg = flce::host::last_error_message();
  const bool ok = got == code && msg.find(kind) != std::string::npos;
  if (!ok) {
    std::fprintf(stderr, "expected error %d with \"%s\", got %d; last report:\n%s\n",
                 static_cast<int>(code), kind, static_cast<int>(got), msg.c_str());
  }
  return ok;
}

inline float qnan() { return std::numeric_limits<float>::quiet_NaN(); }

inline bool race_checked_build() {
#if defined(__SANITIZE_THREAD__)
  return true;
#else
  return false;
#endif
}

}  // namespace harness
