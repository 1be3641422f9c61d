//! The fused attention-residual mix against its plain-ops reference (mlx-lm's `_attn_res_combine`), for 1
//! to 4 snapshots, decode (one token) and prefill shapes, f32 and bf16, strided inputs, on every device with
//! a kernel.
//!
//! Tolerance: fp32 math on both sides, different summation order in the D-long dot products (and MLX's exp
//! vs libm's in the softmax): ~1e-6 relative of the largest output; checked at 1e-5 (bf16: 1 bf16 ulp).

mod common;

use common::{max_abs, max_abs_diff};
use mlx_k3::kernels::{attn_res_mix, attn_res_mix_reference, attn_res_supported, force_scalar};
use mlx_k3::{random, with_device, Array, Device, Dtype};

fn randn(shape: &[i32], scale: f32, seed: u64) -> Array {
    random::normal(shape, Dtype::F32, 0.0, scale, Some(&random::key(seed).unwrap())).unwrap()
}

fn inv_rms(raw: &Array, eps: f32) -> Array {
    let f = raw.astype(Dtype::F32).unwrap();
    f.multiply(&f).unwrap().mean(&[-1], false).unwrap().add(eps).unwrap().rsqrt().unwrap()
}

#[test]
fn attn_res_mix_matches_reference_on_every_device() {
    for device in Device::available() {
        with_device(device, || {
            if !attn_res_supported() {
                println!("{device:?}: no fused attention-residual kernel (plain ops are used there)");
                return;
            }
            let eps = 1e-5;
            let mut worst = 0.0f32;
            // The CPU kernel's AVX2 dot products (f32) and its scalar loops (forced; GPU kernels ignore it).
            for (i, &(k, b, t, d, dt)) in [
                (1, 1, 1, 2048, Dtype::F32),
                (3, 1, 1, 2048, Dtype::F32),
                (4, 2, 7, 96, Dtype::F32),
                (2, 1, 512, 256, Dtype::F32),
                (3, 1, 5, 64, Dtype::BF16),
                (3, 1, 1, 2048, Dtype::F32),
                (2, 1, 3, 100, Dtype::F32),
            ]
            .iter()
            .enumerate()
            {
                force_scalar(i == 5);
                let s = 31 + 10 * i as u64;
                let raw = randn(&[k, b, t, d], 1.0, s).astype(dt).unwrap();
                let partial = randn(&[b, t, d], 2.0, s + 1).astype(dt).unwrap();
                let w = randn(&[d], 1.5 / (d as f32).sqrt(), s + 2);
                let inv = inv_rms(&raw, eps);
                let got = attn_res_mix(&raw, &inv, &partial, &w, eps).unwrap();
                let want = attn_res_mix_reference(&raw, &inv, &partial, &w, eps).unwrap();
                assert_eq!(got.shape(), vec![b, t, d]);
                assert_eq!(got.dtype(), dt);
                let e = max_abs_diff(&got, &want).unwrap() / max_abs(&want).unwrap();
                let tol = if dt == Dtype::F32 { 1e-5 } else { 1.0 / 128.0 };
                assert!(e <= tol, "K={k} B={b} T={t} D={d} {dt}: rel err {e}");
                if dt == Dtype::F32 {
                    worst = worst.max(e);
                }
                // Strided views give the same result as their contiguous copies.
                let rt = raw.swapaxes(1, 2).unwrap();
                let pt = partial.swapaxes(0, 1).unwrap();
                let it = inv.swapaxes(1, 2).unwrap();
                let a = attn_res_mix(&rt, &it, &pt, &w, eps).unwrap();
                let c = attn_res_mix(
                    &rt.contiguous().unwrap(),
                    &it.contiguous().unwrap(),
                    &pt.contiguous().unwrap(),
                    &w,
                    eps,
                )
                .unwrap();
                assert_eq!(max_abs_diff(&a, &c).unwrap(), 0.0, "strided inputs");
            }
            force_scalar(false);
            println!("{device:?}: fused attention-residual mix vs plain ops, f32 max rel err = {worst:e}");
        })
        .unwrap();
    }
}
