// Helpers shared by the shim's translation units and by mlx-k3-metal's kernels: handle <-> C++ object
// conversion and the one try/catch wrapper that keeps C++ exceptions on this side of the ABI.
#pragma once

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "k3.h"
#include "mlx/mlx.h"

namespace k3 {
namespace mx = mlx::core;

inline mx::array& arr(const k3_array a) {
  if (a.ctx == nullptr) {
    throw std::invalid_argument("[k3] a required array argument is missing (null handle)");
  }
  return *static_cast<mx::array*>(a.ctx);
}

inline std::optional<mx::array> opt(const k3_array a) {
  if (a.ctx == nullptr) {
    return std::nullopt;
  }
  return *static_cast<mx::array*>(a.ctx);
}

inline void put(k3_array* res, mx::array a) {
  res->ctx = new mx::array(std::move(a));
}

inline void put_many(k3_array* res, size_t cap, size_t* n_out, std::vector<mx::array> arrays) {
  if (arrays.size() > cap) {
    throw std::invalid_argument(
        "[k3] " + std::to_string(arrays.size()) + " outputs do not fit the " + std::to_string(cap) +
        " slots provided");
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    put(res + i, std::move(arrays[i]));
  }
  *n_out = arrays.size();
}

inline std::vector<mx::array> arrays(const k3_array* a, size_t n) {
  std::vector<mx::array> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(arr(a[i]));
  }
  return out;
}

inline mx::Shape shape(const int32_t* s, size_t n) {
  return mx::Shape(s, s + n);
}

inline std::vector<int> ints(const int32_t* s, size_t n) {
  return std::vector<int>(s, s + n);
}

mx::Dtype dtype(k3_dtype d);
k3_dtype dtype_code(mx::Dtype d);

inline mx::StreamOrDevice stream(const k3_stream s) {
  if (s.device_type < 0) {
    return {};
  }
  auto type = s.device_type == K3_GPU ? mx::Device::gpu : mx::Device::cpu;
  return mx::Stream(s.index, mx::Device(type, s.device_index));
}

inline mx::Stream to_stream(const k3_stream s) {
  return mx::to_stream(stream(s));
}

// "(2,3,4)": shapes in error messages.
inline std::string shape_str(const mx::Shape& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r.push_back(',');
    r.append(std::to_string(s[i]));
  }
  r.push_back(')');
  return r;
}

inline std::optional<int> opt_int(int v) {
  return v < 0 ? std::nullopt : std::optional<int>(v);
}

}  // namespace k3

// Runs `body`; any exception becomes the thread-local error text and status 1.
#define K3_TRY(...)                                         \
  try {                                                     \
    __VA_ARGS__;                                                 \
    return 0;                                               \
  } catch (const std::exception& e) {                       \
    k3_set_error(e.what());                                 \
    return 1;                                               \
  } catch (...) {                                           \
    k3_set_error("[k3] unknown C++ exception");             \
    return 1;                                               \
  }
