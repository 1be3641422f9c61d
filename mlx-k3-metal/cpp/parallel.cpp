#include "parallel.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "k3_kernels.h"

namespace k3::kernels {
namespace {

// Computed once: hardware_concurrency() opens and parses /sys/devices/system/cpu/online on every call (glibc),
// and pool() runs on every kernel dispatch (measured: half a million opens in a 24-token decode benchmark).
int default_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("K3_NUM_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) return v;
    }
    return (int)std::max(1u, std::thread::hardware_concurrency());
  }();
  return n;
}

// How long an idle thread polls for the next job (a worker) or for the last task (the caller) before it
// sleeps on a condition variable. A decode step dispatches a few hundred kernels with short serial ops
// between them; a worker that went to sleep after each one cost a futex wake and a reschedule per dispatch
// (measured: the worker ran 1.5x fewer rows than the calling thread and sat idle ~45% of a decode step).
// K3_SPIN_US overrides it; 0 sleeps at once (the behaviour before this setting existed).
std::chrono::microseconds spin_time() {
  static const std::chrono::microseconds t = [] {
    if (const char* env = std::getenv("K3_SPIN_US")) {
      char* end = nullptr;
      long v = std::strtol(env, &end, 10);
      if (end != env && *end == '\0' && v >= 0) return std::chrono::microseconds(std::min(v, 100000L));
    }
    return std::chrono::microseconds(200);
  }();
  return t;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls pred() until it holds or spin_time() has passed; returns whether it holds.
template <class Pred>
bool spin_until(Pred pred) {
  if (pred()) return true;  // the common case needs no clock read
  const auto limit = spin_time();
  if (limit.count() == 0) return false;
  const auto t0 = std::chrono::steady_clock::now();
  for (unsigned i = 1;; ++i) {
    if (pred()) return true;
    cpu_relax();
    if (i % 64 == 0) {
      if (std::chrono::steady_clock::now() - t0 > limit) return pred();
      // Every few microseconds, give the core to a runnable thread (on a machine with as many threads as
      // cores, the thread that builds the next graph waits for one while this one polls).
      std::this_thread::yield();
    }
  }
}

// K3_POOL_STATS=1 (any other value: off): counts of how the pool's jobs went, printed to stderr at exit, for
// profiling a decode step (how late the worker joins a job, how long the caller waits for a job's last task).
// Off by default; then nothing below runs but the flag's test.
struct PoolStats {
  const bool on = [] {
    const char* env = std::getenv("K3_POOL_STATS");
    return env && std::string(env) == "1";
  }();
  std::atomic<long> inline_jobs{0}, inline_ns{0}, jobs{0}, jobs_ns{0}, tail_ns{0};
  std::atomic<long> joins{0}, join_ns{0}, late_joins{0}, late_ns{0}, missed{0}, worker_tasks{0}, caller_tasks{0};

  static long now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void print() const {
    std::fprintf(stderr,
                 "k3 pool: %ld jobs run inline (%.1f ms); %ld pool jobs (%.1f ms), the caller waited %.1f ms for their last "
                 "tasks; the worker joined %ld of them %.1f us late on average, %ld over 20 us (%.1f ms of the %.1f ms), "
                 "missed %ld; tasks run by the caller %ld, by workers %ld\n",
                 inline_jobs.load(), inline_ns.load() / 1e6, jobs.load(), jobs_ns.load() / 1e6, tail_ns.load() / 1e6,
                 joins.load(), joins.load() ? join_ns.load() / 1e3 / joins.load() : 0.0, late_joins.load(),
                 late_ns.load() / 1e6, join_ns.load() / 1e6, missed.load(), caller_tasks.load(), worker_tasks.load());
  }
};

// Never destroyed (a worker may still count while the process exits); printed by an exit handler.
PoolStats& pool_stats() {
  static PoolStats* s = [] {
    auto* p = new PoolStats;
    if (p->on) std::atexit([] { pool_stats().print(); });
    return p;
  }();
  return *s;
}

// One parallel_for call. The caller waits until every task has *run* (not until every worker has woken):
// on a busy machine a descheduled worker must not add a scheduler tick to each kernel call. A worker that
// wakes late finds no task left and goes back to sleep; the shared_ptr keeps the job alive for it.
struct Job {
  long posted_ns = 0;  // with K3_POOL_STATS
  const std::function<void(size_t)>* fn;
  size_t n_tasks;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::mutex mu;
  std::condition_variable finished;
  std::exception_ptr error;
};

class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(size_t n_tasks, const std::function<void(size_t)>& fn) {
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n_tasks = n_tasks;
    auto& st = pool_stats();
    if (st.on) job->posted_ns = PoolStats::now_ns();
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = job;
      generation_.fetch_add(1);
    }
    cv_.notify_all();  // no system call unless a worker sleeps
    const long mine = work(*job);
    const long own_done_ns = st.on ? PoolStats::now_ns() : 0;
    auto all_done = [&] { return job->done.load() == n_tasks; };
    if (!spin_until(all_done)) {
      std::unique_lock<std::mutex> lk(job->mu);
      job->finished.wait(lk, all_done);
    }
    if (st.on) {
      const long end = PoolStats::now_ns();
      st.jobs++;
      st.jobs_ns += end - job->posted_ns;
      st.tail_ns += end - own_done_ns;
      st.caller_tasks += mine;
      if (mine == (long)n_tasks) st.missed++;
    }
    if (job->error) std::rethrow_exception(job->error);  // written before its task counted as done
  }

 private:
  // Runs tasks of the job until none is left; returns how many this thread ran.
  static long work(Job& job) {
    long ran = 0;
    for (size_t t = job.next.fetch_add(1); t < job.n_tasks; t = job.next.fetch_add(1), ++ran) {
      try {
        (*job.fn)(t);
      } catch (...) {
        std::lock_guard<std::mutex> lk(job.mu);
        if (!job.error) job.error = std::current_exception();
      }
      if (job.done.fetch_add(1) + 1 == job.n_tasks) {
        std::lock_guard<std::mutex> lk(job.mu);
        job.finished.notify_all();
      }
    }
    return ran;
  }
  void loop() {
    size_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      auto woken = [&] { return stop_.load() || generation_.load() != seen; };
      spin_until(woken);
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, woken);
        if (stop_.load()) return;
        seen = generation_.load();
        job = job_;
      }
      if (!job) continue;
      auto& st = pool_stats();
      if (st.on && job->next.load() < job->n_tasks) {
        const long late = PoolStats::now_ns() - job->posted_ns;
        st.joins++;
        st.join_ns += late;
        if (late > 20000) {
          st.late_joins++;
          st.late_ns += late;
        }
      }
      const long ran = work(*job);
      if (st.on) st.worker_tasks += ran;
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> job_;                // written under mu_
  std::atomic<size_t> generation_{0};       // changed under mu_, polled without it
  std::atomic<bool> stop_{false};
};

std::mutex pool_mu;
std::mutex run_mu;
std::shared_ptr<Pool> pool_instance;
int wanted_threads = 0;

std::shared_ptr<Pool> pool() {
  std::lock_guard<std::mutex> lk(pool_mu);
  int n = wanted_threads > 0 ? wanted_threads : default_threads();
  if (!pool_instance || pool_instance->size() != n) pool_instance = std::make_shared<Pool>(n);
  return pool_instance;
}

}  // namespace

void parallel_for(size_t n_tasks, const std::function<void(size_t)>& fn) {
  if (n_tasks == 0) return;
  auto p = pool();
  if (n_tasks == 1 || p->size() == 1) {
    auto& st = pool_stats();
    const long t0 = st.on ? PoolStats::now_ns() : 0;
    for (size_t t = 0; t < n_tasks; ++t) fn(t);
    if (st.on) {
      st.inline_jobs++;
      st.inline_ns += PoolStats::now_ns() - t0;
    }
    return;
  }
  std::lock_guard<std::mutex> serial(run_mu);  // one job at a time across MLX streams
  p->run(n_tasks, fn);
}

int num_threads() {
  return pool()->size();
}

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lk(pool_mu);
  wanted_threads = std::max(0, n);
}

void parallel_range(size_t n, size_t min_chunk, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  size_t threads = static_cast<size_t>(num_threads());
  size_t chunks = std::max<size_t>(1, std::min(threads * 4, n / std::max<size_t>(1, min_chunk)));
  size_t step = (n + chunks - 1) / chunks;
  parallel_for(chunks, [&](size_t c) {
    size_t b = c * step, e = std::min(n, b + step);
    if (b < e) fn(b, e);
  });
}

}  // namespace k3::kernels

extern "C" int k3_kernels_set_num_threads(int n) {
  k3::kernels::set_num_threads(n);
  return 0;
}

extern "C" int k3_kernels_num_threads(void) {
  try {
    return k3::kernels::num_threads();
  } catch (...) {
    return 1;
  }
}
