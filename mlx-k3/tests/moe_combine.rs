//! The MoE weighted sum over the selected experts (one K3MoeCombine node on the CPU) against MLX's
//! multiply-and-sum. Tolerance: both sum the k products in fp32 in expert order; the kernel may fuse each
//! multiply-add (one rounding instead of two), so results differ by a few ulp of the largest partial sum:
//! checked at 1e-6 of the output's largest magnitude.

mod common;

use common::{max_abs, max_abs_diff};
use mlx_k3::kernels::{moe_combine, moe_combine_reference};
use mlx_k3::{random, Array, Dtype};

fn randn(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::F32, 0.0, 1.0, Some(&random::key(seed).unwrap())).unwrap()
}

#[test]
fn moe_combine_matches_multiply_and_sum() {
    for (i, shape) in [vec![1, 1, 8, 1024], vec![2, 3, 4, 64], vec![5, 16, 7], vec![3, 1, 33]].iter().enumerate() {
        let y = randn(shape, 10 + i as u64);
        let w = randn(&shape[..shape.len() - 1], 20 + i as u64);
        mlx_k3::eval(&[&y, &w]).unwrap();
        let got = moe_combine(&y, &w).unwrap();
        assert_eq!(mlx_k3::graph_nodes(&[&got], None).unwrap(), 1, "{shape:?}: one node");
        let want = moe_combine_reference(&y, &w).unwrap();
        assert_eq!(got.shape(), want.shape());
        let e = max_abs_diff(&got, &want).unwrap() / max_abs(&want).unwrap();
        assert!(e <= 1e-6, "{shape:?}: rel err {e}");
    }
    // Strided views (transposes) are read through their strides.
    let y = randn(&[8, 2, 64], 30).transpose(&[1, 0, 2]).unwrap(); // [2, 8, 64]
    let w = randn(&[8, 2], 31).transpose(&[1, 0]).unwrap(); // [2, 8]
    let e = max_abs_diff(&moe_combine(&y, &w).unwrap(), &moe_combine_reference(&y, &w).unwrap()).unwrap();
    assert!(e <= 1e-5, "strided: {e}");
    // bf16 (and mismatched shapes) take MLX's ops: bit-identical, and MLX's errors.
    let (yb, wb) = (y.astype(Dtype::BF16).unwrap(), w.astype(Dtype::BF16).unwrap());
    let a = moe_combine(&yb, &wb).unwrap().astype(Dtype::F32).unwrap();
    let b = moe_combine_reference(&yb, &wb).unwrap().astype(Dtype::F32).unwrap();
    assert_eq!(max_abs_diff(&a, &b).unwrap(), 0.0);
    let bad = randn(&[2, 5], 32);
    assert!(moe_combine(&y, &bad).and_then(|r| r.eval()).is_err());
}
