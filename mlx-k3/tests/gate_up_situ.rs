//! The fused gathered gate/up + SiTU primitive against the unfused path it replaces in the model: the
//! project's gathered kernels for the up and gate projections (`kernels::gather_qmm`,
//! `codebook::gather_codebook_qmm`) followed by the SiTU primitive, and against MLX's own `gather_qmm` + the
//! plain-ops SiTU. Formats: affine 2/4/8-bit (groups 32/64/128), mxfp4, the ternary codebook. Shapes: the
//! decode layout (x [1, 1, 1, 1, K], 8 experts), the sorted prefill layout (x [P, 1, K], sorted ids), M > 1
//! with broadcast lhs/rhs, and the scalar (non-AVX2) path.
//!
//! Tolerance: against the project's unfused path the gate/up dot products are the same kernels on the same
//! prepared activations, so the only difference is SiTU's vectorization: checked at 1e-6 x max|ref| (the
//! measured max is printed). Against MLX's kernels the dot products sum in another order: 2e-5 x max|ref|.

mod common;

use common::{max_abs, max_abs_diff};
use mlx_k3::codebook::{self, Codebook};
use mlx_k3::kernels::{
    self, force_scalar, gather_codebook_gate_up_situ, gather_gate_up_situ, situ, situ_reference, QmmActivations, Situ,
};
use mlx_k3::quant::{self, Gather, QuantMode, QuantSpec, Quantized};
use mlx_k3::{random, with_device, Array, Device, Dtype};

/// force_scalar and the q8 activation mode are process-wide: the tests that set them hold this lock.
static MODES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn randn(shape: &[i32], scale: f32, seed: u64) -> Array {
    random::normal(shape, Dtype::F32, 0.0, scale, Some(&random::key(seed).unwrap())).unwrap()
}

fn packed(w: &Array, spec: QuantSpec) -> Quantized {
    quant::quantize(w, spec, None).unwrap()
}

fn random_codebook(shape: &[i32], seed: u64) -> Codebook {
    let k = *shape.last().unwrap();
    let lead = &shape[..shape.len() - 1];
    let mk = |last: i32, s: u64| {
        let mut sh = lead.to_vec();
        sh.push(last);
        random::randint(0, 1 << 16, &sh, Dtype::U32, Some(&random::key(s).unwrap())).unwrap()
    };
    let mut ssh = lead.to_vec();
    ssh.push(mlx_k3::codebook::super_blocks(k as usize) as i32);
    Codebook {
        codes: mk(k / 8, seed).bitwise_and(0xffu32).unwrap().astype(Dtype::U8).unwrap(),
        qh: mk(k / 32, seed + 1).astype(Dtype::U16).unwrap(),
        scales: random::uniform(0.001, 0.01, &ssh, Dtype::F16, Some(&random::key(seed + 2).unwrap())).unwrap(),
    }
}

fn rel(got: &Array, want: &Array) -> f32 {
    max_abs_diff(got, want).unwrap() / max_abs(want).unwrap().max(1e-30)
}

/// (x, lhs, rhs) layouts: decode, sorted prefill, and M > 1 with broadcast indices.
fn layouts(k: i32, e: u32) -> Vec<(&'static str, Array, Option<Array>, Array)> {
    let dec_idx: Vec<u32> = (0..8).map(|i| (i * 5 + 3) % e).collect();
    let mut pre: Vec<u32> = (0..96).map(|i| (i * 7 + i / 5) % e).collect();
    pre.sort_unstable();
    vec![
        ("decode", randn(&[1, 1, 1, 1, k], 1.0, 1), None, Array::from_slice(&dec_idx, &[1, 1, 8]).unwrap()),
        ("prefill_sorted", randn(&[96, 1, k], 1.0, 2), None, Array::from_slice(&pre, &[96]).unwrap()),
        ("m2_broadcast", randn(&[3, 2, k], 1.0, 3), None, Array::from_slice(&[1u32, e - 1, 0], &[3, 1]).unwrap()),
        (
            "lhs",
            randn(&[4, 2, k], 1.0, 4),
            Some(Array::from_slice(&[3u32, 0, 0, 2, 1], &[5]).unwrap()),
            Array::from_slice(&[0u32, 1, 1, 2, 0], &[5]).unwrap(),
        ),
        (
            // Strided (transposed) index views that broadcast against each other: lhs [3, 2], rhs [1, 2].
            "lhs_rhs_strided",
            randn(&[4, 1, k], 1.0, 5),
            Some(Array::from_slice(&[3u32, 0, 2, 1, 1, 0], &[2, 3]).unwrap().transpose(&[1, 0]).unwrap()),
            Array::from_slice(&[e - 1, 2], &[2, 1]).unwrap().transpose(&[1, 0]).unwrap(),
        ),
    ]
}

const ACTS: [Situ; 2] = [Situ { beta: 1.0, linear_beta: Some(8.0) }, Situ { beta: 2.0, linear_beta: None }];

#[test]
fn fused_gate_up_situ_matches_unfused_affine_and_mxfp4() {
    let _lock = MODES.lock().unwrap_or_else(|e| e.into_inner());
    with_device(Device::Cpu, || {
        let (e, n, k) = (6, 96, 256);
        let (wg, wu) = (randn(&[e, n, k], 0.05, 10), randn(&[e, n, k], 0.05, 11));
        let mut worst_k3 = 0.0f32;
        let mut worst_mlx = 0.0f32;
        // q8 mode (SIMD only: without SIMD the unfused ops run MLX's kernels) checks fused against unfused;
        // the q8 kernels themselves are checked against a reference in tests/codebook.rs.
        for (scalar, q8) in [(false, false), (true, false), (false, true)] {
            force_scalar(scalar);
            kernels::set_qmm_activations(Some(if q8 { QmmActivations::Q8 } else { QmmActivations::F32 }));
            for spec in [
                QuantSpec::affine(64, 2),
                QuantSpec::affine(32, 2),
                QuantSpec::affine(64, 4),
                QuantSpec::affine(128, 8),
                QuantSpec::affine(32, 3),
                QuantSpec::affine(64, 6),
                QuantSpec::default_for(QuantMode::Mxfp4),
            ] {
                let (g, u) = (packed(&wg, spec), packed(&wu, spec));
                for (name, x, lhs, rhs) in layouts(k, e as u32) {
                    for act in ACTS {
                        let got = gather_gate_up_situ(&x, &g, &u, spec, lhs.as_ref(), &rhs, act).unwrap();
                        let what = format!("{spec:?} {name} {act:?} scalar={scalar} q8={q8}");
                        // The project's unfused path (what the model ran before).
                        let k3u = kernels::gather_qmm(&x, &u, spec, lhs.as_ref(), Some(&rhs), false).unwrap();
                        let k3g = kernels::gather_qmm(&x, &g, spec, lhs.as_ref(), Some(&rhs), false).unwrap();
                        let want = situ(&k3u, &k3g, act.beta, act.linear_beta).unwrap();
                        assert_eq!(got.shape(), want.shape(), "{what}: shape");
                        let e1 = rel(&got, &want);
                        assert!(e1 <= 1e-6, "{what}: vs unfused k3 path rel err {e1}");
                        if q8 {
                            continue;
                        }
                        // MLX's own kernels and the plain-ops SiTU.
                        let gq = || Gather { lhs_indices: lhs.as_ref(), rhs_indices: Some(&rhs), ..Default::default() };
                        let mu = quant::gather_qmm(&x, &u, spec, true, gq()).unwrap();
                        let mg = quant::gather_qmm(&x, &g, spec, true, gq()).unwrap();
                        let mlx = situ_reference(&mu, &mg, act.beta, act.linear_beta).unwrap();
                        let e2 = rel(&got, &mlx);
                        assert!(e2 <= 2e-5, "{what}: vs MLX gather_qmm + SiTU rel err {e2}");
                        if !scalar {
                            worst_k3 = worst_k3.max(e1);
                            worst_mlx = worst_mlx.max(e2);
                        }
                    }
                }
            }
        }
        force_scalar(false);
        kernels::set_qmm_activations(None);
        println!("gate/up+SiTU fused vs unfused k3 kernels: max rel err {worst_k3:e}; vs MLX ops: {worst_mlx:e}");
    })
    .unwrap();
}

#[test]
fn fused_gate_up_situ_matches_unfused_codebook() {
    let _lock = MODES.lock().unwrap_or_else(|e| e.into_inner());
    with_device(Device::Cpu, || {
        let (e, n) = (5, 64);
        let mut worst = 0.0f32;
        // K = 160: a short last super-block (5 of 8 blocks). Both activation precisions (the q8 kernels
        // themselves are checked against a reference in tests/codebook.rs).
        for (k, scalar, q8) in [
            (512, false, false),
            (512, true, false),
            (160, false, false),
            (160, true, false),
            (512, false, true),
            (160, true, true),
        ] {
            let (g, u) = (random_codebook(&[e, n, k], 20), random_codebook(&[e, n, k], 30));
            let (gt, ut) = (g.to_ternary().unwrap(), u.to_ternary().unwrap());
            force_scalar(scalar);
            kernels::set_qmm_activations(Some(if q8 { QmmActivations::Q8 } else { QmmActivations::F32 }));
            for (name, x, lhs, rhs) in layouts(k, e as u32) {
                for act in ACTS {
                    let got = gather_codebook_gate_up_situ(&x, &g, &u, lhs.as_ref(), &rhs, act).unwrap();
                    let cu = codebook::gather_codebook_qmm(&x, &u, lhs.as_ref(), Some(&rhs)).unwrap();
                    let cg = codebook::gather_codebook_qmm(&x, &g, lhs.as_ref(), Some(&rhs)).unwrap();
                    let want = situ(&cu, &cg, act.beta, act.linear_beta).unwrap();
                    let err = rel(&got, &want);
                    assert!(err <= 1e-6, "codebook K={k} {name} {act:?} scalar={scalar} q8={q8}: rel err {err}");
                    worst = worst.max(err);
                    // The ternary layout (the same weights): the codebook kernels' tolerance against the compact
                    // layout's unfused result (f32: the same products summed in another order; q8: equal integers).
                    let got = gather_codebook_gate_up_situ(&x, &gt, &ut, lhs.as_ref(), &rhs, act).unwrap();
                    let err = rel(&got, &want);
                    assert!(
                        err <= 2e-5,
                        "ternary codebook K={k} {name} {act:?} scalar={scalar} q8={q8}: rel err {err}"
                    );
                }
            }
        }
        force_scalar(false);
        kernels::set_qmm_activations(None);
        println!("codebook gate/up+SiTU fused vs unfused: max rel err {worst:e}");
    })
    .unwrap();
}

#[test]
fn fused_gate_up_situ_errors() {
    with_device(Device::Cpu, || {
        let spec = QuantSpec::affine(64, 4);
        let g = packed(&randn(&[4, 32, 128], 0.05, 1), spec);
        let u = packed(&randn(&[4, 64, 128], 0.05, 2), spec);
        let x = randn(&[1, 1, 128], 1.0, 3);
        let rhs = Array::from_slice(&[1u32], &[1]).unwrap();
        let msg = gather_gate_up_situ(&x, &g, &u, spec, None, &rhs, ACTS[0]).unwrap_err().to_string();
        assert!(msg.contains("[gather_gate_up_situ] gate and up stacks differ in shape"), "{msg}");
        let bad = Array::from_slice(&[9u32], &[1]).unwrap();
        let msg =
            gather_gate_up_situ(&x, &g, &g, spec, None, &bad, ACTS[0]).and_then(|y| y.eval()).unwrap_err().to_string();
        assert!(msg.contains("index out of range: expert 9 of 4"), "{msg}");
    })
    .unwrap();
}
