//! The routed experts' gate and up projections with SiTU applied where the kernel stores
//! (docs/formats.md#latent-moe, #situ): `SiTU(x @ W_up[e]ᵀ, x @ W_gate[e]ᵀ)` for every gathered (token, expert) pair in one
//! primitive, with no intermediate gate/up tensors. Same gather semantics as `gather_qmm`.

use crate::array::s;
use crate::codebook::Codebook;
use crate::quant::{QuantMode, QuantSpec, Quantized};
use crate::{Array, Error, Result};

/// SiTU's settings (`activation_situ_beta`, `activation_situ_linear_beta`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Situ {
    /// β.
    pub beta: f32,
    /// β_lin (None: the second factor is `up` itself).
    pub linear_beta: Option<f32>,
}

/// Whether [`gather_gate_up_situ`] takes this format (MLX affine or mxfp4; others use the unfused ops).
pub fn gate_up_fusable(spec: QuantSpec) -> bool {
    !super::differentiable() && matches!(spec.mode, QuantMode::Affine | QuantMode::Mxfp4)
}

/// `SiTU(x @ up[rhs]ᵀ, x @ gate[rhs]ᵀ)` for MLX-quantized expert stacks `[E, N, ..]` (affine or mxfp4, the
/// same spec for both). `x (*Bx, M, K)`, `lhs` into the flattened `Bx` (None = in order), `rhs` expert ids.
#[track_caller]
pub fn gather_gate_up_situ(
    x: &Array,
    gate: &Quantized,
    up: &Quantized,
    spec: QuantSpec,
    lhs: Option<&Array>,
    rhs: &Array,
    act: Situ,
) -> Result<Array> {
    let mode = match spec.mode {
        QuantMode::Affine => c"affine",
        QuantMode::Mxfp4 => c"mxfp4",
        m => return Err(Error::invalid("gather_gate_up_situ", format!("no fused kernel for {}", m.name()))),
    };
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("gather_gate_up_situ", |res| unsafe {
        mlx_k3_metal::k3_gather_gate_up_situ(
            res,
            x.as_raw(),
            gate.weight.as_raw(),
            gate.scales.as_raw(),
            Array::raw_opt(gate.biases.as_ref()),
            up.weight.as_raw(),
            up.scales.as_raw(),
            Array::raw_opt(up.biases.as_ref()),
            Array::raw_opt(lhs),
            rhs.as_raw(),
            spec.group_size,
            spec.bits,
            mode.as_ptr(),
            act.beta,
            act.linear_beta.is_some(),
            act.linear_beta.unwrap_or(0.0),
            st,
        )
    })
}

/// The same for ternary codebook expert stacks (CPU, f32 activations).
#[track_caller]
pub fn gather_codebook_gate_up_situ(
    x: &Array,
    gate: &Codebook,
    up: &Codebook,
    lhs: Option<&Array>,
    rhs: &Array,
    act: Situ,
) -> Result<Array> {
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("gather_codebook_gate_up_situ", |res| unsafe {
        mlx_k3_metal::k3_gather_codebook_gate_up_situ(
            res,
            x.as_raw(),
            gate.codes.as_raw(),
            gate.qh.as_raw(),
            gate.scales.as_raw(),
            up.codes.as_raw(),
            up.qh.as_raw(),
            up.scales.as_raw(),
            Array::raw_opt(lhs),
            rhs.as_raw(),
            act.beta,
            act.linear_beta.is_some(),
            act.linear_beta.unwrap_or(0.0),
            st,
        )
    })
}
