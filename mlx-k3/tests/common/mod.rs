//! Helpers shared by the integration tests.
#![allow(dead_code)]

use mlx_k3::{Array, Result};

/// f32 array from a slice.
pub fn f32s(data: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

/// Elements as f32.
pub fn vals(a: &Array) -> Vec<f32> {
    a.to_vec_f32().unwrap()
}

/// Asserts elementwise |a - b| <= tol.
#[track_caller]
pub fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "length mismatch");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "element {i}: got {g}, want {w} (tol {tol})\n got {got:?}\nwant {want:?}");
    }
}

/// max |a - b| over two arrays (computed on the host).
pub fn max_abs_diff(a: &Array, b: &Array) -> Result<f32> {
    let (x, y) = (a.to_vec_f32()?, b.to_vec_f32()?);
    Ok(x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max))
}

/// max |x|.
pub fn max_abs(a: &Array) -> Result<f32> {
    Ok(a.to_vec_f32()?.iter().fold(0.0f32, |m, v| m.max(v.abs())))
}
