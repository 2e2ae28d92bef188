// The CUDA backend's size choices (csrc/cuda/heuristics.h): plain functions, checked on the host
// over random shapes and budgets for the properties the chunk driver and the row kernels rely on.
#include "../../csrc/cuda/heuristics.h"

#include <cstdint>

#include "check.h"

using namespace flce::binding::heuristics;

namespace {

int64_t draw(int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(check::rng());
}

}  // namespace

// Every plan fits the budget (the group buffer and, for 16-bit inputs, the fp32 sub-chunk), its
// rows are multiples of kMinRows unless fewer rows exist or must forces one, the sub-chunk is
// within the group, and must = false gives no plan exactly where kMinRows rows cannot fit.
TEST(chunk_plan_fits_the_budget) {
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t n = draw(0, 1 << 16), ld = draw(1, 1 << 18);
    const int64_t budget = draw(0, int64_t{3} << 30);
    const bool fp32 = draw(0, 1), split = draw(0, 1), must = draw(0, 1);
    const ChunkPlan p = chunk_plan(n, ld, budget, fp32, split, must);
    if (p.group_rows == 0) {
      EXPECT(p.sub_rows == 0 && !must, "n %lld ld %lld budget %lld: empty plan with must",
             (long long)n, (long long)ld, (long long)budget);
      continue;
    }
    EXPECT(p.sub_rows >= 1 && p.sub_rows <= p.group_rows && p.group_rows <= std::max<int64_t>(n, 1),
           "n %lld: group %lld sub %lld", (long long)n, (long long)p.group_rows,
           (long long)p.sub_rows);
    EXPECT(p.in_place == fp32, "in_place %d for fp32 %d", (int)p.in_place, (int)fp32);
    const int64_t bytes = fp32 ? 4 * ld * p.group_rows
                               : 4 * ld * p.sub_rows + 2 * (split ? 2 : 1) * ld * p.group_rows;
    const bool tiny = p.group_rows < kMinRows;  // (a row or a few, forced by must)
    EXPECT(bytes <= budget || (must && tiny), "n %lld ld %lld: %lld bytes over the budget %lld",
           (long long)n, (long long)ld, (long long)bytes, (long long)budget);
    if (fp32) EXPECT(p.group_rows <= kFp32GroupRows, "fp32 group of %lld rows", (long long)p.group_rows);
    if (!must && p.group_rows < n)
      EXPECT(p.group_rows % kMinRows == 0, "group of %lld rows of %lld", (long long)p.group_rows,
             (long long)n);
  }
  // 16-bit, no force: the plan exists exactly where kMinRows rows fit the sub-chunk's share.
  const int64_t ld = 131072;
  EXPECT(chunk_plan(4096, ld, kMinRows * 4 * ld * kSubChunkShare, false, false, false).group_rows >=
             kMinRows, "kMinRows rows of a 128k vocabulary fit");
  EXPECT(chunk_plan(4096, ld, kMinRows * 4 * ld, false, false, false).group_rows == 0,
         "below the sub-chunk's share: no plan");
  EXPECT(chunk_plan(4096, ld, 0, true, false, true).group_rows == 1, "must: one row");
}

// Column splits: within [1, tiles] (and 65535), at least two waves of resident CTAs where the
// tiles allow it, and no other count in the searched range fills its last wave better.
TEST(row_splits_fill_the_device) {
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t ctas = draw(1, 1 << 20), tiles = draw(1, 4096);
    const int per_sm = static_cast<int>(draw(1, 16)), sms = static_cast<int>(draw(1, 200));
    const int s = row_splits(ctas, tiles, per_sm, sms);
    const int64_t slots = int64_t{per_sm} * sms;
    EXPECT(s >= 1 && s <= tiles && s <= 65535, "%d splits of %lld tiles", s, (long long)tiles);
    if (tiles * ctas >= 2 * slots)
      EXPECT(ctas * s >= 2 * slots, "%lld CTAs x %d splits: under two waves of %lld",
             (long long)ctas, s, (long long)slots);
    else
      EXPECT(s == tiles, "few CTAs: every tile its own split (%d of %lld)", s, (long long)tiles);
  }
  EXPECT(row_splits(1, 1, 4, 132) == 1, "one tile: one split");
  EXPECT(row_splits(132 * 4 * 2, 1000, 4, 132) == 1, "two full waves already: no split");
}

int main(int argc, char** argv) { return check::run_all(argc, argv); }
