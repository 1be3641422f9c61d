//! Matrix products and convolution.

use mlx_k3_sys as sys;

use crate::array::s;
use crate::{Array, Result};

impl Array {
    /// Matrix product with batch broadcasting (`self @ other`).
    #[track_caller]
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("matmul", |res| unsafe { sys::k3_matmul(res, self.as_raw(), other.as_raw(), st) })
    }

    /// Depthwise-capable 1-D convolution: `self` is `[N, L, C_in]`, `weight` is `[C_out, K, C_in / groups]`.
    #[track_caller]
    pub fn conv1d(&self, weight: &Array, stride: i32, padding: i32, dilation: i32, groups: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("conv1d", |res| unsafe {
            sys::k3_conv1d(res, self.as_raw(), weight.as_raw(), stride, padding, dilation, groups, st)
        })
    }
}

/// `beta * c + alpha * (a @ b)`.
#[track_caller]
pub fn addmm(c: &Array, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
    let st = s();
    // SAFETY: live handles in, new handle out.
    Array::try_from_op("addmm", |res| unsafe {
        sys::k3_addmm(res, c.as_raw(), a.as_raw(), b.as_raw(), alpha, beta, st)
    })
}

/// Matrix products with matrix-level gather: `a[lhs_indices] @ b[rhs_indices]` over the batch dimensions
/// (missing indices mean "all, in order"). `sorted_indices` promises `rhs_indices` is non-decreasing.
#[track_caller]
pub fn gather_mm(
    a: &Array,
    b: &Array,
    lhs_indices: Option<&Array>,
    rhs_indices: Option<&Array>,
    sorted_indices: bool,
) -> Result<Array> {
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("gather_mm", |res| unsafe {
        sys::k3_gather_mm(
            res,
            a.as_raw(),
            b.as_raw(),
            Array::raw_opt(lhs_indices),
            Array::raw_opt(rhs_indices),
            sorted_indices,
            st,
        )
    })
}
