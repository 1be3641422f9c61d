/* C ABI of the bridge between Python's `mx.array` and mlx-k3's `k3_array` handles (bridge.cpp).
 * Call with the GIL held, after `import mlx.core` and k3py_bridge_init. */
#ifndef MLX_K3_PY_BRIDGE_H
#define MLX_K3_PY_BRIDGE_H

#include <Python.h>

#include "k3.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Joins nanobind's "mlx" domain from the module object `module` and checks that mx.array's type is
 * visible. 0 on success; -1 with a Python exception set. */
int k3py_bridge_init(PyObject* module);

/* A new handle sharing the array held by `obj` (no copy, no evaluation). 0 on success; 1 when `obj` is
 * not an mx.array (nothing set); 2 on another failure (message in k3_last_error). */
int k3py_array_from_py(k3_array* res, PyObject* obj);

/* A new mx.array object (new reference) sharing the array of `a`. 0 on success; -1 with a Python
 * exception set; 2 on another failure (message in k3_last_error). */
int k3py_array_to_py(PyObject** res, const k3_array a);

/* 1 when `obj` is an mx.array, else 0. */
int k3py_is_array(PyObject* obj);

#ifdef __cplusplus
}
#endif

#endif
