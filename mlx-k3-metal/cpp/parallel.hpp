// A small persistent thread pool for CPU kernels. Kernels run on an MLX stream's worker thread; they split
// their rows over this pool (the calling thread takes part), so one dispatch uses every core without
// spawning threads per call.
#pragma once

#include <cstddef>
#include <functional>

namespace k3::kernels {

// Runs fn(task) for task in [0, n_tasks) across the pool and returns when all are done. Exceptions thrown
// by fn are rethrown here (the first one). Calls from several threads are serialized.
void parallel_for(size_t n_tasks, const std::function<void(size_t)>& fn);

// Threads the pool uses (>= 1).
int num_threads();
// 0 = default (K3_NUM_THREADS or the hardware's thread count).
void set_num_threads(int n);

// Splits [0, n) into chunks of at least `min_chunk` items and runs fn(begin, end) on each in parallel.
void parallel_range(size_t n, size_t min_chunk, const std::function<void(size_t, size_t)>& fn);

}  // namespace k3::kernels
