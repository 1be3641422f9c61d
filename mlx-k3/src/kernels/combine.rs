//! The MoE block's weighted sum over the selected experts as one primitive on the CPU.

use crate::array::s;
use crate::{Array, Result};

/// `sum_k w[..., k] * y[..., k, :]` for expert outputs `y [..., k, D]` and routing weights `w [..., k]`:
/// mlx-lm's `(y * w[..., None]).sum(-2)`. For f32 on a CPU stream this is one `K3MoeCombine` node (MLX's
/// ops are an expand_dims, broadcasts, a multiply and a sum per MoE layer), summing in expert order in fp32.
/// Other dtypes and GPU streams run MLX's ops unchanged.
#[track_caller]
pub fn moe_combine(y: &Array, w: &Array) -> Result<Array> {
    if super::differentiable() {
        return moe_combine_reference(y, w);
    }
    let st = s();
    // SAFETY: live handles in, new handle out; the C++ op validates the arguments.
    Array::try_from_op("moe_combine", |res| unsafe { mlx_k3_metal::k3_moe_combine(res, y.as_raw(), w.as_raw(), st) })
}

/// The plain-ops composition [`moe_combine`] replaces (MLX's multiply and sum).
pub fn moe_combine_reference(y: &Array, w: &Array) -> Result<Array> {
    y.multiply(&w.expand_dims(&[-1])?)?.sum(&[-2], false)
}
