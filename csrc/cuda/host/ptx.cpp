// Host implementations of the PTX instructions of csrc/cuda/ptx.cuh, from the PTX ISA:
//
//   cp.async.cg.shared.global [dst], [src], 16, src_size   (9.7.9.25.3.1)
//       The copy is deferred: it lands (src_size bytes, the rest of the 16 zero-filled) when the
//       issuing thread's cp.async.wait_group retires its group (9.7.9.25.3.3: "writes performed
//       by cp.async are made visible to the executing thread only after ... wait_group"), the
//       latest moment the ISA allows. A read before that sees the old (poisoned) bytes, and the
//       race detector reports it. The source, also for src_size 0, must lie in a registered
//       allocation; dst and src are 16-byte aligned.
//   ldmatrix.sync.aligned.m8n8.x4.shared.b16 (9.7.14.5.15)
//       Lanes 8i..8i+7 give the row addresses of matrix i; lane l receives in r[i] the 32-bit
//       word l % 4 of row l / 4 of matrix i (elements 2 (l % 4), +1; the lower column in the low
//       half). Each row is 16 bytes, 16-byte aligned, in shared memory.
//   mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (9.7.14.5.8), g = lane / 4,
//   q = lane % 4, each register two 16-bit elements, the lower index in the low half:
//       a0 = A[g][2q..2q+1], a1 = A[g+8][2q..], a2 = A[g][2q+8..], a3 = A[g+8][2q+8..];
//       b0 = B[2q..2q+1][g], b1 = B[2q+8..2q+9][g]; c/d: c0,c1 = C[g][2q..], c2,c3 = C[g+8][2q..].
//   mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (9.7.14.5.7), one fp32 pattern per register:
//       a0 = A[g][q], a1 = A[g+8][q], a2 = A[g][q+4], a3 = A[g+8][q+4]; b0 = B[q][g],
//       b1 = B[q+4][g]; c/d as above. The tensor core reads the upper 19 bits of an operand
//       (sign, exponent, 10 mantissa bits): the low 13 bits are dropped (truncation).
//   Products are exact (in double); the 16 (or 8) products and c are summed in double and rounded
//   once to fp32. The hardware's order and internal rounding are unspecified by the ISA ("at least
//   single precision"), so tests compare with tolerances, never bitwise.
//   cvt.rna.tf32.f32 (9.7.9.21): round to nearest, ties away from zero, low 13 bits zero; NaN
//   gives the canonical NaN 0x7fffffff.
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "internal.h"

#pragma GCC visibility push(hidden)

namespace flce {
namespace host {
namespace detail {
namespace {

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

Fiber* self_or_throw(const char* what) {
  Fiber* f = g_cur;
  if (f == nullptr) throw std::logic_error(std::string("flce host emulation: ") + what +
                                           " outside a kernel launch");
  return f;
}

// Lands the oldest committed group of f.
void land_group(Fiber* f) {
  const std::uint32_t n = f->groups.front();
  for (std::uint32_t i = 0; i < n; ++i) {
    const Copy& c = f->copies[i];
    if (c.src_size > 0) std::memcpy(c.dst, c.src, static_cast<std::size_t>(c.src_size));
    std::memset(c.dst + c.src_size, 0, static_cast<std::size_t>(16 - c.src_size));
    if (rc::g_active) rc::async_land(f, c.dst, 16);
  }
  f->copies.erase(f->copies.begin(), f->copies.begin() + n);
  f->groups.erase(f->groups.begin());
}

double half_to_double(std::uint16_t h) {
  const int sign = h >> 15;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), -24);  // subnormal (or zero)
  } else if (exp == 31) {
    v = mant == 0 ? INFINITY : NAN;
  } else {
    v = std::ldexp(static_cast<double>(mant | 0x400), exp - 25);
  }
  return sign ? -v : v;
}

double bf16_to_double(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

double tf32_operand(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  if (std::isnan(f)) return f;
  const std::uint32_t t = u & 0xffffe000u;  // the 19 bits the tensor core reads
  std::memcpy(&f, &t, sizeof(f));
  return f;
}

void ldmatrix_compute(Fiber* const* lanes, unsigned, Op) {
  const char* rows[32];
  for (int l = 0; l < 32; ++l) {
    const std::uint32_t addr = lanes[l]->dep.u[0];
    if (addr % 16 != 0) {
      fail(cudaErrorMisalignedAddress, "misaligned ldmatrix row address",
           "shared address " + std::to_string(addr) + " (row of matrix " + std::to_string(l / 8) +
               ") is not 16-byte aligned",
           lanes[l]->pc, lanes[l]);
    }
    rows[l] = shared_ptr(addr, 16);
    if (rows[l] == nullptr) {
      fail(cudaErrorIllegalAddress, "ldmatrix row outside shared memory",
           "shared address " + std::to_string(addr) + " + 16 bytes is outside the dynamic shared "
               "memory of the launch",
           lanes[l]->pc, lanes[l]);
    }
    if (rc::g_active) rc::read(lanes[l], rows[l], 16, lanes[l]->pc);
  }
  for (int l = 0; l < 32; ++l) {
    auto* r = static_cast<std::uint32_t*>(lanes[l]->dep.out);
    for (int i = 0; i < 4; ++i) std::memcpy(&r[i], rows[8 * i + l / 4] + 4 * (l % 4), 4);
  }
}

template <Op kOp>
void mma_compute(Fiber* const* lanes, unsigned, Op) {
  constexpr int K = kOp == Op::kMmaTf32 ? 8 : 16;
  double A[16][K];
  double B[K][8];
  double C[16][8];
  for (int l = 0; l < 32; ++l) {
    const std::uint32_t* u = lanes[l]->dep.u;  // a0..a3, b0, b1
    const float* c = static_cast<const float*>(lanes[l]->dep.out);
    const int g = l / 4, q = l % 4;
    if constexpr (kOp == Op::kMmaTf32) {
      A[g][q] = tf32_operand(u[0]);
      A[g + 8][q] = tf32_operand(u[1]);
      A[g][q + 4] = tf32_operand(u[2]);
      A[g + 8][q + 4] = tf32_operand(u[3]);
      B[q][g] = tf32_operand(u[4]);
      B[q + 4][g] = tf32_operand(u[5]);
    } else {
      auto elem = [](std::uint32_t reg, int hi) {
        const auto h = static_cast<std::uint16_t>(hi ? reg >> 16 : reg & 0xffffu);
        return kOp == Op::kMmaBf16 ? bf16_to_double(h) : half_to_double(h);
      };
      for (int e = 0; e < 2; ++e) {
        A[g][2 * q + e] = elem(u[0], e);
        A[g + 8][2 * q + e] = elem(u[1], e);
        A[g][2 * q + 8 + e] = elem(u[2], e);
        A[g + 8][2 * q + 8 + e] = elem(u[3], e);
        B[2 * q + e][g] = elem(u[4], e);
        B[2 * q + 8 + e][g] = elem(u[5], e);
      }
    }
    C[g][2 * q] = c[0];
    C[g][2 * q + 1] = c[1];
    C[g + 8][2 * q] = c[2];
    C[g + 8][2 * q + 1] = c[3];
  }
  float D[16][8];
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 8; ++j) {
      double s = C[i][j];
      for (int k = 0; k < K; ++k) s += A[i][k] * B[k][j];
      D[i][j] = static_cast<float>(s);
    }
  }
  for (int l = 0; l < 32; ++l) {
    float* d = static_cast<float*>(lanes[l]->dep.out);
    const int g = l / 4, q = l % 4;
    d[0] = D[g][2 * q];
    d[1] = D[g][2 * q + 1];
    d[2] = D[g + 8][2 * q];
    d[3] = D[g + 8][2 * q + 1];
  }
}

template <Op kOp>
void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1,
         const void* pc) {
  self_or_throw("mma.sync");
  Deposit dep{};
  for (int i = 0; i < 4; ++i) dep.u[i] = a[i];
  dep.u[4] = b0;
  dep.u[5] = b1;
  dep.out = d;
  collective(kOp, 0xffffffffu, dep, &mma_compute<kOp>, nullptr, 0, pc);
}

}  // namespace
}  // namespace detail

namespace ptx {

using detail::Fiber;
using detail::fail;

void cp_async_cg_16(std::uint32_t dst, const void* src, int src_size) {
  const void* pc = __builtin_return_address(0);
  Fiber* f = detail::self_or_throw("cp.async");
  if (src_size < 0 || src_size > 16) {
    fail(cudaErrorLaunchFailure, "cp.async with an invalid src-size",
         "src-size " + std::to_string(src_size) + " (cp-size is 16)", pc);
  }
  char* d = detail::shared_ptr(dst, 16);
  if (dst % 16 != 0) {
    fail(cudaErrorMisalignedAddress, "misaligned cp.async destination",
         "shared address " + std::to_string(dst) + " is not 16-byte aligned", pc);
  }
  if (d == nullptr) {
    fail(cudaErrorIllegalAddress, "cp.async destination outside shared memory",
         "shared address " + std::to_string(dst) + " + 16 bytes is outside the dynamic shared "
             "memory of the launch",
         pc);
  }
  if (src == nullptr) {
    fail(cudaErrorIllegalAddress, "cp.async source outside every registered allocation",
         "the source is a null pointer (src-size " + std::to_string(src_size) +
             "; a zero-size copy still needs a valid global address)",
         pc);
  }
  if (reinterpret_cast<std::uintptr_t>(src) % 16 != 0) {
    fail(cudaErrorMisalignedAddress, "misaligned cp.async source",
         "global address " + detail::hex(src) + " is not 16-byte aligned", pc);
  }
  if (!detail::in_registered_allocation(src, static_cast<std::size_t>(src_size))) {
    fail(cudaErrorIllegalAddress, "cp.async source outside every registered allocation",
         "global address " + detail::hex(src) + ", src-size " + std::to_string(src_size) +
             " (register device buffers with flce::host::register_allocation)",
         pc);
  }
  if (detail::rc::g_active) detail::rc::async_issue(f, d, 16, pc);
  f->copies.push_back(detail::Copy{d, static_cast<const char*>(src), src_size});
}

void cp_async_commit_group() {
  Fiber* f = detail::self_or_throw("cp.async.commit_group");
  std::uint32_t committed = 0;
  for (std::uint32_t n : f->groups) committed += n;
  f->groups.push_back(static_cast<std::uint32_t>(f->copies.size()) - committed);
}

void cp_async_wait_group(int n) {
  Fiber* f = detail::self_or_throw("cp.async.wait_group");
  while (f->groups.size() > static_cast<std::size_t>(n)) detail::land_group(f);
}

void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  const void* pc = __builtin_return_address(0);
  detail::self_or_throw("ldmatrix");
  detail::Deposit dep{};
  dep.u[0] = addr;
  dep.out = r;
  detail::collective(detail::Op::kLdmatrix, 0xffffffffu, dep, &detail::ldmatrix_compute, nullptr,
                     0, pc);
}

void mma_m16n8k16_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                       std::uint32_t b1) {
  detail::mma<detail::Op::kMmaBf16>(d, a, b0, b1, __builtin_return_address(0));
}

void mma_m16n8k16_f16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                      std::uint32_t b1) {
  detail::mma<detail::Op::kMmaF16>(d, a, b0, b1, __builtin_return_address(0));
}

void mma_m16n8k8_tf32(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                      std::uint32_t b1) {
  detail::mma<detail::Op::kMmaTf32>(d, a, b0, b1, __builtin_return_address(0));
}

std::uint32_t cvt_rna_tf32(float x) {
  if (std::isnan(x)) return 0x7fffffffu;
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  // Half an ulp of tf32 added to the magnitude bits, then truncated: ties round away from zero
  // (and the largest finite values round to infinity, as round-to-nearest must).
  return (u + 0x1000u) & 0xffffe000u;
}

}  // namespace ptx
}  // namespace host
}  // namespace flce

#pragma GCC visibility pop
