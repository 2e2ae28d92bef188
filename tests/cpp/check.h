// A minimal test harness for the host unit tests: no dependency beyond the C++ standard library,
// so that ctest builds and runs them in seconds without torch.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#ifdef __FAST_MATH__
#error "flce's math must be tested (and built) without -ffast-math"
#endif

namespace check {

inline int failures = 0;
inline long checks = 0;
inline int printed = 0;

#define EXPECT(cond, ...)                                                       \
  do {                                                                          \
    ++::check::checks;                                                          \
    if (!(cond)) {                                                              \
      ++::check::failures;                                                      \
      if (::check::printed++ < 40) {                                            \
        std::fprintf(stderr, "%s:%d: FAILED (%s): ", __FILE__, __LINE__, #cond); \
        std::fprintf(stderr, __VA_ARGS__);                                      \
        std::fputc('\n', stderr);                                               \
      }                                                                         \
    }                                                                           \
  } while (0)

// Fresh inputs every run; FLCE_TEST_SEED reproduces one.
inline std::mt19937_64& rng() {
  static std::mt19937_64 gen([] {
    const char* env = std::getenv("FLCE_TEST_SEED");
    const unsigned long long seed =
        env ? std::strtoull(env, nullptr, 10)
            : static_cast<unsigned long long>(
                  std::chrono::high_resolution_clock::now().time_since_epoch().count());
    std::printf("seed %llu (FLCE_TEST_SEED=%llu reproduces)\n", seed, seed);
    return std::mt19937_64(seed);
  }());
  return gen;
}

inline float normal(float sigma = 1.f) {
  return std::normal_distribution<float>(0.f, sigma)(rng());
}

inline float uniform(float lo, float hi) {
  return std::uniform_real_distribution<float>(lo, hi)(rng());
}

constexpr long double kU = 0x1p-24L;  // fp32 unit roundoff

// The spacing of fp32 numbers at r (denorm_min at 0 and in the subnormal range).
inline long double ulp_at(long double r) {
  const float f = std::fabs(static_cast<float>(r));
  if (std::isinf(f)) return std::numeric_limits<float>::infinity();
  return static_cast<long double>(std::nextafter(f, std::numeric_limits<float>::infinity())) - f;
}

// got agrees with the long double reference within `ulps` fp32 spacings at ref; non-finite
// references must be matched exactly (NaN by NaN, +-inf by the same infinity).
inline bool near_ulps(float got, long double ref, long double ulps) {
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isinf(ref)) return static_cast<long double>(got) == ref;
  if (!std::isfinite(got)) return false;
  return std::fabs(static_cast<long double>(got) - ref) <= ulps * ulp_at(ref);
}

inline bool near_abs(float got, long double ref, long double tol) {
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isinf(ref)) return static_cast<long double>(got) == ref;
  if (!std::isfinite(got)) return false;
  return std::fabs(static_cast<long double>(got) - ref) <= tol;
}

inline long double ulps_off(float got, long double ref) {
  if (!std::isfinite(ref) || !std::isfinite(got)) return 0;
  return std::fabs(static_cast<long double>(got) - ref) / ulp_at(ref);
}

struct Test {
  const char* name;
  void (*fn)();
};

inline std::vector<Test>& registry() {
  static std::vector<Test> tests;
  return tests;
}

struct Register {
  Register(const char* name, void (*fn)()) { registry().push_back({name, fn}); }
};

#define TEST(name)                                               \
  static void name();                                            \
  static ::check::Register name##_registered(#name, &name);      \
  static void name()

// Runs every test, or the one named by argv[1]; the exit status says whether all checks held.
inline int run_all(int argc, char** argv) {
  rng();
  int ran = 0;
  for (const Test& t : registry()) {
    if (argc > 1 && std::string(argv[1]) != t.name) continue;
    const int before = failures;
    const long checks_before = checks;
    t.fn();
    ++ran;
    std::printf("%-44s %s (%ld checks)\n", t.name, failures == before ? "ok" : "FAILED",
                checks - checks_before);
  }
  if (ran == 0) {
    std::fprintf(stderr, "no test named %s\n", argc > 1 ? argv[1] : "");
    return 2;
  }
  std::printf("%d test(s), %ld checks, %d failure(s)\n", ran, checks, failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace check
