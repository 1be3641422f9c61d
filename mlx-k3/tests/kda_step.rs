//! The fused one-token KDA decode step against its plain-ops reference (mlx-lm's ops path), over several
//! chained steps so the conv window and the recurrent state evolve, with and without gate_lower_bound,
//! from empty and from filled caches, at batch 1 and 2, in f32 and bf16, on every device with a kernel.
//!
//! Tolerance: both compute in fp32; they differ in summation order (dot products over d = 64/128, the
//! depthwise conv) and in how exp/sigmoid/softplus are evaluated (a few ulp), so f32 outputs and states
//! agree to ~1e-6 relative of their largest magnitude; checked at 2e-5 (bf16 outputs and states: 2 bf16
//! ulp, see `run`).

mod common;

use common::{max_abs, max_abs_diff};
use mlx_k3::kernels::{
    force_scalar, gated_delta_scan, kda_step, kda_step_reference, kda_step_supported, KdaStepInputs, KdaWeights,
};
use mlx_k3::model::kda::gated_delta_steps;
use mlx_k3::{random, with_device, Array, Device, Dtype};

fn randn(shape: &[i32], scale: f32, seed: u64) -> Array {
    random::normal(shape, Dtype::F32, 0.0, scale, Some(&random::key(seed).unwrap())).unwrap()
}

fn rel(got: &Array, want: &Array) -> f32 {
    max_abs_diff(got, want).unwrap() / max_abs(want).unwrap().max(1e-30)
}

fn run(b: i32, h: i32, d: i32, kc: i32, lb: Option<f32>, dtype: Dtype, seed: u64) -> f32 {
    let p = h * d;
    let conv_w = randn(&[3 * p, kc, 1], 0.5, seed);
    let a_log = random::uniform(0.0, 2.0, &[h], Dtype::F32, Some(&random::key(seed + 1).unwrap())).unwrap();
    let dt_bias = randn(&[p], 0.5, seed + 2);
    let norm_w = randn(&[d], 0.1, seed + 3).add(1.0f32).unwrap();
    let w = KdaWeights {
        conv_weight: &conv_w,
        a_log: &a_log,
        dt_bias: &dt_bias,
        norm_weight: &norm_w,
        heads: h,
        head_dim: d,
        lower_bound: lb,
        norm_eps: 1e-5,
    };
    let (mut conv, mut ssm): (Option<Array>, Option<Array>) = (None, None);
    let (mut rconv, mut rssm): (Option<Array>, Option<Array>) = (None, None);
    let mut worst = 0.0f32;
    for step in 0..6u64 {
        let s = seed * 100 + step * 10;
        let qkv = randn(&[b, 1, 3 * p], 1.0, s).astype(dtype).unwrap();
        let a = randn(&[b, 1, h, d], 1.0, s + 1).astype(dtype).unwrap();
        let bl = randn(&[b, 1, h], 1.0, s + 2).astype(dtype).unwrap();
        let gate = randn(&[b, 1, h, d], 1.0, s + 3).astype(dtype).unwrap();
        let x =
            KdaStepInputs { qkv: &qkv, a: &a, b: &bl, gate: &gate, conv_state: conv.as_ref(), ssm_state: ssm.as_ref() };
        let xr = KdaStepInputs { conv_state: rconv.as_ref(), ssm_state: rssm.as_ref(), ..x };
        let (ry, rc, rst) = kda_step_reference(xr, w).unwrap();
        let (y, c, st) = kda_step(x, w).unwrap();
        // a and gate as the projections give them ([B, 1, P]) are the same inputs to the kernel.
        let (af, gf) = (a.reshape(&[b, 1, p]).unwrap(), gate.reshape(&[b, 1, p]).unwrap());
        let (yf, _, stf) = kda_step(KdaStepInputs { a: &af, gate: &gf, ..x }, w).unwrap();
        assert_eq!(max_abs_diff(&yf, &y).unwrap(), 0.0, "flat a/gate: output");
        assert_eq!(max_abs_diff(&stf, &st).unwrap(), 0.0, "flat a/gate: state");
        assert_eq!(y.shape(), vec![b, 1, p]);
        assert_eq!(y.dtype(), dtype);
        assert_eq!(c.shape(), rc.shape());
        assert_eq!(st.shape(), vec![b, h, d, d]);
        assert_eq!(st.dtype(), Dtype::F32);
        // The conv window is a copy: exact.
        assert_eq!(max_abs_diff(&c, &rc).unwrap(), 0.0, "conv window at step {step}");
        let (ey, es) = (rel(&y, &ry), rel(&st, &rst));
        let tol = if dtype == Dtype::F32 { 2e-5 } else { 2.0 / 128.0 };
        assert!(ey <= tol, "B={b} H={h} d={d} lb={lb:?} {dtype} step {step}: output rel err {ey}");
        // In bf16 the plain-ops path rounds the conv output, the normalized q/k and v to bf16 before the fp32
        // state update; the kernel keeps them in fp32 (it rounds only what it stores): the states then differ
        // by up to about one bf16 ulp (2^-8) of those inputs, so bf16 states are checked at 2 bf16 ulp.
        let stol = if dtype == Dtype::F32 { 2e-5 } else { 2.0 / 256.0 };
        assert!(es <= stol, "B={b} H={h} d={d} lb={lb:?} {dtype} step {step}: state rel err {es}");
        worst = worst.max(ey).max(es);
        // Each side continues from its own state (errors would compound if they drifted).
        (conv, ssm, rconv, rssm) = (Some(c), Some(st), Some(rc), Some(rst));
    }
    worst
}

#[test]
fn kda_step_matches_reference_on_every_device() {
    for device in Device::available() {
        with_device(device, || {
            if !kda_step_supported() {
                println!("{device:?}: no fused KDA step kernel (plain ops are used there)");
                return;
            }
            // The CPU kernel's AVX2 state update and its scalar loop (forced; the AVX2 one needs d % 16 == 0,
            // so d = 16 runs it too); GPU kernels ignore the switch. The other test here does not depend on it.
            for scalar in [false, true] {
                force_scalar(scalar);
                let mut worst = 0.0f32;
                for (i, &(b, h, d, kc, lb, dt)) in [
                    (1, 16, 128, 4, Some(-5.0f32), Dtype::F32),
                    (2, 4, 64, 4, None, Dtype::F32),
                    (1, 2, 32, 3, Some(-2.0), Dtype::F32),
                    (2, 3, 128, 4, Some(-5.0), Dtype::BF16),
                    (1, 1, 16, 1, None, Dtype::F32),
                    (1, 2, 24, 2, Some(-5.0), Dtype::F32),
                ]
                .iter()
                .enumerate()
                {
                    let e = run(b, h, d, kc, lb, dt, 7 + i as u64);
                    if dt == Dtype::F32 {
                        worst = worst.max(e);
                    }
                }
                println!(
                    "{device:?} (scalar forced: {scalar}): fused KDA step vs plain ops, f32 max rel err over 6 chained \
                     steps = {worst:e}"
                );
            }
            force_scalar(false);
        })
        .unwrap();
    }
}

#[test]
fn kda_step_rejects_bad_shapes() {
    with_device(Device::Cpu, || {
        let (h, d) = (2, 8);
        let p = h * d;
        let z = |s: &[i32]| mlx_k3::ops::zeros(s, Dtype::F32).unwrap();
        let (conv_w, a_log, dt_bias, norm_w) = (z(&[3 * p, 4, 1]), z(&[h]), z(&[p]), z(&[d]));
        let w = KdaWeights {
            conv_weight: &conv_w,
            a_log: &a_log,
            dt_bias: &dt_bias,
            norm_weight: &norm_w,
            heads: h,
            head_dim: d,
            lower_bound: None,
            norm_eps: 1e-5,
        };
        let (qkv, a, b, g) = (z(&[1, 2, 3 * p]), z(&[1, 1, h, d]), z(&[1, 1, h]), z(&[1, 1, h, d]));
        let x = KdaStepInputs { qkv: &qkv, a: &a, b: &b, gate: &g, conv_state: None, ssm_state: None };
        let msg = kda_step(x, w).unwrap_err().to_string();
        assert!(msg.contains("[kda_step] qkv must be [B, 1, 3P] (one token)"), "{msg}");
        let qkv = z(&[1, 1, 3 * p]);
        let bad = z(&[1, h, d, d + 1]);
        let x = KdaStepInputs { qkv: &qkv, a: &a, b: &b, gate: &g, conv_state: None, ssm_state: Some(&bad) };
        let msg = kda_step(x, w).unwrap_err().to_string();
        assert!(msg.contains("ssm state has shape (1,2,8,9), expected (1,2,8,8)"), "{msg}");
    })
    .unwrap();
}

/// The prefill primitive against the per-step ops: batch 1 and 2, d = 16 / 32 / 128 (AVX2 rows need d % 16
/// == 0; 24 runs the scalar loop), with and without an initial state, f32 and bf16 q/k/v, q/k/v as strided
/// views of one merged tensor (as the model passes them). Same tolerance as the step (f32 sums over d in
/// another order): 2e-5 of the largest magnitude over up to 9 chained tokens; bf16 outputs within 2 bf16 ulp.
#[test]
fn gated_delta_scan_matches_the_per_step_ops() {
    with_device(Device::Cpu, || {
        let mut worst = 0.0f32;
        for (i, &(b, t, h, d, with_state, dt)) in [
            (1, 9, 4, 128, true, Dtype::F32),
            (2, 5, 3, 32, false, Dtype::F32),
            (1, 1, 2, 16, true, Dtype::F32),
            (2, 6, 2, 24, true, Dtype::F32),
            (1, 7, 3, 64, true, Dtype::BF16),
        ]
        .iter()
        .enumerate()
        {
            let seed = 500 + 10 * i as u64;
            let inv = 1.0 / (d as f32).sqrt();
            // q, k, v as the model's conv output gives them: slices of one [B, T, 3 H d] tensor.
            let qkv = randn(&[b, t, 3 * h * d], inv, seed).astype(dt).unwrap();
            let part = |j: i32| qkv.slice_axis(-1, j * h * d, (j + 1) * h * d).unwrap().reshape(&[b, t, h, d]).unwrap();
            let (q, k) = (part(0), part(1));
            let v = part(2).multiply(d as f32).unwrap();
            let g = randn(&[b, t, h, d], 1.0, seed + 1).abs().unwrap().negative().unwrap().exp().unwrap();
            let beta = randn(&[b, t, h], 1.0, seed + 2).sigmoid().unwrap().astype(dt).unwrap();
            let s0 = randn(&[b, h, d, d], 0.5, seed + 3);
            let zeros = mlx_k3::ops::zeros(&[b, h, d, d], Dtype::F32).unwrap();
            // The per-step ops over T tokens (the model's path off the CPU, and mlx-lm's ops reference).
            let (ry, rs) =
                gated_delta_steps(&q, &k, &v, &g, &beta, if with_state { s0.clone() } else { zeros }).unwrap();
            let (y, s) = gated_delta_scan(&q, &k, &v, &g, &beta, with_state.then_some(&s0)).unwrap();
            assert_eq!(y.shape(), vec![b, t, h, d]);
            assert_eq!(y.dtype(), dt);
            assert_eq!(s.shape(), vec![b, h, d, d]);
            assert_eq!(s.dtype(), Dtype::F32);
            let (ey, es) = (rel(&y, &ry), rel(&s, &rs));
            if dt == Dtype::F32 {
                assert!(ey < 2e-5 && es < 2e-5, "case {i}: output {ey:e}, state {es:e}");
                worst = worst.max(ey).max(es);
            } else {
                // bf16 outputs: the same f32 values rounded once, so within 2 bf16 ulp (2^-7 relative) of the
                // largest magnitude; the f32 state as in f32.
                assert!(ey < 2.0 * 2f32.powi(-7) && es < 2e-5, "case {i} (bf16): output {ey:e}, state {es:e}");
            }
        }
        println!("gated_delta_scan vs per-step ops: f32 max rel err = {worst:e}");
        // Bad shapes are errors naming the input.
        let z = |sh: &[i32]| mlx_k3::ops::zeros(sh, Dtype::F32).unwrap();
        let (q, beta) = (z(&[1, 3, 2, 8]), z(&[1, 3, 2]));
        let msg = gated_delta_scan(&q, &q, &q, &q, &z(&[1, 3, 3]), None).unwrap_err().to_string();
        assert!(msg.contains("[gated_delta_scan] beta has shape (1,3,3), expected (1,3,2)"), "{msg}");
        let msg = gated_delta_scan(&q, &q, &q, &q, &beta, Some(&z(&[1, 2, 8, 9]))).unwrap_err().to_string();
        assert!(msg.contains("state has shape (1,2,8,9), expected (1,2,8,8)"), "{msg}");
    })
    .unwrap();
}
