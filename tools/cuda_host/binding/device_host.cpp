// dev:: for the host emulation of the CUDA backend (csrc/cuda/device.h; built with
// FLCE_CUDA_HOST into the test-only module of module.cpp): CPU tensors stand for device
// memory, the kernels run on the host SIMT runtime (tools/cuda_host/host/runtime.h) at their launch,
// and at::mm in fp32 stands in for cuBLAS. Every workspace from dev::empty is NaN-poisoned.
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <limits>

#include "cuda/device.h"
#include "host/runtime.h"

namespace flce {
namespace dev {

cudaStream_t stream() { return nullptr; }

int64_t sm_count() { return host::device_properties().multi_processor_count; }

bool capturing() { return false; }

struct Guard::Impl {};
Guard::Guard(const at::Tensor&) {}
Guard::~Guard() = default;

bool on_device(const at::Tensor& t) { return t.is_cpu(); }
const char* device_kind() { return "CPU, for the host emulation of the CUDA backend"; }

at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  at::Tensor t = at::empty(sizes, opts);
  if (at::isFloatingType(t.scalar_type())) {
    t.fill_(std::numeric_limits<double>::quiet_NaN());
  } else if (t.numel() > 0) {
    t.view({-1}).view(at::kByte).fill_(0xFF);
  }
  return t;
}

void gemm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, float alpha, float beta) {
  TORCH_CHECK(a.size(1) == b.size(0) && c.size(0) == a.size(0) && c.size(1) == b.size(1),
              "flce: gemm shapes ", a.sizes(), " @ ", b.sizes(), " -> ", c.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "flce: gemm operand dtypes differ");
  if (c.numel() == 0) return;
  // fp32 products and accumulation, rounded once to c's dtype, as cuBLAS with an fp32 compute
  // type (float64 operands: in float64, as cuBLAS's DGEMM); beta = 0 never reads c (it may
  // hold NaN poison). Outside autocast: under torch.autocast("cpu") at::mm would run in bf16,
  // where the binding's cuBLAS calls do not.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const at::ScalarType acc = a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(acc != at::kDouble || c.scalar_type() == at::kDouble,
              "flce: a float64 gemm writes float64");
  // fp32 operands where torch's float32 matmul precision allows TF32 (cuBLAS's
  // CUBLAS_COMPUTE_32F_FAST_TF32): each operand rounded to TF32's 10 mantissa bits first
  // (round to nearest, ties away, as cvt.rna.tf32.f32), the products and sums in fp32.
  auto operand = [acc](const at::Tensor& t) {
    at::Tensor x = t.to(acc);
    if (t.scalar_type() != at::kFloat ||
        at::globalContext().float32MatmulPrecision() == at::Float32MatmulPrecision::HIGHEST) {
      return x;
    }
    at::Tensor bits = x.contiguous().view(at::kInt);
    const at::Tensor finite = at::isfinite(x.contiguous());
    const at::Tensor rounded = at::bitwise_and(bits + 0x1000, static_cast<int64_t>(~0x1FFF))
                                   .view(at::kFloat);
    return at::where(finite, rounded, x.contiguous());
  };
  at::Tensor r = at::mm(operand(a), operand(b));
  if (alpha != 1.f) r.mul_(alpha);
  if (beta != 0.f) r.add_(c.to(acc), beta);
  c.copy_(r);
}

// The copy is made at once, but reported landed only from the second poll on: the first poll
// (the one in the call that queued it) finds it in flight, as on a GPU whose host runs ahead, so
// the binding's deferred path (raise at the next call) runs here as it does on the device.
struct PendingCopy::Impl {
  at::Tensor host;
  mutable int polls = 0;
};
PendingCopy::PendingCopy(const at::Tensor& src) : impl_(new Impl{src.clone()}) {}
PendingCopy::~PendingCopy() = default;
PendingCopy::PendingCopy(PendingCopy&&) noexcept = default;
PendingCopy& PendingCopy::operator=(PendingCopy&&) noexcept = default;
bool PendingCopy::ready() const { return ++impl_->polls > 1; }
const at::Tensor& PendingCopy::wait() const { return impl_->host; }

}  // namespace dev
}  // namespace flce
