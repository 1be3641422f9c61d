// Arrays: errors, dtypes, creation, read-back, evaluation; devices, streams and memory.
#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <unordered_set>

#include "mlx/primitives.h"

#include "k3_internal.hpp"

namespace mx = mlx::core;
using k3::arr;
using k3::put;

namespace {
thread_local std::string last_error;
}

extern "C" const char* k3_last_error(void) {
  return last_error.c_str();
}

extern "C" void k3_set_error(const char* message) {
  last_error = message ? message : "";
}

extern "C" const char* k3_mlx_version(void) {
  return mx::version();
}

namespace k3 {

mx::Dtype dtype(k3_dtype d) {
  switch (d) {
    case K3_BOOL: return mx::bool_;
    case K3_UINT8: return mx::uint8;
    case K3_UINT16: return mx::uint16;
    case K3_UINT32: return mx::uint32;
    case K3_UINT64: return mx::uint64;
    case K3_INT8: return mx::int8;
    case K3_INT16: return mx::int16;
    case K3_INT32: return mx::int32;
    case K3_INT64: return mx::int64;
    case K3_FLOAT16: return mx::float16;
    case K3_FLOAT32: return mx::float32;
    case K3_FLOAT64: return mx::float64;
    case K3_BFLOAT16: return mx::bfloat16;
    case K3_COMPLEX64: return mx::complex64;
  }
  throw std::invalid_argument("[k3] unknown dtype code " + std::to_string(static_cast<int>(d)));
}

k3_dtype dtype_code(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return K3_BOOL;
    case mx::Dtype::Val::uint8: return K3_UINT8;
    case mx::Dtype::Val::uint16: return K3_UINT16;
    case mx::Dtype::Val::uint32: return K3_UINT32;
    case mx::Dtype::Val::uint64: return K3_UINT64;
    case mx::Dtype::Val::int8: return K3_INT8;
    case mx::Dtype::Val::int16: return K3_INT16;
    case mx::Dtype::Val::int32: return K3_INT32;
    case mx::Dtype::Val::int64: return K3_INT64;
    case mx::Dtype::Val::float16: return K3_FLOAT16;
    case mx::Dtype::Val::float32: return K3_FLOAT32;
    case mx::Dtype::Val::float64: return K3_FLOAT64;
    case mx::Dtype::Val::bfloat16: return K3_BFLOAT16;
    case mx::Dtype::Val::complex64: return K3_COMPLEX64;
  }
  throw std::invalid_argument("[k3] MLX dtype without a k3 code");
}

}  // namespace k3

namespace {
template <typename T>
mx::array copy_in(const void* data, mx::Shape shape, mx::Dtype dt) {
  return mx::array(static_cast<const T*>(data), std::move(shape), dt);
}
}  // namespace

extern "C" int k3_array_free(k3_array a) {
  try {
    delete static_cast<mx::array*>(a.ctx);
  } catch (...) {
    // A destructor that throws has nothing to report to; never unwind into Rust.
  }
  return 0;
}

extern "C" int k3_array_clone(k3_array* res, const k3_array a) {
  K3_TRY(put(res, arr(a)))
}

extern "C" int k3_array_from_data(k3_array* res, const void* data, const int32_t* shape, size_t ndim,
                                  k3_dtype dtype) {
  K3_TRY({
    auto sh = k3::shape(shape, ndim);
    auto dt = k3::dtype(dtype);
    switch (dtype) {
      case K3_BOOL: put(res, copy_in<bool>(data, sh, dt)); break;
      case K3_UINT8: put(res, copy_in<uint8_t>(data, sh, dt)); break;
      case K3_UINT16: put(res, copy_in<uint16_t>(data, sh, dt)); break;
      case K3_UINT32: put(res, copy_in<uint32_t>(data, sh, dt)); break;
      case K3_UINT64: put(res, copy_in<uint64_t>(data, sh, dt)); break;
      case K3_INT8: put(res, copy_in<int8_t>(data, sh, dt)); break;
      case K3_INT16: put(res, copy_in<int16_t>(data, sh, dt)); break;
      case K3_INT32: put(res, copy_in<int32_t>(data, sh, dt)); break;
      case K3_INT64: put(res, copy_in<int64_t>(data, sh, dt)); break;
      case K3_FLOAT16: put(res, copy_in<mx::float16_t>(data, sh, dt)); break;
      case K3_FLOAT32: put(res, copy_in<float>(data, sh, dt)); break;
      case K3_FLOAT64: put(res, copy_in<double>(data, sh, dt)); break;
      case K3_BFLOAT16: put(res, copy_in<mx::bfloat16_t>(data, sh, dt)); break;
      case K3_COMPLEX64: put(res, copy_in<mx::complex64_t>(data, sh, dt)); break;
    }
  })
}

extern "C" int k3_array_from_external(k3_array* res, void* data, const int32_t* shape, size_t ndim,
                                      k3_dtype dtype, void (*release)(void* ctx), void* ctx) {
  K3_TRY({
    auto deleter = [release, ctx](void*) {
      if (release) release(ctx);
    };
    put(res, mx::array(data, k3::shape(shape, ndim), k3::dtype(dtype), deleter));
  })
}

extern "C" int k3_array_scalar(k3_array* res, double value, k3_dtype dtype) {
  K3_TRY(put(res, mx::array(value, k3::dtype(dtype))))
}

extern "C" int k3_array_scalar_i64(k3_array* res, int64_t value, k3_dtype dtype) {
  K3_TRY(put(res, mx::array(value, k3::dtype(dtype))))
}

extern "C" int k3_array_ndim(size_t* res, const k3_array a) {
  K3_TRY(*res = arr(a).ndim())
}

extern "C" int k3_array_shape(const int32_t** res, const k3_array a) {
  K3_TRY(*res = arr(a).shape().data())
}

extern "C" int k3_array_size(size_t* res, const k3_array a) {
  K3_TRY(*res = arr(a).size())
}

extern "C" int k3_array_nbytes(size_t* res, const k3_array a) {
  K3_TRY(*res = arr(a).nbytes())
}

extern "C" int k3_array_dtype(k3_dtype* res, const k3_array a) {
  K3_TRY(*res = k3::dtype_code(arr(a).dtype()))
}

extern "C" int k3_array_id(uintptr_t* res, const k3_array a) {
  K3_TRY(*res = arr(a).id())
}

extern "C" int k3_array_is_available(bool* res, const k3_array a) {
  K3_TRY(*res = arr(a).is_available())
}

extern "C" int k3_array_data(const void** res, const k3_array a) {
  K3_TRY({
    auto& x = arr(a);
    if (!x.is_available()) {
      throw std::runtime_error("[array_data] the array is not evaluated; call eval first");
    }
    if (!x.flags().row_contiguous) {
      throw std::runtime_error("[array_data] the array is not row-contiguous; make it contiguous first");
    }
    *res = x.data<void>();
  })
}

extern "C" int k3_array_to_string(char** res, const k3_array a) {
  K3_TRY({
    std::ostringstream os;
    os << arr(a);
    auto s = os.str();
    char* out = static_cast<char*>(std::malloc(s.size() + 1));
    if (!out) throw std::bad_alloc();
    std::memcpy(out, s.c_str(), s.size() + 1);
    *res = out;
  })
}

extern "C" void k3_string_free(char* s) {
  std::free(s);
}

extern "C" int k3_eval(const k3_array* arrays, size_t n) {
  K3_TRY(mx::eval(k3::arrays(arrays, n)))
}

extern "C" int k3_async_eval(const k3_array* arrays, size_t n) {
  K3_TRY(mx::async_eval(k3::arrays(arrays, n)))
}

extern "C" int k3_graph_nodes(size_t* res, const k3_array* arrays, size_t n, const char* primitive) {
  K3_TRY({
    std::unordered_set<std::uintptr_t> seen;
    std::vector<mx::array> stack = k3::arrays(arrays, n);
    size_t count = 0;
    while (!stack.empty()) {
      mx::array a = stack.back();
      stack.pop_back();
      if (!seen.insert(a.id()).second) continue;
      if (a.status() != mx::array::Status::unscheduled || !a.has_primitive()) continue;
      if (!primitive || std::string(a.primitive().name()) == primitive) ++count;
      for (auto& in : a.inputs()) stack.push_back(in);
    }
    *res = count;
  })
}

extern "C" int k3_graph_census(char** res, const k3_array* arrays, size_t n) {
  K3_TRY({
    // Per primitive name: nodes (a multi-output primitive once) and, per consumer name, the edges into it.
    struct Entry {
      size_t nodes = 0;
      std::map<std::string, size_t> consumers;
    };
    std::map<std::string, Entry> by_name;
    std::unordered_set<std::uintptr_t> seen;
    std::unordered_set<const void*> prims;
    std::vector<mx::array> stack = k3::arrays(arrays, n);
    auto pending = [](const mx::array& a) { return a.status() == mx::array::Status::unscheduled && a.has_primitive(); };
    while (!stack.empty()) {
      mx::array a = stack.back();
      stack.pop_back();
      if (!seen.insert(a.id()).second || !pending(a)) continue;
      const std::string name = a.primitive().name();
      if (prims.insert(&a.primitive()).second) {
        ++by_name[name].nodes;
        for (auto& in : a.inputs()) {
          if (pending(in)) ++by_name[in.primitive().name()].consumers[name];
        }
      }
      for (auto& in : a.inputs()) stack.push_back(in);
    }
    std::vector<std::pair<std::string, const Entry*>> rows;
    for (auto& [k, v] : by_name) rows.emplace_back(k, &v);
    std::stable_sort(rows.begin(), rows.end(), [](auto& x, auto& y) { return x.second->nodes > y.second->nodes; });
    std::ostringstream os;
    for (auto& [name, e] : rows) {
      os << e->nodes << '\t' << name << '\t';
      bool first = true;
      for (auto& [c, k] : e->consumers) {
        os << (first ? "" : ", ") << c << " x" << k;
        first = false;
      }
      os << '\n';
    }
    auto s = os.str();
    char* out = static_cast<char*>(std::malloc(s.size() + 1));
    if (!out) throw std::bad_alloc();
    std::memcpy(out, s.c_str(), s.size() + 1);
    *res = out;
  })
}

// ---------------------------------------------------------------- devices, streams, memory

namespace {
mx::Device::DeviceType device_type(k3_device_type t) {
  return t == K3_GPU ? mx::Device::gpu : mx::Device::cpu;
}

k3_stream stream_code(const mx::Stream& s) {
  return k3_stream{s.index, s.device.type == mx::Device::gpu ? K3_GPU : K3_CPU, s.device.index};
}
}  // namespace

extern "C" int k3_device_is_available(bool* res, k3_device_type type) {
  K3_TRY(*res = mx::is_available(mx::Device(device_type(type))))
}

extern "C" int k3_device_count(int* res, k3_device_type type) {
  K3_TRY(*res = mx::is_available(mx::Device(device_type(type))) ? mx::device_count(device_type(type)) : 0)
}

extern "C" int k3_default_device(k3_device_type* res, int* index) {
  K3_TRY({
    auto& d = mx::default_device();
    *res = d.type == mx::Device::gpu ? K3_GPU : K3_CPU;
    *index = d.index;
  })
}

extern "C" int k3_set_default_device(k3_device_type type, int index) {
  K3_TRY(mx::set_default_device(mx::Device(device_type(type), index)))
}

extern "C" int k3_default_stream(k3_stream* res, k3_device_type type) {
  K3_TRY(*res = stream_code(mx::default_stream(mx::Device(device_type(type)))))
}

extern "C" int k3_new_stream(k3_stream* res, k3_device_type type) {
  K3_TRY(*res = stream_code(mx::new_stream(mx::Device(device_type(type)))))
}

extern "C" int k3_set_default_stream(const k3_stream s) {
  K3_TRY(mx::set_default_stream(k3::to_stream(s)))
}

extern "C" int k3_synchronize(const k3_stream s) {
  K3_TRY({
    if (s.device_type < 0) {
      mx::synchronize();
    } else {
      mx::synchronize(k3::to_stream(s));
    }
  })
}

extern "C" int k3_get_active_memory(size_t* res) {
  K3_TRY(*res = mx::get_active_memory())
}

extern "C" int k3_get_peak_memory(size_t* res) {
  K3_TRY(*res = mx::get_peak_memory())
}

extern "C" int k3_reset_peak_memory(void) {
  K3_TRY(mx::reset_peak_memory())
}

extern "C" int k3_get_cache_memory(size_t* res) {
  K3_TRY(*res = mx::get_cache_memory())
}

extern "C" int k3_set_cache_limit(size_t* previous, size_t limit) {
  K3_TRY(*previous = mx::set_cache_limit(limit))
}

extern "C" int k3_set_memory_limit(size_t* previous, size_t limit) {
  K3_TRY(*previous = mx::set_memory_limit(limit))
}

extern "C" int k3_set_wired_limit(size_t* previous, size_t limit) {
  K3_TRY(*previous = mx::set_wired_limit(limit))
}

extern "C" int k3_clear_cache(void) {
  K3_TRY(mx::clear_cache())
}
