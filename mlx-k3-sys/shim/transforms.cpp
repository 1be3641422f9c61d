// Function transforms (vjp, value_and_grad) over a function given as a C callback, and the vector-of-arrays
// handle that carries its inputs and outputs.
//
// The callback's failures travel as everything else in this ABI does, as a status and the thread-local message:
// a non-zero status from the callback becomes a C++ exception thrown from inside MLX's transform (so MLX unwinds
// its tracing state as it does for its own errors), and K3_TRY turns it back into a status at this boundary.
// The callback itself must keep its own language's unwinding on its side (the Rust side catches panics).
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "k3_internal.hpp"
#include "mlx/utils.h"

namespace mx = mlx::core;
using k3::arr;

namespace {

std::vector<mx::array>& vec(const k3_arrays v) {
  if (v.ctx == nullptr) {
    throw std::invalid_argument("[k3] a required array vector is missing (null handle)");
  }
  return *static_cast<std::vector<mx::array>*>(v.ctx);
}

// The callback as the std::function MLX's transforms take.
std::function<std::vector<mx::array>(const std::vector<mx::array>&)> wrap(k3_function f, void* payload) {
  return [f, payload](const std::vector<mx::array>& inputs) {
    std::vector<mx::array> outputs;
    // The callback only reads `inputs` (k3_arrays_len / k3_arrays_get), never changes it.
    auto in = const_cast<std::vector<mx::array>*>(&inputs);
    if (f(k3_arrays{&outputs}, k3_arrays{in}, payload) != 0) {
      throw std::runtime_error(k3_last_error());
    }
    if (outputs.empty()) {
      throw std::invalid_argument("[k3] the function under the transform returned no arrays");
    }
    return outputs;
  };
}

}  // namespace

extern "C" int k3_arrays_new(k3_arrays* res) {
  K3_TRY({ res->ctx = new std::vector<mx::array>(); })
}

extern "C" int k3_arrays_free(k3_arrays v) {
  K3_TRY({ delete static_cast<std::vector<mx::array>*>(v.ctx); })
}

extern "C" int k3_arrays_len(size_t* res, const k3_arrays v) {
  K3_TRY({ *res = vec(v).size(); })
}

extern "C" int k3_arrays_get(k3_array* res, const k3_arrays v, size_t i) {
  K3_TRY({
    auto& a = vec(v);
    if (i >= a.size()) {
      throw std::out_of_range("[k3] index " + std::to_string(i) + " of a vector of " + std::to_string(a.size()) +
                              " arrays");
    }
    k3::put(res, a[i]);
  })
}

extern "C" int k3_arrays_push(k3_arrays v, const k3_array a) {
  K3_TRY({ vec(v).push_back(arr(a)); })
}

extern "C" int k3_vjp(k3_arrays outputs, k3_arrays vjps, k3_function f, void* payload, const k3_array* primals,
                      size_t n_primals, const k3_array* cotangents, size_t n_cotangents, const k3_stream s) {
  K3_TRY({
    if (f == nullptr) throw std::invalid_argument("[vjp] no function given");
    // MLX's default stream and device are `s` during the transform (restored on return or unwind).
    std::optional<mx::StreamContext> ctx;
    if (s.device_type >= 0) ctx.emplace(k3::to_stream(s));
    auto& outs = vec(outputs);
    auto& grads = vec(vjps);
    auto [o, g] = mx::vjp(wrap(f, payload), k3::arrays(primals, n_primals), k3::arrays(cotangents, n_cotangents));
    outs = std::move(o);
    grads = std::move(g);
  })
}

extern "C" int k3_value_and_grad(k3_arrays values, k3_arrays grads, k3_function f, void* payload,
                                 const k3_array* primals, size_t n_primals, const int32_t* argnums,
                                 size_t n_argnums, const k3_stream s) {
  K3_TRY({
    if (f == nullptr) throw std::invalid_argument("[value_and_grad] no function given");
    // MLX's default stream and device are `s` during the transform (restored on return or unwind).
    std::optional<mx::StreamContext> ctx;
    if (s.device_type >= 0) ctx.emplace(k3::to_stream(s));
    auto& vals = vec(values);
    auto& gs = vec(grads);
    // MLX would report a non-scalar loss as a cotangent shape mismatch; say what is wrong instead.
    auto inner = wrap(f, payload);
    auto checked = [inner](const std::vector<mx::array>& inputs) {
      auto outputs = inner(inputs);
      if (outputs[0].size() != 1) {
        throw std::invalid_argument("[value_and_grad] the function's first output (the loss) must be a scalar, got shape " +
                                    k3::shape_str(outputs[0].shape()));
      }
      return outputs;
    };
    auto fn = mx::value_and_grad(checked, k3::ints(argnums, n_argnums));
    auto [v, g] = fn(k3::arrays(primals, n_primals));
    vals = std::move(v);
    gs = std::move(g);
  })
}
