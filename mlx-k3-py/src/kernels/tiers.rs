//! Mixed-format ("tiered") expert stacks (`mlx_k3::tiered`): the gathered matmul, its reference and the builder.

use mlx_k3::tiered::{self, Tier, TieredExperts};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::bridge::{array_arg, opt_array_arg, to_py};
use crate::error::to_py_err;

use super::codebook::codebook_args;
use super::quant::{quant_spec, quantized_args};

/// `mx.gather_qmm(..., transpose=True)` semantics over a mixed-format ("tiered") expert stack: expert `e`
/// is stored in tier `tier[e]` (0 codebook, 1 mxfp4, 2 affine) at index `slot[e]` of that tier's stack, and
/// every (token, expert) pair runs on its tier's kernel in one op. The tiers' stacks are given by their
/// checkpoint names (`codes`/`qh`/`scales` for `P.codebook.*`, `mxfp4_*` for `P.mxfp4.*`, `affine_*` for
/// `P.affine.*`); absent tiers are None.
#[pyfunction]
#[pyo3(signature = (
    x, tier, slot, codes = None, qh = None, scales = None, mxfp4_weight = None, mxfp4_scales = None,
    affine_weight = None, affine_scales = None, affine_biases = None, affine_group_size = 64, affine_bits = 4,
    lhs_indices = None, rhs_indices = None, sorted_indices = false
))]
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_tiered_qmm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    tier: &Bound<'_, PyAny>,
    slot: &Bound<'_, PyAny>,
    codes: Option<&Bound<'_, PyAny>>,
    qh: Option<&Bound<'_, PyAny>>,
    scales: Option<&Bound<'_, PyAny>>,
    mxfp4_weight: Option<&Bound<'_, PyAny>>,
    mxfp4_scales: Option<&Bound<'_, PyAny>>,
    affine_weight: Option<&Bound<'_, PyAny>>,
    affine_scales: Option<&Bound<'_, PyAny>>,
    affine_biases: Option<&Bound<'_, PyAny>>,
    affine_group_size: i32,
    affine_bits: i32,
    lhs_indices: Option<&Bound<'_, PyAny>>,
    rhs_indices: Option<&Bound<'_, PyAny>>,
    sorted_indices: bool,
) -> PyResult<Py<PyAny>> {
    let _ = sorted_indices;
    let f = "gather_tiered_qmm";
    let x = array_arg(x, f, "x")?;
    let t = TieredArgs {
        tier,
        slot,
        codes,
        qh,
        scales,
        mxfp4_weight,
        mxfp4_scales,
        affine_weight,
        affine_scales,
        affine_biases,
        affine_group_size,
        affine_bits,
    }
    .experts(f)?;
    let lhs = opt_array_arg(lhs_indices, f, "lhs_indices")?;
    let rhs = opt_array_arg(rhs_indices, f, "rhs_indices")?;
    let y = tiered::gather_tiered_qmm(&x, &t, lhs.as_ref(), rhs.as_ref()).map_err(to_py_err)?;
    to_py(py, &y)
}

/// Every expert of a tiered stack decoded to float32 `[E, N, K]` with plain MLX ops (the reference of
/// `gather_tiered_qmm`). Reads the small `tier`/`slot` tables on the host and checks them.
#[pyfunction]
#[pyo3(signature = (
    tier, slot, codes = None, qh = None, scales = None, mxfp4_weight = None, mxfp4_scales = None,
    affine_weight = None, affine_scales = None, affine_biases = None, affine_group_size = 64, affine_bits = 4
))]
#[allow(clippy::too_many_arguments)]
pub(super) fn tiered_dequantize(
    py: Python<'_>,
    tier: &Bound<'_, PyAny>,
    slot: &Bound<'_, PyAny>,
    codes: Option<&Bound<'_, PyAny>>,
    qh: Option<&Bound<'_, PyAny>>,
    scales: Option<&Bound<'_, PyAny>>,
    mxfp4_weight: Option<&Bound<'_, PyAny>>,
    mxfp4_scales: Option<&Bound<'_, PyAny>>,
    affine_weight: Option<&Bound<'_, PyAny>>,
    affine_scales: Option<&Bound<'_, PyAny>>,
    affine_biases: Option<&Bound<'_, PyAny>>,
    affine_group_size: i32,
    affine_bits: i32,
) -> PyResult<Py<PyAny>> {
    let f = "tiered_dequantize";
    let t = TieredArgs {
        tier,
        slot,
        codes,
        qh,
        scales,
        mxfp4_weight,
        mxfp4_scales,
        affine_weight,
        affine_scales,
        affine_biases,
        affine_group_size,
        affine_bits,
    }
    .experts(f)?;
    t.validate(f).map_err(to_py_err)?;
    let w = tiered::dequantize_tiered(&t).map_err(to_py_err)?;
    to_py(py, &w)
}

/// Quantizes a float expert stack `w` `[E, N, K]` into tiers: expert `e` goes to `tiers[e]` (0 codebook with
/// the importance-weighted quantizer, 1 mxfp4, 2 affine with `affine_group_size`/`affine_bits`).
/// `importance` is `[K]` or `[E, K]` (optional). Returns the stack as a dict keyed by checkpoint names
/// relative to the module path: `tier`, `slot`, `codebook.codes`, `codebook.qh`, `codebook.scales`,
/// `mxfp4.weight`, `mxfp4.scales`, `affine.weight`, `affine.scales`, `affine.biases` (present tiers only).
#[pyfunction]
#[pyo3(signature = (w, tiers, affine_group_size = 64, affine_bits = 4, importance = None))]
pub(super) fn tiered_quantize<'py>(
    py: Python<'py>,
    w: &Bound<'py, PyAny>,
    tiers: Vec<u8>,
    affine_group_size: i32,
    affine_bits: i32,
    importance: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let f = "tiered_quantize";
    let w = array_arg(w, f, "w")?;
    let imp = opt_array_arg(importance, f, "importance")?.map(|a| a.to_vec_f32()).transpose().map_err(to_py_err)?;
    let tiers: Vec<Tier> = tiers
        .iter()
        .map(|&t| {
            Tier::from_id(t).ok_or_else(|| {
                PyValueError::new_err(format!("{f}(): unknown tier id {t} (0 codebook, 1 mxfp4, 2 affine)"))
            })
        })
        .collect::<PyResult<_>>()?;
    let spec = quant_spec(f, Some(affine_group_size), Some(affine_bits), "affine")?;
    let (t, _report) = tiered::build_tiered(&w, &tiers, spec, imp.as_deref()).map_err(to_py_err)?;
    let d = PyDict::new(py);
    d.set_item("tier", to_py(py, &t.tier)?)?;
    d.set_item("slot", to_py(py, &t.slot)?)?;
    if let Some(c) = &t.codebook {
        d.set_item("codebook.codes", to_py(py, &c.codes)?)?;
        d.set_item("codebook.qh", to_py(py, &c.qh)?)?;
        d.set_item("codebook.scales", to_py(py, &c.scales)?)?;
    }
    if let Some(q) = &t.mxfp4 {
        d.set_item("mxfp4.weight", to_py(py, &q.weight)?)?;
        d.set_item("mxfp4.scales", to_py(py, &q.scales)?)?;
    }
    if let Some((q, _)) = &t.affine {
        d.set_item("affine.weight", to_py(py, &q.weight)?)?;
        d.set_item("affine.scales", to_py(py, &q.scales)?)?;
        if let Some(b) = &q.biases {
            d.set_item("affine.biases", to_py(py, b)?)?;
        }
    }
    Ok(d)
}

/// The arguments that describe a tiered stack, as the Python functions take them.
struct TieredArgs<'a, 'py> {
    tier: &'a Bound<'py, PyAny>,
    slot: &'a Bound<'py, PyAny>,
    codes: Option<&'a Bound<'py, PyAny>>,
    qh: Option<&'a Bound<'py, PyAny>>,
    scales: Option<&'a Bound<'py, PyAny>>,
    mxfp4_weight: Option<&'a Bound<'py, PyAny>>,
    mxfp4_scales: Option<&'a Bound<'py, PyAny>>,
    affine_weight: Option<&'a Bound<'py, PyAny>>,
    affine_scales: Option<&'a Bound<'py, PyAny>>,
    affine_biases: Option<&'a Bound<'py, PyAny>>,
    affine_group_size: i32,
    affine_bits: i32,
}

impl TieredArgs<'_, '_> {
    fn experts(&self, f: &str) -> PyResult<TieredExperts> {
        let given = |o: Option<&Bound<'_, PyAny>>| o.is_some_and(|o| !o.is_none());
        let codebook = match (given(self.codes), given(self.qh), given(self.scales)) {
            (false, false, false) => None,
            (true, true, true) => Some(codebook_args(f, self.codes.unwrap(), self.qh.unwrap(), self.scales.unwrap())?),
            _ => return Err(PyValueError::new_err(format!("{f}(): give all of codes, qh and scales, or none"))),
        };
        let mxfp4 = match (given(self.mxfp4_weight), given(self.mxfp4_scales)) {
            (false, false) => None,
            (true, true) => Some(quantized_args(f, self.mxfp4_weight.unwrap(), self.mxfp4_scales.unwrap(), None)?),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{f}(): give both mxfp4_weight and mxfp4_scales, or neither"
                )))
            }
        };
        let affine = match (given(self.affine_weight), given(self.affine_scales)) {
            (false, false) => None,
            (true, true) => {
                let spec = quant_spec(f, Some(self.affine_group_size), Some(self.affine_bits), "affine")?;
                let q =
                    quantized_args(f, self.affine_weight.unwrap(), self.affine_scales.unwrap(), self.affine_biases)?;
                Some((q, spec))
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{f}(): give both affine_weight and affine_scales, or neither"
                )))
            }
        };
        Ok(TieredExperts {
            tier: array_arg(self.tier, f, "tier")?,
            slot: array_arg(self.slot, f, "slot")?,
            codebook,
            mxfp4,
            affine,
        })
    }
}
