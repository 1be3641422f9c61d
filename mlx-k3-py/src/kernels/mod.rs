//! mlx-k3's kernels as Python functions on `mx.array`. Each takes and returns `mx.array` (lazy, on the
//! current default stream, like MLX's own ops) and is one `#[pyfunction]` over the safe Rust API, in the file
//! of its family; adding a kernel is that function, one line in [`register`], one line in
//! `python/mlx_k3/kernels.py` and its signature in the two stubs there.

use mlx_k3::kernels;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::bridge::{array_arg, opt_array_arg, to_py};
use crate::error::to_py_err;

mod codebook;
mod quant;
mod tiers;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(situ, m)?)?;
    m.add_function(wrap_pyfunction!(moe_router, m)?)?;
    m.add_function(wrap_pyfunction!(attn_res_mix, m)?)?;
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

/// The fused MoE router, mlx-lm's `kimi_k3._group_expert_select` as one op: sigmoid scores of `logits`
/// `[..., E]`, `bias` `[E]` added for selection only, grouped top-k (with `n_group > 1`, groups ranked by the
/// sum of their top-2 scores, all but the best `topk_group` dropped), top `top_k`, weights = the sigmoid
/// scores of the chosen experts, renormalized when `renormalize` (and `top_k > 1`), times
/// `routed_scaling_factor`. Returns `(indices uint32 [..., top_k], weights [..., top_k])` in the logits'
/// dtype, plus `protected bool [..., top_k]` when `protected_mask` `[E]` (nonzero = protected tier) is given.
/// On a CPU stream the result is bit-identical to mlx-lm's ops, index order included.
#[pyfunction]
#[pyo3(signature = (
    logits, bias = None, *, top_k, n_group = 1, topk_group = 1, routed_scaling_factor = 1.0,
    renormalize = true, protected_mask = None
))]
#[allow(clippy::too_many_arguments)]
fn moe_router<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    top_k: i32,
    n_group: i32,
    topk_group: i32,
    routed_scaling_factor: f32,
    renormalize: bool,
    protected_mask: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyTuple>> {
    let f = "moe_router";
    let logits = array_arg(logits, f, "logits")?;
    let bias = opt_array_arg(bias, f, "bias")?;
    let mask = opt_array_arg(protected_mask, f, "protected_mask")?;
    let params = kernels::RouterParams { top_k, n_group, topk_group, routed_scaling_factor, renormalize };
    let r = kernels::moe_router(&logits, bias.as_ref(), mask.as_ref(), params).map_err(to_py_err)?;
    let mut out = vec![to_py(py, &r.indices)?, to_py(py, &r.weights)?];
    if let Some(p) = &r.protected {
        out.push(to_py(py, p)?);
    }
    PyTuple::new(py, out)
}

/// The attention-residual mix, mlx-lm's `kimi_k3._attn_res_combine` as one op: a softmax (f32) over the block
/// snapshots `raw [K, ..., D]` (logits `(raw @ w_eff) * inv_rms`, `inv_rms [K, ...]` f32) and the partial sum
/// `partial [..., D]` (logit `(partial @ w_eff) * rsqrt(mean(partial^2) + eps)`), then the weighted sum of
/// snapshots and partial sum, in `partial`'s dtype. CPU and CUDA primitives (the CUDA one has not run yet).
#[pyfunction]
#[pyo3(signature = (raw, inv_rms, partial, w_eff, eps = 1e-6))]
fn attn_res_mix(
    py: Python<'_>,
    raw: &Bound<'_, PyAny>,
    inv_rms: &Bound<'_, PyAny>,
    partial: &Bound<'_, PyAny>,
    w_eff: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<Py<PyAny>> {
    let f = "attn_res_mix";
    let raw = array_arg(raw, f, "raw")?;
    let inv_rms = array_arg(inv_rms, f, "inv_rms")?;
    let partial = array_arg(partial, f, "partial")?;
    let w_eff = array_arg(w_eff, f, "w_eff")?;
    let y = kernels::attn_res_mix(&raw, &inv_rms, &partial, &w_eff, eps).map_err(to_py_err)?;
    to_py(py, &y)
}
