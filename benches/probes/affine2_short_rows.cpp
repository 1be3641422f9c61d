// Probe (not part of the build or of CI): the affine 2-bit q8 row kernels on the short rows of routed experts (the
// mid-size model's gate/up K = 1024 and down K = 512), streamed from memory, the AVX-512 VNNI kernel and the AVX2 one
// alternated call by call in one process (the VNNI kernel where the CPU has it; the AVX2 timing reads the VNNI
// activation layout, so only its timing means anything). Copies of the matrix, each with its own scales and
// biases, fill about 400 MB (COPIES=1: one copy, cache-resident). Also times 8 bits (BITS=8; both rows the same
// kernel then). Compare with `mlx-k3 bench --bandwidth` run just before or after.
//
// Build and run (x86-64):
//   M=mlx-k3-metal/cpp; g++ -O2 -std=c++20 -march=native -I $M -I mlx-k3-sys/shim benches/probes/affine2_short_rows.cpp
//       $M/qmm_cpu*.cpp $M/parallel.cpp -lpthread -o /tmp/affine2_short_rows
//   K3_NUM_THREADS=1 /tmp/affine2_short_rows 512 8192      (K N; BITS=8, COPIES=n, CALLS=n optional)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "parallel.hpp"
#include "qmm_cpu.hpp"

namespace kk = k3::kernels;

int main(int argc, char** argv) {
  const int K = argc > 2 ? std::atoi(argv[1]) : 512, N = argc > 2 ? std::atoi(argv[2]) : 8192;
  auto env_int = [](const char* name, int dflt) { const char* v = std::getenv(name); return v ? std::atoi(v) : dflt; };
  const int BITS = env_int("BITS", 2), G = 64, calls = env_int("CALLS", 2000);
  const int copies = env_int("COPIES", std::max(8, (int)(400e6 / ((double)N * K * BITS / 8))));
  std::mt19937 g(1);
  std::vector<std::vector<uint32_t>> wq(copies, std::vector<uint32_t>((size_t)N * K * BITS / 32));
  for (auto& w : wq) {
    for (auto& v : w) v = g();
  }
  std::vector<float> scales((size_t)N * K / G, 0.01f), biases((size_t)N * K / G, -0.5f);
  std::vector<float> x(K), out(N);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(g);
  std::vector<std::vector<float>> sc(copies, scales), bi(copies, biases);
  kk::PreparedActivations p(x.data(), 1, K, kk::WeightFormat::affine, BITS, true, true);
  const bool vnni = p.a.q8_vnni2;
  std::vector<double> ms[2];
  for (int it = 0; it < calls; ++it) {
    const int mode = it & 1;
    kk::Activations a = p.a;
    if (BITS == 2) a.q8_vnni2 = vnni && mode == 0;
    kk::AffineRows r{wq[it % copies].data(), sc[it % copies].data(), bi[it % copies].data(), K, G, BITS};
    const auto t0 = std::chrono::steady_clock::now();
    kk::parallel_range(N, 64, [&](size_t n0, size_t n1) { kk::affine_rows(r, a, (int)n0, (int)n1, out.data(), N, true); });
    ms[mode].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const double bytes = (double)N * K * BITS / 8 + 2.0 * N * K / G * 4;
  for (int mode = 0; mode < 2; ++mode) {
    auto& v = ms[mode];
    std::sort(v.begin(), v.end());
    std::printf("%d-bit g%d q8 %s %d x %d, %d threads: p10 %.4f ms median %.4f ms -> %.1f GB/s at p10, %.1f at the median\n", BITS, G,
                mode == 0 ? (vnni ? "vnni" : "avx2") : "avx2", K, N, kk::num_threads(), v[v.size() / 10], v[v.size() / 2],
                bytes / v[v.size() / 10] / 1e6, bytes / v[v.size() / 2] / 1e6);
  }
}
