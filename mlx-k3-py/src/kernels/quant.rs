//! MLX-format quantized matmuls through mlx-k3's CPU kernels (MLX's own op where they do not apply).

use mlx_k3::kernels;
use mlx_k3::quant::{QuantMode, QuantSpec, Quantized};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::bridge::{array_arg, opt_array_arg, to_py};
use crate::error::to_py_err;

/// `mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits, mode)` through mlx-k3's CPU
/// kernels where they apply (float32 activations on a CPU stream: affine 2/4/8-bit with groups of 32/64/128,
/// or mxfp4, on AVX2+FMA), else MLX's own op. Same layouts and defaults as MLX.
#[pyfunction]
#[pyo3(signature = (x, w, scales, biases = None, group_size = None, bits = None, mode = "affine"))]
#[allow(clippy::too_many_arguments)]
pub(super) fn quantized_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    biases: Option<&Bound<'_, PyAny>>,
    group_size: Option<i32>,
    bits: Option<i32>,
    mode: &str,
) -> PyResult<Py<PyAny>> {
    let f = "quantized_matmul";
    let spec = quant_spec(f, group_size, bits, mode)?;
    let x = array_arg(x, f, "x")?;
    let q = quantized_args(f, w, scales, biases)?;
    let y = kernels::fast_quantized_matmul(&x, &q, spec).map_err(to_py_err)?;
    to_py(py, &y)
}

/// `mx.gather_qmm(x, w, scales, biases, lhs_indices, rhs_indices, transpose=True, group_size, bits, mode,
/// sorted_indices)` through mlx-k3's CPU kernels where they apply, else MLX's own op.
#[pyfunction]
#[pyo3(signature = (
    x, w, scales, biases = None, lhs_indices = None, rhs_indices = None,
    group_size = None, bits = None, mode = "affine", sorted_indices = false
))]
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_qmm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    biases: Option<&Bound<'_, PyAny>>,
    lhs_indices: Option<&Bound<'_, PyAny>>,
    rhs_indices: Option<&Bound<'_, PyAny>>,
    group_size: Option<i32>,
    bits: Option<i32>,
    mode: &str,
    sorted_indices: bool,
) -> PyResult<Py<PyAny>> {
    let f = "gather_qmm";
    let spec = quant_spec(f, group_size, bits, mode)?;
    let x = array_arg(x, f, "x")?;
    let q = quantized_args(f, w, scales, biases)?;
    let lhs = opt_array_arg(lhs_indices, f, "lhs_indices")?;
    let rhs = opt_array_arg(rhs_indices, f, "rhs_indices")?;
    let y = kernels::gather_qmm(&x, &q, spec, lhs.as_ref(), rhs.as_ref(), sorted_indices).map_err(to_py_err)?;
    to_py(py, &y)
}

pub(super) fn quantized_args(
    f: &str,
    w: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    biases: Option<&Bound<'_, PyAny>>,
) -> PyResult<Quantized> {
    Ok(Quantized {
        weight: array_arg(w, f, "w")?,
        scales: array_arg(scales, f, "scales")?,
        biases: opt_array_arg(biases, f, "biases")?,
    })
}

pub(super) fn quant_spec(f: &str, group_size: Option<i32>, bits: Option<i32>, mode: &str) -> PyResult<QuantSpec> {
    let mode = QuantMode::from_name(mode).ok_or_else(|| {
        PyValueError::new_err(format!("{f}(): mode must be one of affine, mxfp4, mxfp8, nvfp4; got '{mode}'"))
    })?;
    let d = QuantSpec::default_for(mode);
    let spec = QuantSpec { group_size: group_size.unwrap_or(d.group_size), bits: bits.unwrap_or(d.bits), mode };
    // MLX divides by both before it validates them (0 would crash the process).
    if spec.group_size <= 0 || spec.bits <= 0 {
        return Err(PyValueError::new_err(format!(
            "{f}(): group_size and bits must be positive, got group_size={} bits={}",
            spec.group_size, spec.bits
        )));
    }
    Ok(spec)
}
