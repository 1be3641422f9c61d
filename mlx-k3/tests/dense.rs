//! The project's SGEMM behind `cblas_sgemm` (mlx-k3-metal/cpp/dense_sgemm.cpp): every program of this crate
//! exports it (build.rs), so MLX's CPU float32 matmuls reach it instead of the wheel's reference BLAS. Checked
//! against the reference BLAS (`set_reference_blas(true)` sends the calls back to it) on square, skinny
//! (vector-matrix both ways, matrix-vector), odd-sized, transposed and batched products: the AVX2/FMA kernel
//! on x86-64, the NEON one on AArch64 (`scripts/check_aarch64.sh` runs this test under qemu). Linux only:
//! elsewhere the symbol is not exported and MLX calls its platform BLAS.
//!
//! Tolerance: both sum K products in fp32 in different orders (blocked FMA vs the reference's loop), so
//! they differ by a few ulp times sqrt(K) of the largest partial sums: checked at 1e-5 x max|ref| (the
//! measured max is printed).
#![cfg(target_os = "linux")]

mod common;

use common::{max_abs, max_abs_diff};
use mlx_k3::kernels::{set_avx512, set_reference_blas, sgemm_calls};
use mlx_k3::{random, with_device, Array, Device, Dtype};

fn randn(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::F32, 0.0, 1.0, Some(&random::key(seed).unwrap())).unwrap()
}

#[test]
fn project_sgemm_matches_reference_blas() {
    with_device(Device::Cpu, || {
        // Both x86 micro-kernels where the CPU has AVX-512 (12x32, then 6x16 AVX2); elsewhere both passes run one.
        for avx512 in [true, false] {
            set_avx512(Some(avx512));
            let mut worst = 0.0f32;
            let before = sgemm_calls();
            for (i, &(b, m, k, n, ta, tb)) in [
                (1, 256, 256, 256, false, false),
                (1, 130, 600, 70, false, false),
                (1, 1, 1024, 2048, false, true),
                (1, 1, 300, 200, false, false),
                (1, 2048, 1024, 1, false, false),
                (1, 37, 301, 53, true, false),
                (3, 65, 129, 33, true, true),
                (2, 7, 5, 3, false, false),
                // A few rows: an MLA layer's 16 heads at one token against a 4096-entry latent cache (both
                // products of its decode attention), odd columns and a K tail, a narrow last block.
                (1, 16, 512, 4096, false, true),
                (1, 16, 4096, 512, false, false),
                (2, 5, 37, 45, false, true),
                (1, 13, 300, 50, false, false),
                (1, 2, 9, 3, false, true),
            ]
            .iter()
            .enumerate()
            {
                let s = 10 * i as u64;
                let a = if ta { randn(&[b, k, m], s).swapaxes(-1, -2).unwrap() } else { randn(&[b, m, k], s) };
                let w = if tb { randn(&[b, n, k], s + 1).swapaxes(-1, -2).unwrap() } else { randn(&[b, k, n], s + 1) };
                set_reference_blas(false);
                let got = a.matmul(&w).unwrap();
                got.eval().unwrap();
                set_reference_blas(true);
                let want = a.matmul(&w).unwrap();
                want.eval().unwrap();
                set_reference_blas(false);
                let e = max_abs_diff(&got, &want).unwrap() / max_abs(&want).unwrap();
                assert!(e <= 1e-5, "avx512={avx512} B={b} M={m} K={k} N={n} ta={ta} tb={tb}: rel err {e}");
                worst = worst.max(e);
            }
            let calls = sgemm_calls() - before;
            let on = mlx_k3::kernels::avx512().unwrap();
            println!(
                "project SGEMM (AVX-512 {on}) vs reference BLAS: max rel err {worst:e} ({calls} calls it computed)"
            );
            assert!(calls > 0, "MLX's matmuls did not reach the project's SGEMM");
        }
        set_avx512(None);
    })
    .unwrap();
}
