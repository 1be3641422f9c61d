//! `mx.array` <-> [`Array`] without copies: both hold the same `mlx::core::array` (a lazy graph stays lazy).
//! The C++ side is `cpp/bridge.cpp` (nanobind, joined to mlx.core's "mlx" domain at import).

use std::os::raw::c_int;
use std::ptr;

use mlx_k3::Array;
use mlx_k3_sys::k3_array;
use pyo3::exceptions::{PyImportError, PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;

unsafe extern "C" {
    fn k3py_bridge_init(module: *mut ffi::PyObject) -> c_int;
    fn k3py_array_from_py(res: *mut k3_array, obj: *mut ffi::PyObject) -> c_int;
    fn k3py_array_to_py(res: *mut *mut ffi::PyObject, a: k3_array) -> c_int;
}

/// Joins nanobind's "mlx" domain from `module`; `mlx.core` must be imported already.
pub fn init(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.py().import("mlx.core")?;
    // SAFETY: the GIL is held and `module` is a live module object.
    match unsafe { k3py_bridge_init(module.as_ptr()) } {
        0 => Ok(()),
        // cpp/bridge_stub.c: a plain cargo build without the Python headers (build.rs recorded why).
        -2 => Err(PyImportError::new_err(format!(
            "mlx_k3._native was built without its bridge to mx.array ({}); build it with maturin \
             (pip install ./mlx-k3-py)",
            option_env!("MLX_K3_PY_NO_BRIDGE").unwrap_or("no reason recorded")
        ))),
        _ => Err(PyErr::fetch(module.py())),
    }
}

/// The argument `name` of `func` as an [`Array`] sharing its `mx.array`; a `TypeError` naming the argument
/// when it is anything else.
pub fn array_arg(obj: &Bound<'_, PyAny>, func: &str, name: &str) -> PyResult<Array> {
    let mut raw = k3_array { ctx: ptr::null_mut() };
    // SAFETY: the GIL is held; on success `raw` owns a new `mlx::core::array*` allocated with `new`.
    match unsafe { k3py_array_from_py(&mut raw, obj.as_ptr()) } {
        // SAFETY: a fresh handle that only this Array frees.
        0 => Ok(unsafe { Array::from_raw_handle(raw) }),
        1 => Err(PyTypeError::new_err(format!(
            "{func}(): argument '{name}' must be mlx.core.array, not {}",
            type_name(obj)
        ))),
        _ => Err(PyRuntimeError::new_err(format!("{func}(): argument '{name}': {}", last_error()))),
    }
}

/// Like [`array_arg`], with `None` meaning "not given".
pub fn opt_array_arg(obj: Option<&Bound<'_, PyAny>>, func: &str, name: &str) -> PyResult<Option<Array>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => array_arg(o, func, name).map(Some),
    }
}

/// A new `mx.array` sharing `a`.
pub fn to_py(py: Python<'_>, a: &Array) -> PyResult<Py<PyAny>> {
    let mut obj: *mut ffi::PyObject = ptr::null_mut();
    // SAFETY: the GIL is held and `a` is live; on success `obj` is a new reference.
    match unsafe { k3py_array_to_py(&mut obj, a.as_raw()) } {
        // SAFETY: a new, non-null reference that we now own.
        0 => Ok(unsafe { Bound::from_owned_ptr(py, obj) }.unbind()),
        -1 => Err(PyErr::fetch(py)),
        _ => Err(PyRuntimeError::new_err(last_error())),
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "an unknown type".into())
}

fn last_error() -> String {
    // SAFETY: a pointer to the shim's thread-local message, copied at once.
    unsafe {
        let p = mlx_k3_sys::k3_last_error();
        if p.is_null() {
            "unknown error".into()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}
