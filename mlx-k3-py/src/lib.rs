//! `mlx_k3._native`: the compiled half of the Python package `mlx_k3` (the rest is `python/mlx_k3`).
//!
//! It links the same `libmlx` as Python's `mlx` (one MLX runtime in the process; RUNPATH set by build.rs),
//! and exchanges `mx.array` with mlx-k3's [`mlx_k3::Array`] without copying through a nanobind bridge
//! (`cpp/bridge.cpp`, see [`bridge`]). On top of that, mlx-k3's kernels are plain Python functions on
//! `mx.array` ([`kernels`]) that build lazy MLX graphs like MLX's own ops, so they can be used inside any
//! mlx-lm model; `mlx_k3.models.kimi_k3` uses them for the drop-in model.

use pyo3::exceptions::PyImportError;
use pyo3::prelude::*;

mod bridge;
mod error;
mod kernels;

/// The MLX version this module was compiled against (its headers and `libmlx`).
const MLX_PIN: &str = mlx_k3_sys::MLX_PIN;

/// The MLX version of the `libmlx` loaded in this process.
#[pyfunction]
fn mlx_version() -> String {
    mlx_k3::mlx_version()
}

/// Threads mlx-k3's CPU kernels split their work over.
#[pyfunction]
fn num_threads() -> usize {
    mlx_k3::kernels::num_threads()
}

/// Sets the CPU kernels' thread count (0 restores the default: `K3_NUM_THREADS` or all hardware threads).
#[pyfunction]
fn set_num_threads(n: usize) {
    mlx_k3::kernels::set_num_threads(n)
}

/// What the Rust side sees of `a` after the zero-copy exchange: `(id, evaluated)`, where `id` identifies the
/// underlying MLX array (equal for two handles of one array) and `evaluated` says whether its data exists.
#[pyfunction]
fn rust_view(a: &Bound<'_, PyAny>) -> PyResult<(usize, bool)> {
    let a = bridge::array_arg(a, "rust_view", "a")?;
    Ok((a.id(), a.is_evaluated()))
}

/// Passes `a` through a Rust `Array` and back: the result is a new `mx.array` object over the same MLX
/// array (same graph node, same data, nothing evaluated).
#[pyfunction]
fn roundtrip(py: Python<'_>, a: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let a = bridge::array_arg(a, "roundtrip", "a")?;
    bridge::to_py(py, &a)
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let loaded = mlx_k3::mlx_version();
    if loaded != MLX_PIN {
        return Err(PyImportError::new_err(format!(
            "mlx_k3 was built against MLX {MLX_PIN}, but the libmlx loaded in this process is {loaded}; \
             install mlx=={MLX_PIN} (with its back-end wheel) or rebuild mlx_k3"
        )));
    }
    bridge::init(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MLX_VERSION", MLX_PIN)?;
    m.add("NANOBIND_VERSION", env!("MLX_K3_PY_NANOBIND"))?;
    m.add_function(wrap_pyfunction!(mlx_version, m)?)?;
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(rust_view, m)?)?;
    m.add_function(wrap_pyfunction!(roundtrip, m)?)?;
    kernels::register(m)?;
    Ok(())
}
