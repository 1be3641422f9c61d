// Probe (not part of the build or of CI): the affine 8-bit GEMV of the mid-size model's non-expert matrices, alone,
// streamed from memory, for the question of issue 46's 75% end-to-end target: whether the decode step is bound
// by this kernel's rate or by what runs around it. Eight copies of a 4096 x 14336 8-bit matrix (58.7 MB each, far
// over the L3) are read in turn through the library's row kernels (`affine_rows`, group 64, f32 scales and biases,
// one activation row, split over the kernels' thread pool as the ops split it), f32 and q8 activations; the rate
// counts the codes and the scales and biases. Compare with `mlx-k3 bench --bandwidth` run just before or after.
//
// Build and run (x86-64; one command, then the run):
//   M=mlx-k3-metal/cpp; g++ -O2 -std=c++20 -march=native -I $M -I mlx-k3-sys/shim benches/probes/affine8_gemv.cpp
//       $M/qmm_cpu*.cpp $M/parallel.cpp -lpthread -o /tmp/affine8_gemv
//   K3_NUM_THREADS=2 /tmp/affine8_gemv [K N]
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
  const int K = argc > 2 ? std::atoi(argv[1]) : 4096, N = argc > 2 ? std::atoi(argv[2]) : 14336;
  const int copies = 8, G = 64, calls = 40;
  std::mt19937 g(1);
  std::vector<std::vector<uint32_t>> wq(copies, std::vector<uint32_t>((size_t)N * K / 4));
  for (auto& w : wq) {
    for (auto& v : w) v = g();
  }
  std::vector<float> scales((size_t)N * K / G, 0.01f), biases((size_t)N * K / G, -0.5f);
  std::vector<float> x(K), out(N);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(g);
  for (bool q8 : {false, true}) {
    kk::PreparedActivations p(x.data(), 1, K, kk::WeightFormat::affine, 8, true, q8);
    std::vector<double> ms;
    for (int it = 0; it < calls; ++it) {
      kk::AffineRows r{wq[it % copies].data(), scales.data(), biases.data(), K, G, 8};
      const auto t0 = std::chrono::steady_clock::now();
      kk::parallel_range(N, 64, [&](size_t n0, size_t n1) {
        kk::affine_rows(r, p.a, (int)n0, (int)n1, out.data(), N, true);
      });
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double bytes = (double)N * K + 2.0 * N * K / G * 4;
    std::printf("8-bit g%d %s %d x %d, %d threads: median %.3f ms (best %.3f) -> %.1f GB/s at the median\n", G,
                q8 ? "q8" : "f32", K, N, kk::num_threads(), ms[calls / 2], ms[0], bytes / ms[calls / 2] / 1e6);
  }
}
