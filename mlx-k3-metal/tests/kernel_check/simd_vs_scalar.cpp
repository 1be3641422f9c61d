// The packed-weight kernels' SIMD paths against their scalar paths, without MLX: qmm_cpu*.cpp and parallel.cpp
// compiled with this file for the machine it runs on. tests/simd_kernels.rs builds it natively and for AArch64
// (cross compiler + qemu user emulation), which is how the NEON paths are checked on an x86-64 machine.
//
// Each case draws random weights and activations, runs the kernel with cpu_has_simd()'s path and with the
// scalar path (which the model tests compare with MLX's ops), over two row ranges (n0 > 0 checks the offsets).
// The formats with integer kernels (codebook, MXFP4, affine 2/4/8-bit) run again with q8 activations (cases
// tagged ", q8"): both paths then work on the same rounded activations, and their integer dots are exact, so
// the same bound applies.
// Tolerance: both are f32 sums of the same K products in different orders, so each differs from the exact dot
// by at most ~K * eps * sum_k |w_k x_k| (the classic bound for recursive summation, with one more rounding per
// partial scale); the check allows 2 * K * eps * Wmax * sum_k |x_k|, where Wmax bounds |w| from the generation
// parameters. A decoding mistake (a code in the wrong place, a wrong scale) moves the result by a sizeable
// fraction of Wmax * sum|x| (about 1 / sqrt(K) of it, or more), far above that.
// On x86-64 every case runs with the AVX2 kernels and, where the CPU has AVX-512, again with the AVX-512 ones
// (lines tagged [avx2] / [avx512]).
// Exit status 0 when every case passes, 3 when the CPU has no SIMD path (x86-64 without AVX2); one line per case.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "qmm_cpu.hpp"

namespace kk = k3::kernels;

// The DSA indexer kernel's cases (indexer_vs_scalar.cpp).
void run_indexer_cases(const std::string& tag, int& failures);

namespace {

int failures = 0;
std::string prefix;  // the path under test, before each case name

struct Rng {
  std::mt19937 g;
  explicit Rng(uint32_t seed) : g(seed) {}
  uint32_t u32() { return g(); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g); }
};

// Truncating f32 -> f16 for values under 65504 in magnitude; those under f16's smallest normal (6.1e-5, which a
// bias drawn from [-0.5, 0.5] can be) become zero.
uint16_t f32_to_f16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int exp = (int)((b >> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return (uint16_t)sign;
  const uint32_t man = (b >> 13) & 0x3ffu;
  return (uint16_t)(sign | ((uint32_t)exp << 10) | man);
}
float f16_to_f32(uint16_t h) {  // normal values and zero (what f32_to_f16 makes)
  if ((h & 0x7fffu) == 0) return (h & 0x8000u) ? -0.0f : 0.0f;
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  const uint32_t b = sign | ((exp - 15 + 127) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Runs `run(simd, n0, n1, out)` both ways over [0, N) as two ranges and compares.
template <class Run>
void compare(const std::string& name, int rows, int N, int K, const std::vector<float>& x, float wmax, Run run) {
  std::vector<float> simd((size_t)rows * N, NAN), scalar((size_t)rows * N, NAN);
  const int split = N / 3;
  run(true, 0, split, simd.data());
  run(true, split, N, simd.data());
  run(false, 0, N, scalar.data());
  const float eps = 1.1920929e-7f;
  double worst = 0;
  bool ok = true;
  for (int m = 0; m < rows; ++m) {
    double xabs = 0;
    for (int k = 0; k < K; ++k) xabs += std::fabs(x[(size_t)m * K + k]);
    const double tol = 2.0 * K * eps * wmax * xabs;
    for (int n = 0; n < N; ++n) {
      const double a = simd[(size_t)m * N + n], b = scalar[(size_t)m * N + n];
      const double err = std::fabs(a - b);
      if (!(err <= tol)) {  // also catches NaN
        if (ok) std::printf("  row %d col %d: simd %.9g scalar %.9g (tolerance %.3g)\n", m, n, a, b, tol);
        ok = false;
      }
      if (tol > 0) worst = std::max(worst, err / tol);
    }
  }
  std::printf("%s %s%s (worst error / tolerance %.3g)\n", ok ? "ok  " : "FAIL", prefix.c_str(), name.c_str(), worst);
  if (!ok) ++failures;
}

std::vector<float> activations(Rng& r, int rows, int K) {
  std::vector<float> x((size_t)rows * K);
  for (auto& v : x) v = r.uniform(-1.0f, 1.0f);
  x[0] = 7.5f;  // an outlier, as real activations have
  return x;
}

void affine_case(Rng& r, int bits, int group, int rows, int N, int K, int scale_dtype, bool q8 = false) {
  const int ng = K / group;
  std::vector<uint32_t> wq((size_t)N * K * bits / 32);
  for (auto& v : wq) v = r.u32();
  std::vector<float> s((size_t)N * ng), b((size_t)N * ng);
  std::vector<uint16_t> sh(s.size()), bh(b.size());
  float wmax = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    s[i] = r.uniform(0.001f, 0.02f);
    b[i] = r.uniform(-0.5f, 0.5f);
    if (scale_dtype == 1) {
      sh[i] = f32_to_f16(s[i]), bh[i] = f32_to_f16(b[i]);
      s[i] = f16_to_f32(sh[i]), b[i] = f16_to_f32(bh[i]);
    } else if (scale_dtype == 2) {
      uint32_t sb, bb;
      std::memcpy(&sb, &s[i], 4);
      std::memcpy(&bb, &b[i], 4);
      sh[i] = (uint16_t)(sb >> 16), bh[i] = (uint16_t)(bb >> 16);
      sb = (uint32_t)sh[i] << 16, bb = (uint32_t)bh[i] << 16;
      std::memcpy(&s[i], &sb, 4);
      std::memcpy(&b[i], &bb, 4);
    }
    wmax = std::max(wmax, std::fabs(s[i]) * (float)((1 << bits) - 1) + std::fabs(b[i]));
  }
  kk::AffineRows w{wq.data(), s.data(), b.data(), K, group, bits};
  if (scale_dtype) {
    w = kk::AffineRows{wq.data(), nullptr, nullptr, K, group, bits, sh.data(), bh.data(), scale_dtype == 2};
  }
  auto x = activations(r, rows, K);
  static const char* dt[] = {"f32", "f16", "bf16"};
  const std::string name = "affine " + std::to_string(bits) + "-bit group " + std::to_string(group) + " " +
                           dt[scale_dtype] + " scales, " + std::to_string(rows) + " x " + std::to_string(K) +
                           " @ " + std::to_string(N) + (q8 ? ", q8" : "");
  compare(name, rows, N, K, x, wmax, [&](bool simd, int n0, int n1, float* out) {
    kk::PreparedActivations p(x.data(), rows, K, kk::WeightFormat::affine, bits, simd, q8);
    kk::affine_rows(w, p.a, n0, n1, out, N, simd);
  });
}

void mxfp4_case(Rng& r, int rows, int N, int K, bool q8 = false) {
  std::vector<uint32_t> wq((size_t)N * K / 8);
  for (auto& v : wq) v = r.u32();
  std::vector<uint8_t> e((size_t)N * K / 32);
  int emax = 0;
  for (auto& v : e) {
    v = (uint8_t)(120 + r.u32() % 10);  // 2^-7 .. 2^2
    emax = std::max(emax, (int)v);
  }
  const float wmax = 6.0f * std::ldexp(1.0f, emax - 127);
  kk::Mxfp4Rows w{wq.data(), e.data(), K};
  auto x = activations(r, rows, K);
  compare("mxfp4 " + std::to_string(rows) + " x " + std::to_string(K) + " @ " + std::to_string(N) + (q8 ? ", q8" : ""),
          rows, N, K, x, wmax, [&](bool simd, int n0, int n1, float* out) {
            kk::PreparedActivations p(x.data(), rows, K, kk::WeightFormat::mxfp4, 4, simd, q8);
            kk::mxfp4_rows(w, p.a, n0, n1, out, N, simd);
          });
}

// ternary: 0 the compact layout (SIMD vs scalar); 1 the ternary layout's SIMD path and 2 its scalar path, each
// against the compact layout's scalar path (the same values: codebook_to_ternary is lossless).
void codebook_case(Rng& r, int rows, int N, int K, bool q8 = false, int ternary = 0) {
  const int nb = K / 32, nsb = kk::codebook_super_blocks(K);
  std::vector<uint8_t> codes((size_t)N * K / 8);
  std::vector<uint16_t> qh((size_t)N * nb), d((size_t)N * nsb);
  for (auto& v : codes) v = (uint8_t)r.u32();
  for (auto& v : qh) v = (uint16_t)r.u32();  // index bits, scale L and delta sign all random
  float dmax = 0;
  for (auto& v : d) {
    v = f32_to_f16(r.uniform(0.001f, 0.05f));
    dmax = std::max(dmax, f16_to_f32(v));
  }
  const float wmax = dmax * 15.0f * 1.125f;  // d * (2L + 1) * |grid + delta|, L <= 7
  kk::CodebookRows w{codes.data(), qh.data(), d.data(), K};
  std::vector<uint8_t> trits(N * kk::ternary_row_bytes(K));
  kk::codebook_to_ternary(codes.data(), qh.data(), N, K, trits.data());
  kk::CodebookRows t{nullptr, qh.data(), d.data(), K, trits.data()};
  auto x = activations(r, rows, K);
  const char* kind = ternary == 0 ? "codebook " : ternary == 1 ? "ternary codebook " : "ternary codebook (scalar) ";
  compare(kind + std::to_string(rows) + " x " + std::to_string(K) + " @ " + std::to_string(N) + (q8 ? ", q8" : ""),
          rows, N, K, x, wmax, [&](bool under_test, int n0, int n1, float* out) {
            // The run under test takes the layout under test; the reference run the compact layout's scalar path.
            const bool simd = under_test && ternary != 2;
            const kk::CodebookRows& rows_of = under_test && ternary ? t : w;
            kk::PreparedActivations p(x.data(), rows, K, kk::WeightFormat::codebook, 0, simd, q8);
            kk::codebook_rows(rows_of, p.a, n0, n1, out, N, simd);
          });
}

// Every case once, names prefixed with `tag` (the path under test).
void run_all(const std::string& tag) {
  prefix = tag;
  run_indexer_cases(tag, failures);
  Rng r(20261201);
  // K: a multiple of 256, one with a short last super-block and a 128-chunk tail (416 = 256 + 160), and 96. Group
  // 256 takes the kernels' path for groups not known at compile time.
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    for (int group : {32, 64, 128, 256}) {
      for (int K : {512, 416, 96}) {
        if (K % group) continue;
        for (int rows : {1, 3, 6}) affine_case(r, bits, group, rows, 13, K, 0);
      }
    }
  }
  for (int bits : {2, 4, 8}) {
    affine_case(r, bits, 64, 2, 9, 256, 1);
    affine_case(r, bits, 64, 5, 9, 256, 2);
  }
  // f16/bf16 scales at the other group sizes (the AVX-512 and AVX2 kernels read them in their stored dtype, with a
  // load per group size), and group 96: a multiple of 32 that does not divide 256 (the 2-bit kernels' per-block scale path).
  for (int bits : {2, 4, 8}) {
    for (int group : {32, 128, 256}) {
      affine_case(r, bits, group, group == 128 ? 5 : 1, 9, 512, group == 32 ? 1 : 2);
    }
    for (int dt : {0, 1, 2}) affine_case(r, bits, 96, 3, 9, 768, dt);
  }
  // The odd widths' AVX2 tiles read f16/bf16 scales in place too.
  for (int bits : {3, 5, 6}) {
    affine_case(r, bits, 64, 2, 9, 256, 1);
    affine_case(r, bits, 128, 5, 9, 512, 2);
    affine_case(r, bits, 96, 1, 9, 768, 1 + (bits == 5));
  }
  for (int K : {512, 416, 96}) {
    for (int rows : {1, 2, 5}) {
      mxfp4_case(r, rows, 11, K);
      codebook_case(r, rows, 11, K);
      codebook_case(r, rows, 11, K, false, 1);
      codebook_case(r, rows, 11, K, false, 2);
    }
  }
  // q8 activations (int8 with per-256 scales, K3_QMM_ACT=q8): the integer kernels against the scalar q8 path,
  // both on the same rounded activations.
  for (int K : {512, 416, 96}) {
    for (int rows : {1, 2, 5}) {
      codebook_case(r, rows, 11, K, true);
      codebook_case(r, rows, 11, K, true, 1);
      codebook_case(r, rows, 11, K, true, 2);
      mxfp4_case(r, rows, 11, K, true);
    }
    // Enough rows for the int8 GEMM (codebook_gemm_applies: AVX-512 VNNI CPUs with the AVX-512 paths on, K a
    // multiple of 256; elsewhere, and for K = 416 and 96, these take the row kernels): a partial 16-row tile, two
    // tiles and a pair plus one, and 13 weight rows split 4 / 9 (panels of 4 with a short one).
    for (int rows : {kk::kGemmMinRows, 21, 40}) {
      codebook_case(r, rows, 13, K, true);
      codebook_case(r, rows, 13, K, true, 1);
    }
    for (int bits : {2, 4, 8}) {
      for (int group : {32, 64, 128}) {
        if (K % group == 0) affine_case(r, bits, group, K == 512 ? 3 : 1, 13, K, 0, true);
      }
      affine_case(r, bits, 64, 2, 9, 256, 1 + (K == 512), true);  // f16 / bf16 scales
    }
  }
}

}  // namespace

int main() {
  if (!kk::cpu_has_simd()) {
    std::printf("this CPU has no SIMD path for the packed-weight kernels: nothing to compare\n");
    return 3;
  }
  kk::set_force_scalar(true);
  if (kk::cpu_has_simd()) {
    std::printf("FAIL set_force_scalar(true) left cpu_has_simd() on\n");
    return 1;
  }
  kk::set_force_scalar(false);
#if defined(__aarch64__)
#if defined(__ARM_FEATURE_DOTPROD)
  std::printf("paths: NEON vs scalar (AArch64, q8 kernels with the dot-product extension)\n");
#else
  std::printf("paths: NEON vs scalar (AArch64, q8 kernels without the dot-product extension)\n");
#endif
  run_all("");
#else
  // Where the CPU has AVX-512, every case runs twice: AVX2 only, then with the AVX-512 kernels.
  kk::set_avx512(0);
  if (kk::cpu_has_avx512()) {
    std::printf("FAIL set_avx512(0) left cpu_has_avx512() on\n");
    return 1;
  }
  std::printf("paths: AVX2 vs scalar (x86-64)\n");
  run_all("[avx2] ");
  kk::set_avx512(1);
  if (kk::cpu_has_avx512()) {
    std::printf("paths: AVX-512 vs scalar (x86-64%s)\n",
                kk::cpu_has_avx512_vnni() ? "; the codebook's q8 GEMM with VNNI" : "; no VNNI: no codebook GEMM");
    run_all("[avx512] ");
  } else {
    std::printf("no AVX-512 on this CPU: its kernels were not run\n");
  }
#endif
  std::printf("%s: %d failing case(s)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
