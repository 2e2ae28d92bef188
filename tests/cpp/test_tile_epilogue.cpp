// Host unit tests of csrc/include/flce/tile_epilogue.h (the fused logits path's epilogue and
// gradient arithmetic) against long double.
//
// A row's tile is dealt to shares as the kernels deal it (4 threads of a WGMMA quad, 2 adjacent
// columns per 8; or 32 lanes of 8 columns in the SIMT stand-in), each share folded with
// epi_see, the shares merged in a butterfly with epi_merge, the tiles merged in order with
// math.h lse_merge: the statistics must then match the long double logsumexp of the non-target
// logits within an fp32 sum's error, E within one bf16 rounding, dz within two.
#include <flce/tile_epilogue.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "check.h"

using check::kU;
using check::near_abs;
using LD = long double;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int kTile = 256;  // params.h kFusedTileCols
constexpr LD kB = 0x1p-8L;  // bf16's unit roundoff (8 significant bits): half an ulp at 1

// Which share of `shares` holds local column c of a tile.
int share_of(int c, int shares) {
  if (shares == 4) return (c % 8) / 2;  // WGMMA fragment: a quad, 2 adjacent columns per 8
  return (c / 8) % shares;              // stand-in: 8 adjacent columns per lane
}

struct TileOut {
  float m, s, zt;
  std::vector<float> e;  // the stored values of the tile's columns (E softcap'(z)), in bf16
};

// The epilogue of one (row, tile) of logits z[c0, c0 + cols), target column tcol (or -1).
TileOut epilogue(const std::vector<float>& z, int64_t c0, int cols, int64_t tcol, int shares,
                 float cap = 0.f, float temperature = 1.f) {
  std::vector<flce::EpiRow> part(shares, flce::epi_row_empty());
  for (int c = 0; c < cols; ++c) flce::epi_see(part[share_of(c, shares)], z[c0 + c], c0 + c == tcol);
  // butterfly: every share ends with the same merged value
  for (int off = 1; off < shares; off *= 2) {
    std::vector<flce::EpiRow> next(shares);
    for (int k = 0; k < shares; ++k) next[k] = flce::epi_merge(part[k], part[k ^ off]);
    part.swap(next);
  }
  for (int k = 1; k < shares; ++k) {
    EXPECT(std::memcmp(&part[k], &part[0], sizeof(flce::EpiRow)) == 0 ||
               (std::isnan(part[k].zt) && std::isnan(part[0].zt)),
           "the butterfly must leave every share with the same value (share %d)", k);
  }
  const float r = flce::epi_ref(part[0].m);
  std::vector<float> sums(shares, 0.f);
  TileOut out{part[0].m, 0.f, part[0].zt, std::vector<float>(cols)};
  for (int c = 0; c < cols; ++c) {
    const float e = flce::epi_exp(z[c0 + c], r, c0 + c == tcol);
    sums[share_of(c, shares)] += e;
    out.e[c] = flce::bf16_value(flce::bf16_bits(flce::epi_stored(e, z[c0 + c], cap, temperature)));
  }
  for (int off = 1; off < shares; off *= 2) {
    std::vector<float> next(shares);
    for (int k = 0; k < shares; ++k) next[k] = sums[k] + sums[k ^ off];
    sums.swap(next);
  }
  out.s = sums[0];
  float q[5];
  flce::epi_store_partial(q, out.m, out.s, out.zt);
  EXPECT(q[0] == out.m && q[3] == 0.f && q[4] == 0.f, "partial layout (m, s, z_t, 0, 0)");
  return out;
}

struct RowOut {
  flce::OnlineLse x;  // merged non-target state
  float zt;
  std::vector<TileOut> tiles;
};

RowOut run_row(const std::vector<float>& z, int64_t tcol, int shares, float cap = 0.f,
               float temperature = 1.f) {
  RowOut row{flce::lse_empty(), -kInf, {}};
  const int64_t v = static_cast<int64_t>(z.size());
  for (int64_t c0 = 0; c0 < v; c0 += kTile) {
    TileOut t = epilogue(z, c0, static_cast<int>(std::min<int64_t>(kTile, v - c0)), tcol, shares,
                         cap, temperature);
    row.x = flce::lse_merge(row.x, flce::OnlineLse{t.m, t.s, 0.f});
    if (t.zt != -kInf) row.zt = t.zt;
    row.tiles.push_back(std::move(t));
  }
  return row;
}

LD logaddexp_ld_(LD a, LD b) {
  const LD mx = std::max(a, b), mn = std::min(a, b);
  if (std::isinf(mn) && mn < 0) return mx;
  return mx + std::log1p(std::exp(mn - mx));
}

LD lse_except(const std::vector<float>& z, int64_t tcol) {
  LD m = -INFINITY;
  for (size_t j = 0; j < z.size(); ++j)
    if (static_cast<int64_t>(j) != tcol) m = std::max<LD>(m, z[j]);
  if (std::isinf(m)) return m;
  LD s = 0;
  for (size_t j = 0; j < z.size(); ++j)
    if (static_cast<int64_t>(j) != tcol) s += std::exp(static_cast<LD>(z[j]) - m);
  return m + std::log(s);
}

// Logits of a row from accumulators, a bias, a softcap and a temperature, as the epilogue forms
// them.
std::vector<float> logits(int64_t v, float sigma, bool bias, float temperature, float cap = 0.f) {
  std::vector<float> z(v);
  for (auto& x : z) {
    const float acc = check::normal(sigma);
    x = flce::epi_logit(acc, bias ? check::normal(1.f) : 0.f, cap, temperature);
  }
  return z;
}

// dz of every column from the row's statistics and the stored values, rounded to bf16.
std::vector<float> fused_grad(const RowOut& row, int64_t tcol, const flce::RowGrad& g,
                              float temperature, float cap = 0.f) {
  const float inv_t = 1.f / temperature;
  std::vector<float> dz;
  for (size_t k = 0; k < row.tiles.size(); ++k) {
    const TileOut& t = row.tiles[k];
    const float f = flce::epi_grad_factor(g, t.m);
    for (size_t c = 0; c < t.e.size(); ++c) {
      const int64_t j = static_cast<int64_t>(k) * kTile + static_cast<int64_t>(c);
      const float d = j == tcol ? flce::epi_target_grad(g.dz_t, row.zt, cap, temperature)
                                : flce::epi_logit_grad(f, t.e[c], g.u, inv_t);
      dz.push_back(flce::bf16_value(flce::bf16_bits(d)));
    }
  }
  return dz;
}

}  // namespace

// The merged statistics are those of an fp32 sum, whatever the shares and the target's place.
TEST(epilogue_statistics_match_long_double) {
  long double worst = 0;
  for (int64_t v : {1, 2, 255, 256, 257, 1000, 4099, 32771}) {
    for (float sigma : {0.1f, 3.f, 30.f}) {
      for (int shares : {4, 32}) {
        const bool bias = v % 2 == 1;
        const float temperature = shares == 4 ? 1.f : 0.7f;
        const auto z = logits(v, sigma, bias, temperature);
        // target: inside a tile, at a tile edge, outside this shard (-1)
        for (int64_t tcol : {int64_t{-1}, v / 2, v - 1, std::min<int64_t>(v - 1, 255)}) {
          const RowOut row = run_row(z, tcol, shares);
          const LD ref = lse_except(z, tcol);
          const float got = flce::lse_value(row.x);
          const LD tol = (4 * std::sqrt(static_cast<LD>(v)) + 4) * kU + 2 * check::ulp_at(ref);
          EXPECT(near_abs(got, ref, tol), "v=%lld sigma=%g shares=%d tcol=%lld: lse_x %.9g vs %.12Lg",
                 (long long)v, sigma, shares, (long long)tcol, got, ref);
          if (std::isfinite(ref)) worst = std::max(worst, std::fabs(got - ref) / tol);
          const float zt_ref = tcol >= 0 ? z[tcol] : -kInf;
          EXPECT(row.zt == zt_ref, "z_t %.9g, expected %.9g", row.zt, zt_ref);
        }
      }
    }
  }
  std::printf("  worst lse_x error: %.3Lg of the tolerance\n", worst);
}

// Each stored E_j is exp(z_j - r_tile) rounded once to bf16, <= 1, 0 at the target column.
TEST(epilogue_stored_exponentials_are_one_rounding) {
  const int64_t v = 3000, tcol = 700;
  const auto z = logits(v, 8.f, false, 1.f);
  const RowOut row = run_row(z, tcol, 4);
  long double worst = 0;
  for (size_t k = 0; k < row.tiles.size(); ++k) {
    const TileOut& t = row.tiles[k];
    for (size_t c = 0; c < t.e.size(); ++c) {
      const int64_t j = static_cast<int64_t>(k) * kTile + static_cast<int64_t>(c);
      if (j == tcol) {
        EXPECT(t.e[c] == 0.f, "the target column stores 0, got %g", t.e[c]);
        continue;
      }
      const LD ref = std::exp(static_cast<LD>(z[j]) - t.m);
      EXPECT(t.e[c] <= 1.f, "E <= 1, got %g", t.e[c]);
      const LD rel = std::fabs(t.e[c] - ref) / ref;
      worst = std::max(worst, rel);
      // bf16's rounding (2^-8 relative) plus the fp32 exp's few ulps
      EXPECT(rel <= kB + 8 * kU, "E relative error %.3Lg", rel);
    }
  }
  std::printf("  worst E error: %.3Lg (bf16 unit roundoff %.3Lg)\n", worst, kB);
}

// dz from E: within two bf16 roundings of the exact gradient where label smoothing is off; the
// exact path's single rounding is exceeded (the bound is needed), and with smoothing the error
// is not bounded relative to dz (why smoothing takes the exact path).
TEST(fused_gradient_is_within_two_roundings) {
  const flce::LossOptions opt{0.f, 1e-4f, 0.f, 0, 1.f};
  long double worst = 0;
  for (int64_t v : {257, 5000, 32771}) {
    flce::LossOptions o = opt;
    o.vocab_size = v;
    for (float temperature : {1.f, 0.5f}) {
     for (float cap : {0.f, 6.f}) {
      const auto z = logits(v, 4.f, false, temperature, cap);
      const int64_t tcol = v / 3;
      const RowOut row = run_row(z, tcol, 4, cap, temperature);
      const flce::RowGrad g = flce::row_grad(row.x, row.zt, false, 1.f, 0.f, o);
      const auto dz = fused_grad(row, tcol, g, temperature, cap);
      // exact: (a p_j - u) c_j / T, p_j = exp(z_j - lse), c_j = softcap'(z_j), with the
      // coefficients' a (their own rounding is the exact path's as well)
      const LD lse = logaddexp_ld_(lse_except(z, tcol), z[tcol]);
      auto chain = [&](float zz) -> LD {
        const LD r = cap > 0 ? static_cast<LD>(zz) * temperature / cap : 0;
        return (1 - r * r) / temperature;
      };
      for (int64_t j = 0; j < v; ++j) {
        if (j == tcol) {
          const float want = g.dz_t * flce::logit_transform_grad(z[tcol], cap, temperature);
          EXPECT(dz[j] == flce::bf16_value(flce::bf16_bits(want)), "target entry");
          continue;
        }
        const LD ref = (g.a * std::exp(static_cast<LD>(z[j]) - lse) - g.u) * chain(z[j]);
        if (ref == 0) continue;
        const LD rel = std::fabs(dz[j] - ref) / std::fabs(ref);
        worst = std::max(worst, rel);
        // (c_j from the fp32 z_j: 1 - r^2 loses |2 r^2 / (1 - r^2)| 2^-24 where r -> 1, as on
        // the exact path)
        const LD r2 = cap > 0 ? std::pow(static_cast<LD>(z[j]) * temperature / cap, 2) : 0;
        EXPECT(rel <= 2 * kB + 16 * kU + 4 * r2 / (1 - r2) * kU,
               "v=%lld cap=%g j=%lld: dz %.9g vs %.12Lg (rel %.3Lg)", (long long)v, cap,
               (long long)j, dz[j], ref, rel);
      }
     }
    }
  }
  std::printf("  worst dz error: %.3Lg relative (one bf16 rounding: %.3Lg, bound %.3Lg)\n",
              worst, kB, 2 * kB);
  EXPECT(worst > kB, "two roundings must show beyond one (worst %.3Lg): else the bound is "
         "loose and the docs' claim wrong", worst);

  // Label smoothing: f E_j - u cancels where a p_j ~ u.
  flce::LossOptions ls = opt;
  ls.label_smoothing = 0.1f;
  ls.vocab_size = 4096;
  auto z = logits(4096, 1.f, false, 1.f);
  const RowOut row = run_row(z, 5, 4);
  const flce::RowGrad g = flce::row_grad(row.x, row.zt, false, 1.f, 0.f, ls);
  const auto dz = fused_grad(row, 5, g, 1.f);  // (no softcap)
  const LD lse = logaddexp_ld_(lse_except(z, 5), z[5]);
  LD worst_ls = 0;
  for (int64_t j = 0; j < 4096; ++j) {
    if (j == 5) continue;
    const LD ref = g.a * std::exp(static_cast<LD>(z[j]) - lse) - g.u;
    if (ref != 0) worst_ls = std::max(worst_ls, std::fabs(dz[j] - ref) / std::fabs(ref));
  }
  std::printf("  with label smoothing: worst dz error %.3Lg relative\n", worst_ls);
  EXPECT(worst_ls > 4 * kB, "smoothing's cancellation should exceed the bound (%.3Lg)", worst_ls);
}

// Tiles without a non-target logit above -inf (masked columns, or only the target): the empty
// state (-inf, 0), E = 0, and a gradient of 0 (not 0 * inf) even where exp(0 - ref) overflows.
TEST(epilogue_empty_and_target_only_tiles) {
  std::vector<float> z(600, -kInf);
  for (int j = 300; j < 600; ++j) z[j] = check::normal(1.f) - 200.f;  // the row's max ~ -197
  const int64_t tcol = 512 + 7;  // the last tile is [512, 600)
  z[tcol] = -150.f;
  const RowOut row = run_row(z, tcol, 4);
  EXPECT(row.tiles[0].m == -kInf && row.tiles[0].s == 0.f, "masked tile: (-inf, 0), got (%g, %g)",
         row.tiles[0].m, row.tiles[0].s);
  for (float e : row.tiles[0].e) EXPECT(e == 0.f, "masked column E = 0, got %g", e);
  const flce::LossOptions o{0.f, 0.f, 0.f, 600, 1.f};
  const flce::RowGrad g = flce::row_grad(row.x, row.zt, false, 1.f, 0.f, o);
  EXPECT(std::isfinite(g.ref) && g.ref < -140.f, "ref %g", g.ref);
  EXPECT(flce::epi_grad_factor(g, row.tiles[0].m) == 0.f, "an empty tile's factor is 0");
  const auto dz = fused_grad(row, tcol, g, 1.f);
  for (int j = 0; j < 300; ++j) EXPECT(dz[j] == 0.f, "masked column dz = 0, got %g", dz[j]);
  for (float d : dz) EXPECT(std::isfinite(d), "finite gradient, got %g", d);
  // A tile holding only the target (v = 1 past a tile edge).
  std::vector<float> one(257);
  for (auto& x : one) x = check::normal(2.f);
  const RowOut r2 = run_row(one, 256, 32);
  EXPECT(r2.tiles[1].m == -kInf && r2.tiles[1].s == 0.f && r2.tiles[1].zt == one[256],
         "target-only tile: (-inf, 0) and z_t");
  EXPECT(r2.zt == one[256], "z_t reaches the row");
}

// A NaN logit reaches s (hence the loss) and its own dz; +inf makes s NaN (the row kernels'
// semantics: the loss is NaN, never a finite value).
TEST(epilogue_propagates_nan_and_inf) {
  for (float bad : {kNaN, kInf}) {
    for (int shares : {4, 32}) {
      auto z = logits(700, 2.f, false, 1.f);
      z[300] = bad;
      const RowOut row = run_row(z, 10, shares);
      EXPECT(std::isnan(row.tiles[1].s), "bad=%g: the tile's s must be NaN, got %g", bad,
             row.tiles[1].s);
      EXPECT(std::isnan(flce::lse_value(row.x)), "bad=%g: lse_x NaN", bad);
      const flce::LossOptions o{0.f, 0.f, 0.f, 700, 1.f};
      const flce::RowGrad g = flce::row_grad(row.x, row.zt, false, 1.f, 0.f, o);
      const flce::RowLoss l = flce::row_loss(row.x, row.zt, 0.f, false, o);
      EXPECT(std::isnan(l.loss), "bad=%g: loss NaN, got %g", bad, l.loss);
      const auto dz = fused_grad(row, 10, g, 1.f);
      EXPECT(std::isnan(dz[300]), "bad=%g: its dz NaN, got %g", bad, dz[300]);
    }
  }
  // NaN at the target column: z_t NaN, whatever share holds it.
  auto z = logits(300, 1.f, false, 1.f);
  z[37] = kNaN;
  for (int shares : {4, 32}) EXPECT(std::isnan(run_row(z, 37, shares).zt), "NaN z_t");
}

// The tile-local target column the CUTLASS epilogues use: ignored rows, another shard's or
// another tile's target give -1, every column of the tile its own index.
TEST(epilogue_tile_target) {
  const int64_t ign = -100, off = 1000, v = 600;  // a shard of columns [1000, 1600)
  EXPECT(flce::epi_tile_target(ign, ign, off, v, 0, kTile) == -1, "ignored row");
  EXPECT(flce::epi_tile_target(999, ign, off, v, 0, kTile) == -1, "before the shard");
  EXPECT(flce::epi_tile_target(1600, ign, off, v, 512, kTile) == -1, "past the shard's end");
  for (int64_t t = off; t < off + v; ++t) {
    for (int64_t col0 = 0; col0 < v; col0 += kTile) {
      const int64_t c = t - off;
      const int want = c >= col0 && c < col0 + kTile ? static_cast<int>(c - col0) : -1;
      EXPECT(flce::epi_tile_target(t, ign, off, v, col0, kTile) == want,
             "t=%lld col0=%lld", (long long)t, (long long)col0);
    }
  }
}

int main(int argc, char** argv) { return check::run_all(argc, argv); }
