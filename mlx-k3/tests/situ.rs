//! The SiTU primitive against its plain-ops reference on every device present.
//!
//! Tolerance: the primitive and the reference both compute in fp32 and differ only in how tanh, exp and
//! sigmoid are evaluated (a polynomial exp/tanh in the kernel, MLX's in the reference), each within a few
//! ulp; the product of three such factors is within ~1e-6 relative of the larger magnitudes, so f32 is
//! checked at 4e-6 x max|ref| (+1e-30). bf16/f16 outputs are rounded from those fp32 values: they may
//! differ by one unit in the last place of the half type where the fp32 values straddle a rounding boundary.

mod common;

use common::{max_abs, max_abs_diff};
use mlx_k3::kernels::{situ, situ_reference};
use mlx_k3::{random, with_device, Array, Device, Dtype};

fn randn(shape: &[i32], scale: f32, seed: u64) -> Array {
    random::normal(shape, Dtype::F32, 0.0, scale, Some(&random::key(seed).unwrap())).unwrap()
}

fn check(up: &Array, gate: &Array, beta: f32, lin: Option<f32>, dtype: Dtype) -> f32 {
    let (u, g) = (up.astype(dtype).unwrap(), gate.astype(dtype).unwrap());
    let got = situ(&u, &g, beta, lin).unwrap();
    let want = situ_reference(&u, &g, beta, lin).unwrap();
    assert_eq!(got.dtype(), dtype);
    assert_eq!(got.shape(), want.shape());
    let diff = max_abs_diff(&got, &want).unwrap();
    let scale = max_abs(&want).unwrap();
    let tol = match dtype {
        Dtype::F32 => 4e-6 * scale + 1e-30,
        Dtype::BF16 => scale / 128.0, // one bf16 ulp at the largest magnitude
        _ => scale / 1024.0,          // one f16 ulp at the largest magnitude
    };
    assert!(diff <= tol, "{dtype} beta={beta} lin={lin:?}: max |diff| {diff} > {tol} (max |ref| {scale})");
    diff
}

#[test]
fn situ_matches_reference_on_every_device() {
    let devices = Device::available();
    assert!(devices.contains(&Device::Cpu));
    for device in devices {
        with_device(device, || {
            let mut worst = 0.0f32;
            for (shape, seed) in [(vec![7], 1u64), (vec![3, 129], 2), (vec![2, 4, 1000], 3), (vec![1 << 17], 4)] {
                // gate up to +-12 so tanh and sigmoid saturate somewhere; up up to +-24 for the linear cap.
                let up = randn(&shape, 8.0, seed);
                let gate = randn(&shape, 4.0, seed + 100);
                for (beta, lin) in [(1.0, None), (2.5, Some(6.0)), (0.3, Some(0.5)), (1e4, None)] {
                    for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
                        let d = check(&up, &gate, beta, lin, dtype);
                        if dtype == Dtype::F32 {
                            worst = worst.max(d);
                        }
                    }
                }
            }
            println!("{device:?}: SiTU primitive vs reference, f32 max |diff| = {worst:e}");
        })
        .unwrap();
    }
}

#[test]
fn situ_handles_broadcast_and_non_contiguous_inputs() {
    let up = randn(&[6, 5], 3.0, 7);
    let gate_t = randn(&[5, 6], 3.0, 8).t().unwrap(); // a transposed (non-contiguous) view
    let row = randn(&[5], 3.0, 9);
    check(&up, &gate_t, 1.0, None, Dtype::F32);
    check(&up, &row, 1.5, Some(2.0), Dtype::F32);
    check(&row, &up, 1.5, Some(2.0), Dtype::F32);
}

#[test]
fn situ_at_limits() {
    // beta -> infinity gives SiLU(g) * u: with beta = 1e4, tanh(g/beta)*beta = g to 1e-8 relative.
    let g = Array::from_slice(&[-3.0f32, -0.5, 0.0, 0.5, 3.0], &[5]).unwrap();
    let u = Array::from_slice(&[2.0f32; 5], &[5]).unwrap();
    let y = situ(&u, &g, 1e4, None).unwrap().to_vec::<f32>().unwrap();
    for (i, gv) in [-3.0f32, -0.5, 0.0, 0.5, 3.0].iter().enumerate() {
        let silu = gv / (1.0 + (-gv).exp()) * 2.0;
        assert!((y[i] - silu).abs() < 1e-5, "{i}: {} vs {silu}", y[i]);
    }
    // Saturation: huge gates give beta * u (tanh -> 1, sigmoid -> 1), huge negative gates give ~0.
    let g = Array::from_slice(&[80.0f32, -80.0, 1e30, -1e30], &[4]).unwrap();
    let u = Array::from_slice(&[3.0f32; 4], &[4]).unwrap();
    let y = situ(&u, &g, 2.0, None).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(y[0], 6.0);
    assert_eq!(y[2], 6.0);
    assert!(y[1].abs() < 1e-30 && y[3].abs() < 1e-30, "{y:?}");
    assert!(y.iter().all(|v| v.is_finite()));
    // The linear cap bounds |output| by beta * ... * linear_beta.
    let u = Array::from_slice(&[1e6f32, -1e6], &[2]).unwrap();
    let g = Array::from_slice(&[50.0f32, 50.0], &[2]).unwrap();
    assert_eq!(situ(&u, &g, 1.0, Some(4.0)).unwrap().to_vec::<f32>().unwrap(), [4.0, -4.0]);
}

#[test]
fn situ_rejects_bad_arguments_with_named_errors() {
    let x = randn(&[4], 1.0, 1);
    for (beta, lin) in [(0.0, None), (-1.0, None), (f32::NAN, None), (1.0, Some(0.0)), (1.0, Some(f32::INFINITY))] {
        let e = situ(&x, &x, beta, lin).unwrap_err().to_string();
        assert!(e.contains("[situ]") && e.contains("beta"), "{e}");
    }
    let ints = Array::from_slice(&[1i32, 2, 3, 4], &[4]).unwrap();
    let e = situ(&ints, &ints, 1.0, None).unwrap_err().to_string();
    assert!(e.contains("[situ]") && e.contains("float"), "{e}");
    let e = situ(&x, &randn(&[3], 1.0, 2), 1.0, None).unwrap_err().to_string();
    assert!(e.contains("broadcast") || e.contains("Shapes"), "{e}");
}
