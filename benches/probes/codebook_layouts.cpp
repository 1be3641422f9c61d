// Probe (not part of the build or of CI): the codebook kernels on the compact (IQ1_S planes) and the ternary
// execution layout, next to the affine 2-bit kernel, called directly (no MLX graph around them, so this times the
// kernels alone; `cargo bench -p mlx-k3 --bench qmm` has the same rows through the library's ops). Shapes as
// benches/qmm.rs: GEMV 4096 x 14336 (one activation row); `experts_decode`: 16 experts of [3072, 3584], one row
// each; `experts_prefill512`: 128 experts of [512, 1024], 512 tokens x top-8 sorted by expert (32 rows each).
// Variants alternate within each round (A, B, C, ..., A, B, C, ...), each timed as the median of `reps` calls, so a
// machine shared with other work shows as ranges over the rounds. Work is split over the kernels' thread pool
// (K3_NUM_THREADS) the way the library's ops split it: tasks of at least 64 output rows.
//
// Build and run (x86-64; after any build of mlx-k3-metal, or with the shim's headers; one command):
//   M=mlx-k3-metal/cpp; g++ -O2 -std=c++20 -march=native -I $M -I mlx-k3-sys/shim
//       benches/probes/codebook_layouts.cpp $M/qmm_cpu*.cpp $M/parallel.cpp -lpthread -o /tmp/codebook_layouts
//   K3_NUM_THREADS=2 taskset -c 0,1 /tmp/codebook_layouts 5 20        (rounds, calls per median; wall time)
//   K3_NUM_THREADS=1 /tmp/codebook_layouts 3 10 cpu [NAME]                   (one thread, its CPU time: the kernels'
//                                                                      cost on a machine shared with other work)
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "parallel.hpp"
#include "qmm_cpu.hpp"

namespace kk = k3::kernels;
using Clock = std::chrono::steady_clock;

namespace {

std::mt19937_64 rng(20261207);

uint16_t f16_bits(float f) {  // normal values only (the scales here)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return (uint16_t)(((b >> 16) & 0x8000) | ((((b >> 23) & 0xff) - 112) << 10) | ((b >> 13) & 0x3ff));
}

// One codebook stack of `e` experts [n, k] in both layouts, and a 2-bit affine stack of the same shape.
struct Stack {
  int e, n, k;
  std::vector<uint8_t> codes, trits;
  std::vector<uint16_t> qh, scales;
  std::vector<uint32_t> wq;
  std::vector<float> as, ab;
  Stack(int e_, int n_, int k_) : e(e_), n(n_), k(k_) {
    const size_t rows = (size_t)e * n;
    codes.resize(rows * k / 8);
    qh.resize(rows * k / 32);
    scales.resize(rows * kk::codebook_super_blocks(k));
    for (auto& v : codes) v = (uint8_t)rng();
    for (auto& v : qh) v = (uint16_t)rng();
    for (auto& v : scales) v = f16_bits(0.001f + (rng() % 1000) * 1e-5f);
    trits.resize(rows * kk::ternary_row_bytes(k));
    kk::codebook_to_ternary(codes.data(), qh.data(), rows, k, trits.data());
    wq.resize(rows * k * 2 / 32);
    for (auto& v : wq) v = (uint32_t)rng();
    as.assign(rows * k / 64, 0.01f);
    ab.assign(rows * k / 64, -0.02f);
  }
  size_t compact_bytes() const { return codes.size() + 2 * qh.size() + 2 * scales.size(); }
  size_t ternary_bytes() const { return trits.size() + 2 * qh.size() + 2 * scales.size(); }
  size_t affine_bytes() const { return 4 * wq.size() + 4 * as.size() + 4 * ab.size(); }
  kk::CodebookRows rows(int ex, bool ternary) const {
    return kk::codebook_view(ternary ? trits.data() : codes.data(), qh.data(), scales.data(), (size_t)ex * n, k,
                             ternary);
  }
  kk::AffineRows affine(int ex) const { return kk::affine_view(wq.data(), as.data(), ab.data(), 0, (size_t)ex * n, k, 64, 2); }
};

enum class Kind { compact, ternary, affine2 };

// One matmul: for each (expert, rows) pair, x rows [rows, k] @ expert^T -> out; tasks of >= 64 output rows.
struct Problem {
  const Stack* s;
  std::vector<int> experts;  // expert of each group
  std::vector<int> rows;     // activation rows of each group
  std::vector<float> x, out;
  Problem(const Stack* st, std::vector<int> ex, std::vector<int> r) : s(st), experts(std::move(ex)), rows(std::move(r)) {
    size_t total = 0;
    for (int v : rows) total += v;
    x.resize(total * s->k);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& v : x) v = nd(rng);
    out.resize(total * s->n);
  }
  void run(Kind kind, bool q8) {
    const kk::WeightFormat f = kind == Kind::affine2 ? kk::WeightFormat::affine : kk::WeightFormat::codebook;
    const int bits = kind == Kind::affine2 ? 2 : 0;
    std::vector<std::unique_ptr<kk::PreparedActivations>> preps;
    size_t off = 0;
    std::vector<size_t> offs;
    for (size_t g = 0; g < rows.size(); ++g) {
      offs.push_back(off);
      preps.push_back(std::make_unique<kk::PreparedActivations>(x.data() + off * s->k, rows[g], s->k, f, bits,
                                                                kk::cpu_has_simd(), q8));
      off += rows[g];
    }
    struct Task {
      int g, n0, n1;
    };
    std::vector<Task> tasks;
    const int chunk = std::max(64, (int)((size_t)s->n * rows.size() / (8 * kk::num_threads()) + 1));
    for (int g = 0; g < (int)rows.size(); ++g) {
      for (int n0 = 0; n0 < s->n; n0 += chunk) tasks.push_back({g, n0, std::min(s->n, n0 + chunk)});
    }
    kk::parallel_for(tasks.size(), [&](size_t t) {
      const Task& k = tasks[t];
      float* o = out.data() + offs[k.g] * s->n;
      if (kind == Kind::affine2) {
        kk::affine_rows(s->affine(experts[k.g]), preps[k.g]->a, k.n0, k.n1, o, s->n, kk::cpu_has_simd());
      } else {
        kk::codebook_rows(s->rows(experts[k.g], kind == Kind::ternary), preps[k.g]->a, k.n0, k.n1, o, s->n,
                          kk::cpu_has_simd());
      }
    });
  }
};

// CPU time of the calling thread, ms: with K3_NUM_THREADS=1 the kernels run on it alone, so this is their cost
// even while other processes share the cores (wall time then also counts the time slices they take).
double thread_ms() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}
bool g_cpu_time = false;

double median_ms(Problem& p, Kind kind, bool q8, int reps) {
  std::vector<double> t;
  p.run(kind, q8);  // warm-up
  for (int i = 0; i < reps; ++i) {
    const double c0 = thread_ms();
    auto t0 = Clock::now();
    p.run(kind, q8);
    t.push_back(g_cpu_time ? thread_ms() - c0 : std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The read bandwidth by the method of `mlx-k3 bench --bandwidth` (a 1 GiB array of u64 summed in eight lanes,
// split over the pool's threads, best of 5), for the roofline of the same run.
double read_bandwidth_gbs() {
  const size_t n = (size_t(1) << 30) / 8;
  std::vector<uint64_t> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = i;
  const size_t tasks = kk::num_threads();
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    std::vector<uint64_t> sums(tasks);
    auto t0 = Clock::now();
    kk::parallel_for(tasks, [&](size_t t) {
      const size_t b = n * t / tasks, e = n * (t + 1) / tasks;
      uint64_t acc[8] = {};
      for (size_t i = b; i + 8 <= e; i += 8) {
        for (int j = 0; j < 8; ++j) acc[j] += data[i + j];
      }
      for (int j = 0; j < 8; ++j) sums[t] += acc[j];
    });
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    volatile uint64_t sink = sums[0];
    (void)sink;
    best = std::max(best, n * 8 / s / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 3, reps = argc > 2 ? std::atoi(argv[2]) : 20;
  g_cpu_time = argc > 3 && std::string(argv[3]) == "cpu";
  if (g_cpu_time && kk::num_threads() != 1) {
    std::printf("cpu: thread CPU time needs K3_NUM_THREADS=1\n");
    return 2;
  }
  std::printf("threads %d, AVX-512 %s, rounds %d x median of %d calls, %s\n", kk::num_threads(),
              kk::cpu_has_avx512() ? "on" : "off", rounds, reps, g_cpu_time ? "thread CPU time" : "wall time");
  Stack gemv(1, 4096, 14336), dec(64, 3072, 3584), pre(128, 512, 1024);
  std::vector<int> dex, drows, pex, prows;
  for (int i = 0; i < 16; ++i) {
    dex.push_back(i * 4 + 1);
    drows.push_back(1);
  }
  for (int i = 0; i < 128; ++i) {
    pex.push_back(i);
    prows.push_back(32);
  }
  struct Case {
    const char* name;
    Problem p;
    size_t per_call_div;  // the share of the stack one call reads (decode: 16 of 64 experts)
  };
  std::vector<Case> cases;
  cases.push_back({"gemv 4096x14336", Problem(&gemv, {0}, {1}), 1});
  cases.push_back({"experts_decode 16 of 64, 3584->3072", Problem(&dec, dex, drows), 4});
  cases.push_back({"experts_prefill512 128 x 32 rows, 1024->512", Problem(&pre, pex, prows), 1});
  struct Variant {
    const char* name;
    Kind kind;
    bool q8;
    int avx512;  // -1 leave, 0 off
  };
  const Variant variants[] = {
      {"compact f32", Kind::compact, false, -1},   {"ternary f32", Kind::ternary, false, -1},
      {"ternary f32 avx2", Kind::ternary, false, 0}, {"compact q8", Kind::compact, true, -1},
      {"ternary q8", Kind::ternary, true, -1},     {"affine2 q8", Kind::affine2, true, -1},
      // The q8 row kernels alone (AVX-512 off: no int8 GEMM, which takes >= kGemmMinRows rows on VNNI CPUs; the
      // q8 row kernels are AVX2 either way).
      {"compact q8 rows", Kind::compact, true, 0}, {"ternary q8 rows", Kind::ternary, true, 0},
  };
  std::vector<std::vector<std::vector<double>>> ms(cases.size(), std::vector<std::vector<double>>(std::size(variants)));
  for (int r = 0; r < rounds; ++r) {
    for (size_t c = 0; c < cases.size(); ++c) {
      for (size_t v = 0; v < std::size(variants); ++v) {
        if (argc > 4 && std::string(variants[v].name).find(argv[4]) == std::string::npos) continue;
        kk::set_avx512(variants[v].avx512);
        ms[c][v].push_back(median_ms(cases[c].p, variants[v].kind, variants[v].q8, reps));
        kk::set_avx512(-1);
      }
    }
  }
  for (size_t c = 0; c < cases.size(); ++c) {
    const Stack* s = cases[c].p.s;
    std::printf("\n%s\n", cases[c].name);
    for (size_t v = 0; v < std::size(variants); ++v) {
      auto& t = ms[c][v];
      if (t.empty()) continue;
      std::sort(t.begin(), t.end());
      const size_t bytes = (variants[v].kind == Kind::compact   ? s->compact_bytes()
                            : variants[v].kind == Kind::ternary ? s->ternary_bytes()
                                                                : s->affine_bytes()) /
                           cases[c].per_call_div;
      std::printf("  %-18s %8.3f - %8.3f ms  (%.1f MB read, %.1f GB/s at the best)\n", variants[v].name, t.front(),
                  t.back(), bytes / 1e6, bytes / 1e6 / t.front());
    }
  }
  if (!g_cpu_time) std::printf("\nread bandwidth (1 GiB sum, best of 5): %.1f GB/s\n", read_bandwidth_gbs());
  return 0;
}
