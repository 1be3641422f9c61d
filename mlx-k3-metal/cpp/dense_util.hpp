// Dense (row-contiguous) views of a primitive's inputs, for the fused CPU kernels. The ops do not insert
// `contiguous` nodes (each is one more dispatch per call in a decode step); an input that arrives strided
// (a transposed or broadcast view) is packed here, inside the kernel's task, instead.
#pragma once

#include <cstring>
#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"

namespace k3::kernels {

// Element offset (in items) of row-major index `i` of `a`, from its shape and strides.
inline int64_t strided_offset(const mlx::core::array& a, size_t i) {
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  int64_t loc = 0;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    loc += static_cast<int64_t>(i % shape[d]) * strides[d];
    i /= shape[d];
  }
  return loc;
}

// A pointer to `a`'s elements in row-major order: its own buffer when row-contiguous, else a packed copy
// kept in `scratch`.
inline const void* dense_data(const mlx::core::array& a, std::vector<char>& scratch) {
  if (a.flags().row_contiguous) return a.data<char>();
  const size_t item = a.itemsize(), n = a.size();
  scratch.resize(n * item);
  const char* src = a.data<char>();
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(scratch.data() + i * item, src + strided_offset(a, i) * static_cast<int64_t>(item), item);
  }
  return scratch.data();
}

// A weight input as the op's primitive gets it: `a` itself when it is already evaluated and row-contiguous
// (loaded weights, in practice), else a `contiguous` node. A decode step builds hundreds of these ops, so
// skipping a no-op node per weight array keeps the graph (and MLX's per-node cost) small.
inline mlx::core::array contiguous_input(const mlx::core::array& a, mlx::core::Stream s) {
  if (a.status() != mlx::core::array::Status::unscheduled && a.flags().row_contiguous) return a;
  return mlx::core::contiguous(a, false, s);
}

}  // namespace k3::kernels
