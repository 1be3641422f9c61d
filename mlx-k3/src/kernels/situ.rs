//! SiTU, Kimi K3's expert activation (docs/formats.md#situ):
//! `SiTU(u, g) = [β·tanh(g/β)·σ(g)] · [β_lin·tanh(u/β_lin)]`, the second factor being `u` when β_lin is unset.
//! u is the up projection, g the gate projection; β→∞ recovers SiLU(g)·u.

use crate::array::s;
use crate::{Array, Dtype, Result};

/// SiTU through the fused primitive: one pass over `up` and `gate`, fp32 math, output in the inputs' dtype.
#[track_caller]
pub fn situ(up: &Array, gate: &Array, beta: f32, linear_beta: Option<f32>) -> Result<Array> {
    if super::differentiable() {
        return situ_reference(up, gate, beta, linear_beta);
    }
    let st = s();
    // SAFETY: live handles in, new handle out; the C++ op validates the arguments.
    Array::try_from_op("situ", |res| unsafe {
        mlx_k3_metal::k3_situ(
            res,
            up.as_raw(),
            gate.as_raw(),
            beta,
            linear_beta.is_some(),
            linear_beta.unwrap_or(0.0),
            st,
        )
    })
}

/// The reference: the same formula from plain MLX ops, as mlx-lm's `_situ` computes it (fp32, cast back).
#[track_caller]
pub fn situ_reference(up: &Array, gate: &Array, beta: f32, linear_beta: Option<f32>) -> Result<Array> {
    let dtype = result_dtype(up.dtype(), gate.dtype());
    let g = gate.astype(Dtype::F32)?;
    let mut x = up.astype(Dtype::F32)?;
    let a = g.divide(beta)?.tanh()?.multiply(beta)?.multiply(&g.sigmoid()?)?;
    if let Some(lb) = linear_beta {
        x = x.divide(lb)?.tanh()?.multiply(lb)?;
    }
    a.multiply(&x)?.astype(dtype)
}

fn result_dtype(a: Dtype, b: Dtype) -> Dtype {
    if a == b {
        a
    } else if a == Dtype::F32 || b == Dtype::F32 {
        Dtype::F32
    } else {
        // f16 with bf16 promotes to f32 in MLX.
        Dtype::F32
    }
}
