// The device facilities the torch binding (binding.h's launch-sequence files) uses, behind one
// small interface with two implementations:
//   device_cuda.cpp    a CUDA device: torch's current stream, CUDAGuard, cuBLAS;
//   tools/cuda_host/binding/device_host.cpp
//                      the host emulation (FLCE_CUDA_HOST, tests only): CPU tensors, the
//                      kernels run by the host SIMT runtime (tools/cuda_host/host/), at::mm
//                      standing in for cuBLAS, every workspace NaN-poisoned.
// So the binding's launch sequence (chunk loops, workspace sizing, scales, first-chunk
// initialization, target checks) is one source, run in CI on the CPU and on the GPU alike.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

namespace flce {
namespace dev {

// The stream the kernels are launched on (torch's current stream; nullptr on the host).
cudaStream_t stream();

// Streaming multiprocessors of the current device (the emulated device's count on the host).
int64_t sm_count();

// True while a CUDA graph is being captured on the current stream (never on the host).
bool capturing();

// Makes the tensor's device current for the scope (CUDA); nothing on the host.
class Guard {
 public:
  explicit Guard(const at::Tensor& t);
  ~Guard();
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The backend's tensors: CUDA tensors, or CPU tensors in the host emulation.
bool on_device(const at::Tensor& t);
const char* device_kind();

// at::empty for workspaces and outputs. The host emulation fills the memory with NaN (floating
// types) or 0xFF bytes (others), so that reading an element nobody wrote fails loudly.
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& opts);

// c = alpha * (a @ b) + beta * c: a [m, k], b [k, n] in the compute dtype (bf16, fp16 or fp32),
// any strides (copied when neither is 1); c [m, n] fp32 (or the compute dtype) with unit column
// stride. fp32 accumulation. beta = 0 never reads c. On CUDA: cublasGemmEx (torch's at::mm has
// no form that accumulates 16-bit products into an fp32 c); fp32 operands follow torch's float32
// matmul precision (TF32 unless "highest"). On the host: at::mm in fp32. float64 a, b and c:
// float64 throughout (cuBLAS's DGEMM; the fp64 gradient GEMMs of fp32 inputs).
void gemm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, float alpha, float beta);

// A small host-visible copy of a device tensor whose value is read later without a sync: on CUDA
// an async copy into pinned memory plus an event; ready() polls the event. On the host the copy
// is done at once.
class PendingCopy {
 public:
  explicit PendingCopy(const at::Tensor& src);
  ~PendingCopy();
  PendingCopy(PendingCopy&&) noexcept;
  PendingCopy& operator=(PendingCopy&&) noexcept;
  bool ready() const;             // never blocks
  const at::Tensor& wait() const;  // blocks until the copy has landed; then the host tensor

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dev
}  // namespace flce
