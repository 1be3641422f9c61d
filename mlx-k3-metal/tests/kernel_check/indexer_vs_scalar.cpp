// The DSA indexer decode kernel (cpp/indexer_cpu.cpp) without MLX, run by simd_vs_scalar.cpp for each path:
//
// - scores: the SIMD path (indexer_best_path()) against the scalar path, keys f32 / f16 / bf16, in place at a
//   row stride wider than d. Every path forms each head's dot with one FMA per feature in feature order, so
//   the dots agree bit for bit; only the weighted sum over heads is grouped differently, so the scores may
//   differ by the classic recursive-summation bound H * eps * sum_h |w_h relu(dot_h)| (allowed twice over).
// - selection: select_topk against a brute-force reference (sort by (score descending, position ascending),
//   keep topk, sort by position), which must agree exactly since both define the same tie-break; on crafted
//   rows (ties, +0/-0, infinities, NaN), on the scalar scores, and tie-aware between the two paths' scores.
// - adversarial shapes: S < topk, S = topk, S = topk + 1, duplicated keys (equal scores), keys whose dots are
//   all negative (relu makes every score 0: the first topk positions are kept).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "indexer_cpu.hpp"

namespace kk = k3::kernels;

namespace {

uint16_t to_bf16(float f) {  // round to nearest even (finite values)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}
float from_bf16(uint16_t h) {
  uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
// Truncating f32 -> f16 for normal magnitudes in [2^-14, 65504) and zero (what the generator draws).
uint16_t to_f16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int exp = static_cast<int>((b >> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((b >> 13) & 0x3ffu));
}
float from_f16(uint16_t h) {
  if ((h & 0x7fffu) == 0) return (h & 0x8000u) ? -0.0f : 0.0f;
  const uint32_t b = (static_cast<uint32_t>(h & 0x8000u) << 16) | ((((h >> 10) & 0x1fu) - 15 + 127) << 23) |
                     (static_cast<uint32_t>(h & 0x3ffu) << 13);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

std::vector<uint32_t> brute_topk(const std::vector<float>& s, size_t k) {
  auto key = [](float f) -> double { return std::isnan(f) ? std::numeric_limits<double>::infinity() * 2 : f; };
  std::vector<uint32_t> idx(s.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) {
    const bool na = std::isnan(s[a]), nb = std::isnan(s[b]);
    if (na != nb) return na;  // NaN above every number
    if (!na && key(s[a]) != key(s[b])) return key(s[a]) > key(s[b]);
    return a < b;
  });
  idx.resize(std::min(k, s.size()));
  std::sort(idx.begin(), idx.end());
  return idx;
}

struct Report {
  const std::string& tag;
  int& failures;
  void result(bool ok, const std::string& name, const std::string& detail) {
    if (ok) {
      std::printf("ok   %sindexer %s\n", tag.c_str(), name.c_str());
    } else {
      ++failures;
      std::printf("FAIL %sindexer %s: %s\n", tag.c_str(), name.c_str(), detail.c_str());
    }
  }
};

bool select_matches(const std::vector<float>& s, size_t k, std::string& why) {
  std::vector<uint32_t> got(std::min(k, s.size())), cand;
  kk::select_topk(s.data(), s.size(), k, got.data(), cand);
  auto want = brute_topk(s, k);
  if (got == want) return true;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      why = "first difference at " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " + std::to_string(want[i]);
      break;
    }
  }
  return false;
}

// Sets `a` and `b` (ascending positions) agree up to positions whose scores are within `tol` of the threshold.
bool tie_aware_equal(const std::vector<uint32_t>& a, const std::vector<uint32_t>& b, const std::vector<float>& s,
                     float tol, std::string& why) {
  if (a.size() != b.size()) {
    why = "sizes differ";
    return false;
  }
  std::vector<uint32_t> only;
  std::set_symmetric_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(only));
  if (only.empty()) return true;
  float thr = std::numeric_limits<float>::infinity();
  for (uint32_t i : b) thr = std::min(thr, s[i]);
  for (uint32_t i : only) {
    if (std::fabs(s[i] - thr) > tol) {
      why = "position " + std::to_string(i) + " (score " + std::to_string(s[i]) + ", threshold " + std::to_string(thr) + ")";
      return false;
    }
  }
  return true;
}

// One scoring case: S positions, H heads of d, keys of `kt` at row stride d + pad.
void score_case(Report& rep, std::mt19937& g, kk::IndexerKeys kt, int H, int d, size_t S, size_t topk,
                const char* what) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(H) * d), w(H);
  for (auto& v : q) v = nd(g);
  for (auto& v : w) v = nd(g) * 0.1f;  // mixed signs, as weights_proj gives
  const size_t stride = d + 8;
  std::vector<float> kf(S * stride, 0.0f);
  const bool dup = std::strcmp(what, "duplicated keys") == 0;
  const bool neg = std::strcmp(what, "all dots negative") == 0;
  for (size_t s = 0; s < S; ++s) {
    for (int j = 0; j < d; ++j) {
      float v = nd(g);
      if (dup && s >= 5) v = kf[(s % 5) * stride + j];
      if (neg) v = -std::fabs(v);
      kf[s * stride + j] = v;
    }
  }
  if (neg) {  // q > 0 and k < 0: every dot is negative, every relu 0
    for (auto& v : q) v = std::fabs(v) + 0.01f;
  }
  std::vector<uint16_t> kh(kt == kk::IndexerKeys::f32 ? 0 : S * stride);
  for (size_t i = 0; i < kh.size(); ++i) {
    kh[i] = kt == kk::IndexerKeys::bf16 ? to_bf16(kf[i]) : to_f16(kf[i]);
    kf[i] = kt == kk::IndexerKeys::bf16 ? from_bf16(kh[i]) : from_f16(kh[i]);
  }
  const void* keys = kt == kk::IndexerKeys::f32 ? static_cast<const void*>(kf.data()) : kh.data();
  std::vector<float> qT, wp;
  kk::IndexerQuery iq;
  kk::indexer_pack_query(q.data(), w.data(), H, d, qT, wp, iq);
  std::vector<float> ref(S), got(S);
  kk::indexer_scores(iq, keys, kt, stride, 0, S, ref.data(), kk::IndexerPath::scalar);
  // Two ranges, so a range that starts past 0 (a thread's share) is checked too.
  const size_t mid = S / 3;
  kk::indexer_scores(iq, keys, kt, stride, 0, mid, got.data(), kk::indexer_best_path());
  kk::indexer_scores(iq, keys, kt, stride, mid, S, got.data() + mid, kk::indexer_best_path());
  const char* kname = kt == kk::IndexerKeys::f32 ? "f32" : kt == kk::IndexerKeys::bf16 ? "bf16" : "f16";
  std::string name = std::string(what) + " " + kname + " H=" + std::to_string(H) + " d=" + std::to_string(d) +
                     " S=" + std::to_string(S) + " topk=" + std::to_string(topk);
  std::string why;
  bool ok = true;
  const float eps = std::numeric_limits<float>::epsilon();
  float max_tol = 0.0f;
  for (size_t s = 0; s < S && ok; ++s) {
    // The bound of the docstring, from an exact (double) recomputation of each term.
    double mag = 0.0;
    for (int h = 0; h < H; ++h) {
      double dot = 0.0;
      for (int j = 0; j < d; ++j) dot += static_cast<double>(q[h * d + j]) * kf[s * stride + j];
      mag += std::fabs(w[h] * std::max(dot, 0.0));
    }
    const float tol = static_cast<float>(2.0 * H * eps * mag * 1.01) + 1e-30f;
    max_tol = std::max(max_tol, tol);
    if (!(std::fabs(got[s] - ref[s]) <= tol)) {
      ok = false;
      why = "score " + std::to_string(s) + ": " + std::to_string(got[s]) + " vs scalar " + std::to_string(ref[s]);
    }
    if (neg && ref[s] != 0.0f) {
      ok = false;
      why = "score " + std::to_string(s) + " should be 0 (every dot negative)";
    }
  }
  if (ok && !select_matches(ref, topk, why)) ok = false;
  if (ok) {
    std::vector<uint32_t> a(std::min(topk, S)), b(a.size()), cand;
    kk::select_topk(got.data(), S, topk, a.data(), cand);
    kk::select_topk(ref.data(), S, topk, b.data(), cand);
    ok = tie_aware_equal(a, b, ref, 2 * max_tol, why);
    if (ok && neg) {
      for (size_t i = 0; i < a.size() && ok; ++i) ok = a[i] == i;
      if (!ok) why = "all-zero scores: not the first topk positions";
    }
  }
  rep.result(ok, name, why);
}

}  // namespace

void run_indexer_cases(const std::string& tag, int& failures) {
  Report rep{tag, failures};
  std::mt19937 g(20261207);
  // select_topk on crafted rows.
  {
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<std::vector<float>> rows = {
        {3, 1, 2, 2, 2, 0, -1},
        {0.0f, -0.0f, 0.0f, -0.0f, 1.0f, -1.0f},
        {-inf, inf, nan, 5, -5, inf, 0},
        {1, 1, 1, 1, 1, 1, 1, 1},
        {-3, -1, -2, -1e-30f, -1e30f, -7},
    };
    int r = 0;
    for (auto& row : rows) {
      for (size_t k = 1; k <= row.size() + 1; ++k) {
        std::string why;
        bool ok = select_matches(row, k, why);
        rep.result(ok, "select crafted row " + std::to_string(r) + " topk=" + std::to_string(k), why);
      }
      ++r;
    }
    // Many ties and a few distinct values, larger than a radix bucket's worth.
    std::uniform_int_distribution<int> small(-3, 3);
    for (size_t n : {1000u, 5000u}) {
      std::vector<float> row(n);
      for (auto& v : row) v = static_cast<float>(small(g)) * 0.25f;
      for (size_t k : {1u, 7u, 100u, 999u}) {
        std::string why;
        bool ok = select_matches(row, k, why);
        rep.result(ok, "select ties n=" + std::to_string(n) + " topk=" + std::to_string(k), why);
      }
    }
    // Values differing only in their low mantissa bits (the third radix pass decides).
    std::vector<float> row(3000);
    for (size_t i = 0; i < row.size(); ++i) row[i] = 1.0f + static_cast<float>((i * 7919) % 1024) * 1.1920929e-7f;
    for (size_t k : {1u, 500u, 2048u}) {
      std::string why;
      bool ok = select_matches(row, k, why);
      rep.result(ok, "select low bits topk=" + std::to_string(k), why);
    }
  }
  for (auto kt : {kk::IndexerKeys::f32, kk::IndexerKeys::bf16, kk::IndexerKeys::f16}) {
    score_case(rep, g, kt, 32, 128, 700, 64, "random");    // K3.1's heads
    score_case(rep, g, kt, 64, 128, 301, 64, "random");    // DeepSeek-V3.2's heads, an odd tail of positions
    score_case(rep, g, kt, 5, 24, 97, 10, "random");       // heads and d not multiples of any vector width
    score_case(rep, g, kt, 8, 16, 40, 64, "random");       // S < topk
    score_case(rep, g, kt, 8, 16, 64, 64, "random");       // S = topk
    score_case(rep, g, kt, 8, 16, 65, 64, "random");       // S just above topk
    score_case(rep, g, kt, 16, 32, 200, 12, "duplicated keys");
    score_case(rep, g, kt, 16, 32, 200, 12, "all dots negative");
  }
}
