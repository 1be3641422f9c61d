// Dense (row-contiguous) views of a primitive's inputs, for the fused CPU kernels. The ops do not insert
// `contiguous` nodes (each is one more dispatch per call in a decode step); an input that arrives strided
// (a transposed or broadcast view) is packed here, inside the kernel's task, instead.
#pragma once

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"
#include "mlx/utils.h"

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

// The index operands of a gathered op (MLX's gather_qmm convention: x (*Bx, M, K), lhs indices into x's batch,
// rhs indices into the expert stack, broadcast together to the output's batch shape). They go into the primitive
// as given (cast to uint32, a no-op for the router's indices); an absent one stands for arange over x's batch
// shape and is not built at all. The primitive broadcasts and flattens them itself (broadcast_indices), so a
// decode step has no arange / reshape / broadcast / flatten nodes around each of its ~30 gathers.
struct GatherIndices {
  std::vector<mlx::core::array> arrays;  // lhs then rhs, the given ones only
  bool has_lhs = false, has_rhs = false;
  mlx::core::Shape batch;  // the broadcast batch shape: the output is batch + (M, N)
};

inline GatherIndices gather_index_inputs(const char* op, const mlx::core::array& x, int experts,
                                         const std::optional<mlx::core::array>& lhs,
                                         const std::optional<mlx::core::array>& rhs, mlx::core::Stream s) {
  namespace mx = mlx::core;
  const mx::Shape bx(x.shape().begin(), x.shape().end() - 2);
  size_t nbx = 1;
  for (auto d : bx) nbx *= d;
  if (!rhs && (size_t)experts != nbx) {
    throw std::invalid_argument(std::string("[") + op + "] rhs indices are required when the batch does not match the experts");
  }
  GatherIndices g;
  g.has_lhs = lhs.has_value();
  g.has_rhs = rhs.has_value();
  for (const auto* a : {&lhs, &rhs}) {
    if (!*a) continue;
    if (!mx::issubdtype((*a)->dtype(), mx::integer)) {
      throw std::invalid_argument(std::string("[") + op + "] index arrays must have an integer dtype");
    }
    g.arrays.push_back(mx::astype(**a, mx::uint32, s));
  }
  g.batch = mx::broadcast_shapes(lhs ? lhs->shape() : bx, rhs ? rhs->shape() : bx);
  return g;
}

// Row-major values of a gathered op's index operand broadcast to `batch`: `a` (uint32, any strides, its shape
// right-aligned against batch) or, when null, arange over `implicit` (x's batch shape) reshaped to it.
inline std::vector<uint32_t> broadcast_indices(const mlx::core::array* a, const mlx::core::Shape& implicit,
                                               const mlx::core::Shape& batch) {
  const mlx::core::Shape& shape = a ? a->shape() : implicit;
  std::vector<int64_t> strides(shape.size());
  if (a) {
    for (size_t d = 0; d < shape.size(); ++d) strides[d] = a->strides()[d];
  } else {
    int64_t st = 1;
    for (size_t d = shape.size(); d-- > 0;) {
      strides[d] = st;
      st *= shape[d];
    }
  }
  size_t n = 1;
  for (auto d : batch) n *= d;
  const int nb = (int)batch.size(), lead = nb - (int)shape.size();
  const uint32_t* src = a ? a->data<uint32_t>() : nullptr;
  std::vector<uint32_t> out(n);
  for (size_t p = 0; p < n; ++p) {
    size_t q = p;
    int64_t off = 0;
    for (int d = nb - 1; d >= 0; --d) {
      const size_t i = q % batch[d];
      q /= batch[d];
      if (d >= lead && shape[d - lead] != 1) off += (int64_t)i * strides[d - lead];
    }
    out[p] = src ? src[off] : (uint32_t)off;
  }
  return out;
}

}  // namespace k3::kernels
