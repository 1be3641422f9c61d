// The bridge between Python's `mx.array` and mlx-k3's array handles (`k3_array`, an owned
// `mlx::core::array*`), with no copy of data and no evaluation: both sides hold the same
// `mlx::core::array`, whose copy shares the node of the (possibly lazy) graph.
//
// mlx.core binds `mlx::core::array` with nanobind in the domain "mlx". Compiled with the same nanobind
// version and -DNB_DOMAIN=mlx, this file joins those internals (nanobind::register_module on the pyo3
// module), after which nanobind's casters see mlx.core's types. Every function is called with the GIL held.
#include <string>

#include <nanobind/nanobind.h>

#include "k3_bridge.h"
#include "k3_internal.hpp"

namespace nb = nanobind;
namespace mx = mlx::core;

extern "C" int k3py_bridge_init(PyObject* module) {
  if (!nb::register_module(nb::handle(module))) {
    return -1;  // a Python error is set
  }
  try {
    if (!nb::type<mx::array>().is_valid()) {
      PyErr_SetString(
          PyExc_ImportError,
          "mlx_k3: mlx.core's array type is not visible to the bridge: the nanobind internals of this build "
          "(nanobind " NB_TOSTRING(NB_VERSION_MAJOR) "." NB_TOSTRING(NB_VERSION_MINOR) "." NB_TOSTRING(NB_VERSION_PATCH) ", domain 'mlx') do not match those of the installed mlx wheel. "
          "Import mlx.core first, and use the mlx version mlx_k3 was built for.");
      return -1;
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
    return -1;
  }
  return 0;
}

extern "C" int k3py_array_from_py(k3_array* res, PyObject* obj) {
  try {
    mx::array* a = nullptr;
    // No implicit conversion (lists, scalars, numpy): only an mx.array is accepted.
    if (!nb::try_cast<mx::array*>(nb::handle(obj), a, /*convert=*/false) || a == nullptr) {
      return 1;
    }
    k3::put(res, *a);
    return 0;
  } catch (const std::exception& e) {
    k3_set_error(e.what());
    return 2;
  }
}

extern "C" int k3py_array_to_py(PyObject** res, const k3_array a) {
  try {
    nb::object o = nb::cast(k3::arr(a), nb::rv_policy::copy);
    *res = o.release().ptr();
    return 0;
  } catch (nb::python_error& e) {
    e.restore();
    return -1;
  } catch (const std::exception& e) {
    k3_set_error(e.what());
    return 2;
  }
}

extern "C" int k3py_is_array(PyObject* obj) {
  try {
    return nb::isinstance<mx::array>(nb::handle(obj)) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}
