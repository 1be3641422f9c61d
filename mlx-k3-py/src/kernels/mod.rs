//! mlx-k3's kernels as Python functions on `mx.array`. Each takes and returns `mx.array` (lazy, on the
//! current default stream, like MLX's own ops) and is one `#[pyfunction]` over the safe Rust API, in the file
//! of its family; adding a kernel is that function, one line in [`register`], one line in
//! `python/mlx_k3/kernels.py` and its signature in the two stubs there.

use mlx_k3::kernels;
use pyo3::prelude::*;

use crate::bridge::{array_arg, to_py};
use crate::error::to_py_err;

mod codebook;
mod quant;
mod tiers;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(situ, m)?)?;
    m.add_function(wrap_pyfunction!(codebook::codebook_qmm, m)?)?;
    m.add_function(wrap_pyfunction!(codebook::gather_codebook_qmm, m)?)?;
    m.add_function(wrap_pyfunction!(codebook::codebook_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(codebook::codebook_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quantized_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant::gather_qmm, m)?)?;
    m.add_function(wrap_pyfunction!(tiers::gather_tiered_qmm, m)?)?;
    m.add_function(wrap_pyfunction!(tiers::tiered_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(tiers::tiered_quantize, m)?)?;
    Ok(())
}

/// SiTU, Kimi K3's expert activation, as one fused primitive:
/// `[beta * tanh(gate / beta) * sigmoid(gate)] * [linear_beta * tanh(up / linear_beta)]` (the second factor
/// is `up` itself when `linear_beta` is None). Computed in float32, returned in the inputs' dtype; `up` and
/// `gate` broadcast. Matches mlx-lm's `kimi_k3._situ(up, gate, beta, linear_beta)`.
#[pyfunction]
#[pyo3(signature = (up, gate, beta = 1.0, linear_beta = None))]
fn situ(
    py: Python<'_>,
    up: &Bound<'_, PyAny>,
    gate: &Bound<'_, PyAny>,
    beta: f32,
    linear_beta: Option<f32>,
) -> PyResult<Py<PyAny>> {
    let up = array_arg(up, "situ", "up")?;
    let gate = array_arg(gate, "situ", "gate")?;
    let y = kernels::situ(&up, &gate, beta, linear_beta).map_err(to_py_err)?;
    to_py(py, &y)
}
