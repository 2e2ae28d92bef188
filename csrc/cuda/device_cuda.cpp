// dev:: for a CUDA device (csrc/cuda/device.h): torch's current stream and device, and the
// GEMMs on cuBLAS.
#include "cuda/device.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>

#include <algorithm>

namespace flce {
namespace dev {

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream(); }

int64_t sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

struct Guard::Impl {
  c10::cuda::CUDAGuard guard;
};
Guard::Guard(const at::Tensor& t) : impl_(new Impl{c10::cuda::CUDAGuard(t.device())}) {}
Guard::~Guard() = default;

bool on_device(const at::Tensor& t) { return t.is_cuda(); }
const char* device_kind() { return "CUDA"; }

at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  return at::empty(sizes, opts);
}

namespace {

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return CUDA_R_32F;
    case at::kBFloat16:
      return CUDA_R_16BF;
    case at::kHalf:
      return CUDA_R_16F;
    case at::kDouble:
      return CUDA_R_64F;
    default:
      TORCH_CHECK(false, "flce: no cuBLAS type for ", t);
  }
}

// A row-major matrix X [r, c] (strides (ld, 1)) is the column-major X^T with leading dimension
// ld; a column-major one (strides (1, ld)) is itself. In the column-major product
// C^T = B^T A^T that computes row-major C = A B, an operand is used as stored (N) in the first
// case and transposed (T) in the second.
struct ColMajor {
  const void* ptr;
  cublasOperation_t op;
  int64_t ld;
};

bool row_major(const at::Tensor& x) {
  return x.stride(1) == 1 && (x.size(0) <= 1 || x.stride(0) >= std::max<int64_t>(1, x.size(1)));
}
bool col_major_layout(const at::Tensor& x) {
  return x.stride(0) == 1 && (x.size(1) <= 1 || x.stride(1) >= std::max<int64_t>(1, x.size(0)));
}

// x as cuBLAS reads it; x must be row- or column-major (gemm copies other layouts first).
ColMajor col_major(const at::Tensor& x) {
  const int64_t r = x.size(0), c = x.size(1);
  if (row_major(x)) return {x.data_ptr(), CUBLAS_OP_N, std::max({x.stride(0), c, int64_t{1}})};
  return {x.data_ptr(), CUBLAS_OP_T, std::max({x.stride(1), r, int64_t{1}})};
}

at::Tensor blas_layout(const at::Tensor& x) {
  return row_major(x) || col_major_layout(x) ? x : x.contiguous();
}

}  // namespace

void gemm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, float alpha, float beta) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  TORCH_CHECK(b.size(0) == k && c.size(0) == m && c.size(1) == n, "flce: gemm shapes ",
              a.sizes(), " @ ", b.sizes(), " -> ", c.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "flce: gemm operand dtypes differ");
  TORCH_CHECK(c.stride(1) == 1 || n <= 1, "flce: gemm output needs a unit column stride");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.f) {
      c.zero_();
    } else {
      c.mul_(beta);
    }
    return;
  }
  const at::Tensor a2 = blas_layout(a), b2 = blas_layout(b);
  const ColMajor ca = col_major(a2), cb = col_major(b2);
  const int64_t ldc = std::max({c.stride(0), n, int64_t{1}});
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  // fp32 accumulation, with the reduced-precision reductions of 16-bit GEMMs disallowed (they
  // would round partial sums to 16 bits); fp32 operands follow torch's float32 matmul precision.
  // float64 operands (the fp64 gradient GEMMs of fp32 inputs): double accumulation, a double
  // result, alpha and beta as doubles.
  const bool f64 = a.scalar_type() == at::kDouble;
  TORCH_CHECK(!f64 || c.scalar_type() == at::kDouble, "flce: a float64 gemm writes float64");
  const double alpha64 = alpha, beta64 = beta;
  cublasComputeType_t compute = f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  if (a.scalar_type() == at::kFloat &&
      at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST) {
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  }
  cublasMath_t previous;
  TORCH_CUDABLAS_CHECK(cublasGetMathMode(handle, &previous));
  TORCH_CUDABLAS_CHECK(cublasSetMathMode(
      handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                        CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  const cublasStatus_t st = cublasGemmEx_64(
      handle, cb.op, ca.op, n, m, k, f64 ? static_cast<const void*>(&alpha64) : &alpha, cb.ptr,
      cuda_type(b.scalar_type()), cb.ld, ca.ptr, cuda_type(a.scalar_type()), ca.ld,
      f64 ? static_cast<const void*>(&beta64) : &beta, c.data_ptr(), cuda_type(c.scalar_type()),
      ldc, compute, CUBLAS_GEMM_DEFAULT);
  cublasSetMathMode(handle, previous);
  TORCH_CUDABLAS_CHECK(st);
}

struct PendingCopy::Impl {
  at::Tensor host;
  cudaEvent_t event = nullptr;
  ~Impl() {
    if (event != nullptr) cudaEventDestroy(event);
  }
};

PendingCopy::PendingCopy(const at::Tensor& src) : impl_(new Impl) {
  impl_->host = at::empty(src.sizes(), src.options().device(at::kCPU).pinned_memory(true));
  impl_->host.copy_(src, /*non_blocking=*/true);
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&impl_->event, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(impl_->event, stream()));
}
PendingCopy::~PendingCopy() = default;
PendingCopy::PendingCopy(PendingCopy&&) noexcept = default;
PendingCopy& PendingCopy::operator=(PendingCopy&&) noexcept = default;

bool PendingCopy::ready() const {
  const cudaError_t st = cudaEventQuery(impl_->event);
  if (st == cudaErrorNotReady) {
    (void)cudaGetLastError();  // cudaEventQuery's "not ready" is not an error to keep
    return false;
  }
  C10_CUDA_CHECK(st);
  return true;
}

const at::Tensor& PendingCopy::wait() const {
  C10_CUDA_CHECK(cudaEventSynchronize(impl_->event));
  return impl_->host;
}

}  // namespace dev
}  // namespace flce
