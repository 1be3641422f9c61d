//! RMSNorm and log_softmax as one primitive each on the CPU.

use crate::array::s;
use crate::{Array, Result};

/// `x / sqrt(mean(x²) + eps) * weight` over the last axis, as [`crate::fast::rms_norm`] computes it. For f32
/// on a CPU stream this is one `K3RmsNorm` node (MLX's CPU path builds about ten: square, sum, scale, add,
/// rsqrt, broadcasts, multiplies); the arithmetic is MLX's except for the order of the sum of squares.
/// Other dtypes and GPU streams run MLX's op unchanged.
#[track_caller]
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    if super::differentiable() {
        return crate::fast::rms_norm(x, weight, eps);
    }
    let st = s();
    // SAFETY: live handles (or null) in, new handle out; the C++ op validates the arguments.
    Array::try_from_op("rms_norm", |res| unsafe {
        mlx_k3_metal::k3_kernels_rms_norm(res, x.as_raw(), Array::raw_opt(weight), eps, st)
    })
}

/// Log-probabilities over the last axis, `x - logsumexp(x)` (mlx-lm's decode step). For f32 on a CPU stream
/// this is one `K3LogSoftmax` node with a vectorized exp (the MLX CPU wheel's exp is a scalar libm call per
/// element: ~0.8 ms per token over a 32000-word vocabulary); the result is MLX's up to the order of the sum
/// and exp's last ulp. Other dtypes and GPU streams run MLX's ops unchanged.
#[track_caller]
pub fn log_softmax(x: &Array) -> Result<Array> {
    let st = s();
    // SAFETY: a live handle in, new handle out; the C++ op validates the argument.
    Array::try_from_op("log_softmax", |res| unsafe { mlx_k3_metal::k3_kernels_log_softmax(res, x.as_raw(), st) })
}
