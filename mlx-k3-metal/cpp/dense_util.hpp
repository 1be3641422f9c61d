// Dense (row-contiguous) views of a primitive's inputs, for the fused CPU kernels. The ops do not insert
// `contiguous` nodes (each is one more dispatch per call in a decode step); an input that arrives strided
// (a transposed or broadcast view) is packed here, inside the kernel's task, instead.
#pragma once

#include <cstring>
#include <vector>

#include "mlx/array.h"

namespace k3::kernels {

// A pointer to `a`'s elements in row-major order: its own buffer when row-contiguous, else a packed copy
// kept in `scratch`.
inline const void* dense_data(const mlx::core::array& a, std::vector<char>& scratch) {
  if (a.flags().row_contiguous) return a.data<char>();
  const size_t item = a.itemsize(), n = a.size();
  scratch.resize(n * item);
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = static_cast<int>(shape.size());
  const char* src = a.data<char>();
  for (size_t i = 0; i < n; ++i) {
    size_t rem = i;
    int64_t loc = 0;
    for (int d = nd - 1; d >= 0; --d) {
      loc += static_cast<int64_t>(rem % shape[d]) * strides[d];
      rem /= shape[d];
    }
    std::memcpy(scratch.data() + i * item, src + loc * static_cast<int64_t>(item), item);
  }
  return scratch.data();
}

}  // namespace k3::kernels
