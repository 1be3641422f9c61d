//! The ternary codebook format (`mlx_k3::codebook`): matmuls, the plain-ops decoder and the quantizer.

use half::f16;
use mlx_k3::codebook::{self, Codebook};
use mlx_k3::{Array, Dtype};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::bridge::{array_arg, opt_array_arg, to_py};
use crate::error::to_py_err;

/// `x @ W.T` for a ternary-codebook matrix W `[N, K]` (K a multiple of 32) given as `codes` uint8
/// `[N, K/8]`, `qh` uint16 `[N, K/32]`, `scales` float16 `[N, ceil(K/256)]` (see `codebook_dequantize`).
/// `x` is `[..., K]`; computed in float32, returned in x's dtype.
#[pyfunction]
pub(super) fn codebook_qmm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codes: &Bound<'_, PyAny>,
    qh: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    let f = "codebook_qmm";
    let x = array_arg(x, f, "x")?;
    let cb = codebook_args(f, codes, qh, scales)?;
    let y = codebook::codebook_qmm(&x, &cb).map_err(to_py_err)?;
    to_py(py, &y)
}

/// `mx.gather_qmm(..., transpose=True)` over a codebook expert stack (`codes [E, N, K/8]`, `qh [E, N, K/32]`,
/// `scales [E, N, ceil(K/256)]`): x `(*B, M, K)`, `lhs_indices` into the flattened batch of x (None: in order),
/// `rhs_indices` expert ids; the result is `(*broadcast(lhs, rhs), M, N)`. `sorted_indices` is accepted for
/// the signature of `mx.gather_qmm` (the kernel does not need the hint).
#[pyfunction]
#[pyo3(signature = (x, codes, qh, scales, lhs_indices = None, rhs_indices = None, sorted_indices = false))]
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_codebook_qmm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codes: &Bound<'_, PyAny>,
    qh: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    lhs_indices: Option<&Bound<'_, PyAny>>,
    rhs_indices: Option<&Bound<'_, PyAny>>,
    sorted_indices: bool,
) -> PyResult<Py<PyAny>> {
    let _ = sorted_indices;
    let f = "gather_codebook_qmm";
    let x = array_arg(x, f, "x")?;
    let cb = codebook_args(f, codes, qh, scales)?;
    let lhs = opt_array_arg(lhs_indices, f, "lhs_indices")?;
    let rhs = opt_array_arg(rhs_indices, f, "rhs_indices")?;
    let y = codebook::gather_codebook_qmm(&x, &cb, lhs.as_ref(), rhs.as_ref()).map_err(to_py_err)?;
    to_py(py, &y)
}

/// The codebook weights as float32 `[..., N, K]`, decoded with plain MLX ops (the reference the kernels are
/// tested against): `w[32b + 8l + j] = d * (2L + 1) * (grid[idx][j] + delta)` with IQ1_S's grid.
#[pyfunction]
pub(super) fn codebook_dequantize(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    qh: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    let cb = codebook_args("codebook_dequantize", codes, qh, scales)?;
    let w = codebook::dequantize_reference(&cb).map_err(to_py_err)?;
    to_py(py, &w)
}

/// Quantizes `w` (`[..., N, K]`, K a multiple of 32; evaluated and read as float32) into the ternary
/// codebook format with mlx-k3's importance-weighted quantizer. `importance` (`[K]`, optional) is the mean
/// squared activation per input column from calibration data. Returns `(codes, qh, scales)` with w's
/// leading axes. Runs on the host, multi-threaded, without the GIL.
#[pyfunction]
#[pyo3(signature = (w, importance = None))]
pub(super) fn codebook_quantize(
    py: Python<'_>,
    w: &Bound<'_, PyAny>,
    importance: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
    let f = "codebook_quantize";
    let w = array_arg(w, f, "w")?;
    let imp = opt_array_arg(importance, f, "importance")?;
    let shape = w.shape();
    if shape.len() < 2 {
        return Err(PyValueError::new_err(format!("{f}(): w must have at least 2 dimensions, got shape {shape:?}")));
    }
    let k = shape[shape.len() - 1] as usize;
    let rows: usize = shape[..shape.len() - 1].iter().map(|&d| d as usize).product();
    let data = w.to_vec_f32().map_err(to_py_err)?;
    let imp = imp.map(|a| a.to_vec_f32()).transpose().map_err(to_py_err)?;
    // Arrays stay on this thread; only host vectors cross into the quantizer's threads.
    let host =
        py.detach(|| codebook::quantize(&data, rows, k, imp.as_deref()).map(|(h, _report)| h)).map_err(to_py_err)?;
    let lead = &shape[..shape.len() - 1];
    let with_last = |last: usize| -> Vec<i32> {
        let mut s = lead.to_vec();
        s.push(last as i32);
        s
    };
    let codes = Array::from_vec(host.codes, &with_last(k / 8)).map_err(to_py_err)?;
    let qh = Array::from_vec(host.qh, &with_last(k / 32)).map_err(to_py_err)?;
    let scales = Array::from_vec::<f16>(host.scales, &with_last(codebook::super_blocks(k))).map_err(to_py_err)?;
    Ok((to_py(py, &codes)?, to_py(py, &qh)?, to_py(py, &scales)?))
}

pub(super) fn codebook_args(
    f: &str,
    codes: &Bound<'_, PyAny>,
    qh: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
) -> PyResult<Codebook> {
    let cb = Codebook {
        codes: array_arg(codes, f, "codes")?,
        qh: array_arg(qh, f, "qh")?,
        scales: array_arg(scales, f, "scales")?,
    };
    for (name, a, want) in
        [("codes", &cb.codes, Dtype::U8), ("qh", &cb.qh, Dtype::U16), ("scales", &cb.scales, Dtype::F16)]
    {
        if a.dtype() != want {
            return Err(PyValueError::new_err(format!(
                "{f}(): '{name}' must be {}, got {}",
                want.name(),
                a.dtype().name()
            )));
        }
    }
    Ok(cb)
}
