//! The fused decode primitives against the MLX op compositions they replace, in the same run: the KDA
//! one-token step (`kda_step` vs `kda_step_reference`), the attention-residual mix (`attn_res_mix` vs
//! `attn_res_mix_reference`), and the routed experts' gate/up + SiTU (`gather_gate_up_situ` vs the project's
//! two gathered kernels + the SiTU primitive, and vs MLX's stock `gather_qmm` twice + plain-ops SiTU), and
//! MLX's dense f32 matmul through the project's SGEMM vs the wheel's reference BLAS, and an MLA layer's
//! one-token attention over its latent cache with the heads as matmul rows (`attend_latent_one_token`, what
//! the model runs on the CPU) vs MLX's attention (its CPU fallback composition, what it ran before).
//! Shapes are the mid-size K3 configuration of scripts/bench_e2e.py (16 KDA heads of 128, hidden 2048,
//! 3 block snapshots, 128 experts 1024 -> 512 at 2-bit, top-8). Graph building and evaluation are inside
//! the timer (MLX is lazy).
//!
//! Run: `cargo bench -p mlx-k3 --bench fused -- --warm-up-time 1 --measurement-time 3`.

use criterion::{criterion_group, criterion_main, Criterion};
use mlx_k3::fast::{self, AttentionMask};
use mlx_k3::kernels::{self, KdaStepInputs, KdaWeights, Situ};
use mlx_k3::model::mla::attend_latent_one_token;
use mlx_k3::quant::{self, Gather, QuantMode, QuantSpec};
use mlx_k3::{random, Array, Dtype};

fn randn(shape: &[i32], scale: f32, seed: u64) -> Array {
    let a = random::normal(shape, Dtype::F32, 0.0, scale, Some(&random::key(seed).unwrap())).unwrap();
    a.eval().unwrap();
    a
}

fn bench_kda(c: &mut Criterion) {
    let (h, d, kc) = (16, 128, 4);
    let p = h * d;
    let conv_w = randn(&[3 * p, kc, 1], 0.5, 1);
    let a_log = randn(&[h], 0.5, 2);
    let dt_bias = randn(&[p], 0.5, 3);
    let norm_w = randn(&[d], 0.1, 4);
    let w = KdaWeights {
        conv_weight: &conv_w,
        a_log: &a_log,
        dt_bias: &dt_bias,
        norm_weight: &norm_w,
        heads: h,
        head_dim: d,
        lower_bound: Some(-5.0),
        norm_eps: 1e-5,
    };
    let (qkv, a, b, g) = (
        randn(&[1, 1, 3 * p], 1.0, 5),
        randn(&[1, 1, h, d], 1.0, 6),
        randn(&[1, 1, h], 1.0, 7),
        randn(&[1, 1, h, d], 1.0, 8),
    );
    let conv = randn(&[1, kc - 1, 3 * p], 1.0, 9);
    let ssm = randn(&[1, h, d, d], 0.1, 10);
    let x = KdaStepInputs { qkv: &qkv, a: &a, b: &b, gate: &g, conv_state: Some(&conv), ssm_state: Some(&ssm) };
    let mut grp = c.benchmark_group("kda_step_16x128");
    grp.bench_function("fused", |bn| {
        bn.iter(|| {
            let (y, c, s) = kernels::kda_step(x, w).unwrap();
            mlx_k3::eval(&[&y, &c, &s]).unwrap()
        })
    });
    grp.bench_function("plain_ops", |bn| {
        bn.iter(|| {
            let (y, c, s) = kernels::kda_step_reference(x, w).unwrap();
            mlx_k3::eval(&[&y, &c, &s]).unwrap()
        })
    });
    grp.finish();
}

fn bench_attn_res(c: &mut Criterion) {
    let (k, d, eps) = (3, 2048, 1e-5);
    let mut grp = c.benchmark_group("attn_res_3x2048");
    for t in [1, 512] {
        let raw = randn(&[k, 1, t, d], 1.0, 11);
        let f = raw.multiply(&raw).unwrap().mean(&[-1], false).unwrap().add(eps).unwrap().rsqrt().unwrap();
        f.eval().unwrap();
        let partial = randn(&[1, t, d], 2.0, 12);
        let w_eff = randn(&[d], 0.03, 13);
        grp.bench_function(format!("fused/{t}tok"), |bn| {
            bn.iter(|| kernels::attn_res_mix(&raw, &f, &partial, &w_eff, eps).unwrap().eval().unwrap())
        });
        grp.bench_function(format!("plain_ops/{t}tok"), |bn| {
            bn.iter(|| kernels::attn_res_mix_reference(&raw, &f, &partial, &w_eff, eps).unwrap().eval().unwrap())
        });
    }
    grp.finish();
}

fn bench_gate_up(c: &mut Criterion) {
    let (e, n, k) = (128, 512, 1024);
    let spec = QuantSpec { mode: QuantMode::Affine, group_size: 64, bits: 2 };
    let gate = quant::quantize(&randn(&[e, n, k], 0.02, 21), spec, None).unwrap();
    let up = quant::quantize(&randn(&[e, n, k], 0.02, 22), spec, None).unwrap();
    for q in [&gate, &up] {
        mlx_k3::eval(&[&q.weight, &q.scales, q.biases.as_ref().unwrap()]).unwrap();
    }
    let act = Situ { beta: 1.0, linear_beta: Some(8.0) };
    let x = randn(&[1, 1, 1, 1, k], 1.0, 23);
    let idx: Vec<u32> = (0..8).map(|i| (i * 37 + 5) % e as u32).collect();
    let rhs = Array::from_slice(&idx, &[1, 1, 8]).unwrap();
    let mut grp = c.benchmark_group("gate_up_situ_2bit_128x512x1024_top8");
    grp.bench_function("fused", |bn| {
        bn.iter(|| kernels::gather_gate_up_situ(&x, &gate, &up, spec, None, &rhs, act).unwrap().eval().unwrap())
    });
    grp.bench_function("k3_unfused", |bn| {
        bn.iter(|| {
            let u = kernels::gather_qmm(&x, &up, spec, None, Some(&rhs), false).unwrap();
            let g = kernels::gather_qmm(&x, &gate, spec, None, Some(&rhs), false).unwrap();
            kernels::situ(&u, &g, act.beta, act.linear_beta).unwrap().eval().unwrap()
        })
    });
    grp.bench_function("mlx_stock", |bn| {
        bn.iter(|| {
            let gth = || Gather { rhs_indices: Some(&rhs), ..Default::default() };
            let u = quant::gather_qmm(&x, &up, spec, true, gth()).unwrap();
            let g = quant::gather_qmm(&x, &gate, spec, true, gth()).unwrap();
            kernels::situ_reference(&u, &g, act.beta, act.linear_beta).unwrap().eval().unwrap()
        })
    });
    grp.finish();
}

/// MLX's dense f32 matmul through the project's SGEMM (exported `cblas_sgemm`) against the wheel's reference
/// BLAS (`set_reference_blas(true)`): 1024^3 and the mid-size prefill's 512 x 2048 @ 2048 x 2048. `project` is
/// the default path (the AVX-512 micro-kernel where the CPU has it), `project_avx2` the AVX2 one.
fn bench_dense(c: &mut Criterion) {
    let mut grp = c.benchmark_group("dense_sgemm");
    for (m, k, n) in [(1024, 1024, 1024), (512, 2048, 2048)] {
        let a = randn(&[m, k], 1.0, 31);
        let b = randn(&[k, n], 1.0, 32);
        for (name, reference, avx512) in
            [("project", false, None), ("project_avx2", false, Some(false)), ("reference_blas", true, None)]
        {
            grp.bench_function(format!("{name}/{m}x{k}x{n}"), |bn| {
                kernels::set_reference_blas(reference);
                kernels::set_avx512(avx512);
                bn.iter(|| a.matmul(&b).unwrap().eval().unwrap());
                kernels::set_avx512(None);
                kernels::set_reference_blas(false);
            });
        }
    }
    grp.finish();
}

fn bench_mla_decode(c: &mut Criterion) {
    // The mid-size model's MLA layers: 16 heads, latent rank 512; the cache a slice of a longer buffer.
    let (h, r, scale) = (16, 512, 0.07);
    let mut grp = c.benchmark_group("mla_decode_attention_16x512");
    for s in [128, 1024, 4096] {
        let q = randn(&[1, h, 1, r], 1.0, 21);
        let buf = randn(&[1, 1, s + 256, r], 1.0, 22);
        let latent = buf.slice_axis(2, 0, s).unwrap();
        let bias = randn(&[1, h, 1, s], 1.0, 23);
        let bias_rows = bias.reshape(&[1, 1, h, s]).unwrap();
        grp.bench_function(format!("heads_as_rows/{s}"), |bn| {
            bn.iter(|| attend_latent_one_token(&q, &latent, scale, &bias_rows).unwrap().eval().unwrap())
        });
        grp.bench_function(format!("mlx_attention/{s}"), |bn| {
            bn.iter(|| {
                fast::scaled_dot_product_attention(&q, &latent, &latent, scale, AttentionMask::Array(&bias), None)
                    .unwrap()
                    .eval()
                    .unwrap()
            })
        });
    }
    grp.finish();
}

criterion_group!(benches, bench_kda, bench_attn_res, bench_gate_up, bench_dense, bench_mla_decode);
criterion_main!(benches);
