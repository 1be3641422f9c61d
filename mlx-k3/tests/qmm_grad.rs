//! Gradients through the project's quantized-matmul primitives (codebook, tiered, and the CPU fast paths for
//! MLX's affine and MXFP4 formats): with respect to the activations, the codebook's f16 super-block scales, and
//! the affine scales and biases. Each is compared with MLX's autodiff of an independent dequantize-then-matmul
//! (the Rust plain-ops dequantizers `codebook::dequantize_reference`, `tiered::dequantize_tiered` and MLX's
//! `dequantize`, then `matmul` / `gather_mm`) on the same loss `sum(c ⊙ y)` with a fixed random `c`.
//!
//! Tolerances: both sides are f32 with different summation orders (the kernels' row sums against MLX's
//! matmul), so the activation and f32-scale gradients agree to ~1e-6 relative; 1e-4 of the largest gradient
//! leaves margin. A gradient with respect to a float16 array is itself float16 (MLX gives each gradient its
//! primal's dtype), and the two sides' f32 values before that rounding differ in the last f32 bits, which can
//! move the f16 result by one f16 ulp (2^-11 ≈ 4.9e-4 relative): 2e-3 of the largest gradient.

mod common;

use mlx_k3::codebook::{self, Codebook};
use mlx_k3::quant::{self, QuantMode, QuantSpec, Quantized};
use mlx_k3::tiered::{self, Tier, TieredExperts};
use mlx_k3::{graph_nodes, kernels, ops, random, transforms, with_device, Array, Device, Dtype, Result};

/// Runs a test on the CPU: the project's CPU primitives (the codebook and tiered ops' GPU branches are inference-only kernels).
fn cpu(f: impl FnOnce()) {
    with_device(Device::Cpu, f).unwrap()
}

fn randn(shape: &[i32], seed: u64) -> Array {
    let key = random::key(seed).unwrap();
    random::normal(shape, Dtype::F32, 0.0, 1.0, Some(&key)).unwrap()
}

const TOL_F32: f32 = 1e-4;
const TOL_F16: f32 = 2e-3;

/// Gradients of the same loss by our primitive (`ours`) and by the reference, for every argnum; asserts that
/// the forward ran through `primitive` (so the primitive's vjp is what is tested) and that they agree.
#[track_caller]
fn compare(
    primitive: &str,
    ours: impl Fn(&[Array]) -> Result<Array>,
    reference: impl Fn(&[Array]) -> Result<Array>,
    primals: &[Array],
    argnums: &[usize],
) {
    let y = ours(primals).unwrap();
    assert!(graph_nodes(&[&y], Some(primitive)).unwrap() >= 1, "the op did not build a {primitive} node");
    let c = randn(&y.shape(), 99);
    let (v1, g1) =
        transforms::value_and_grad(|a: &[Array]| Ok(vec![ours(a)?.multiply(&c)?.sum_all(false)?]), primals, argnums)
            .unwrap();
    let (v2, g2) = transforms::value_and_grad(
        |a: &[Array]| Ok(vec![reference(a)?.multiply(&c)?.sum_all(false)?]),
        primals,
        argnums,
    )
    .unwrap();
    let (a, b) = (v1[0].item::<f32>().unwrap(), v2[0].item::<f32>().unwrap());
    assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{primitive}: loss {a} vs reference {b}");
    for ((got, want), &arg) in g1.iter().zip(&g2).zip(argnums) {
        assert_eq!(got.shape(), primals[arg].shape(), "{primitive}: gradient {arg} shape");
        assert_eq!(got.dtype(), primals[arg].dtype(), "{primitive}: gradient {arg} dtype");
        let tol = if primals[arg].dtype() == Dtype::F16 { TOL_F16 } else { TOL_F32 };
        let (g, w) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 1e-3, "{primitive}: reference gradient {arg} is ~0");
        for (i, (p, q)) in g.iter().zip(&w).enumerate() {
            assert!(
                (p - q).abs() <= tol * scale,
                "{primitive}: gradient {arg}[{i}] = {p}, reference {q} (scale {scale})"
            );
        }
    }
}

/// A codebook matrix (or stack, `e > 0`) quantized from random weights.
fn codebook_weights(e: usize, n: usize, k: usize, seed: u64) -> Codebook {
    let rows = e.max(1) * n;
    let w = randn(&[rows as i32, k as i32], seed).to_vec_f32().unwrap();
    let (h, _) = codebook::quantize(&w, rows, k, None).unwrap();
    let cb = h.to_arrays().unwrap();
    if e == 0 {
        return cb;
    }
    let stack = |a: &Array| {
        let mut s = a.shape();
        s[0] = n as i32;
        s.insert(0, e as i32);
        a.reshape(&s).unwrap()
    };
    Codebook { codes: stack(&cb.codes), qh: stack(&cb.qh), scales: stack(&cb.scales) }
}

fn with_scales(cb: &Codebook, scales: &Array) -> Codebook {
    Codebook { codes: cb.codes.clone(), qh: cb.qh.clone(), scales: scales.clone() }
}

// K = 320: one full 256-weight super-block and one short one (two 32-blocks), so the short-super-block scale
// indexing is differentiated too.
const K: usize = 320;

#[test]
fn codebook_qmm_x_and_scales() {
    cpu(|| {
        let cb = codebook_weights(0, 24, K, 1);
        let x = randn(&[2, 3, K as i32], 2);
        compare(
            "codebook_qmm",
            |a| codebook::codebook_qmm(&a[0], &with_scales(&cb, &a[1])),
            |a| a[0].matmul(&codebook::dequantize_reference(&with_scales(&cb, &a[1]))?.swapaxes(-1, -2)?),
            &[x, cb.scales.clone()],
            &[0, 1],
        );
    });
}

#[test]
fn gather_codebook_qmm_x_and_scales() {
    cpu(|| {
        let cb = codebook_weights(4, 16, K, 3);
        let x = randn(&[3, 1, K as i32], 4);
        // Six (token, expert) pairs over three tokens: x's gradient sums over the pairs of each token.
        let lhs = Array::from_slice(&[0u32, 0, 1, 2, 2, 1], &[6]).unwrap();
        let rhs = Array::from_slice(&[1u32, 0, 2, 1, 3, 1], &[6]).unwrap();
        compare(
            "gather_codebook_qmm",
            |a| codebook::gather_codebook_qmm(&a[0], &with_scales(&cb, &a[1]), Some(&lhs), Some(&rhs)),
            |a| {
                let w = codebook::dequantize_reference(&with_scales(&cb, &a[1]))?.swapaxes(-1, -2)?;
                ops::gather_mm(&a[0], &w, Some(&lhs), Some(&rhs), false)
            },
            &[x, cb.scales.clone()],
            &[0, 1],
        );
    });
}

fn affine(q: &Quantized, scales: &Array, biases: &Array) -> Quantized {
    Quantized { weight: q.weight.clone(), scales: scales.clone(), biases: Some(biases.clone()) }
}

#[test]
fn affine_fast_path_x_scales_and_biases() {
    cpu(|| {
        for (bits, group) in [(4, 64), (2, 32), (8, 64)] {
            let spec = QuantSpec::affine(group, bits);
            let q = quant::quantize(&randn(&[24, K as i32], 5), spec, None).unwrap();
            let x = randn(&[4, K as i32], 6);
            compare(
                "affine_qmm",
                |a| kernels::fast_quantized_matmul(&a[0], &affine(&q, &a[1], &a[2]), spec),
                |a| {
                    let w = quant::dequantize(&affine(&q, &a[1], &a[2]), spec, None, Some(Dtype::F32))?;
                    a[0].matmul(&w.swapaxes(-1, -2)?)
                },
                &[x, q.scales.clone(), q.biases.clone().unwrap()],
                &[0, 1, 2],
            );
        }
    });
}

#[test]
fn affine_fast_path_gathered_and_multi() {
    cpu(|| {
        let spec = QuantSpec::affine(64, 4);
        let q = quant::quantize(&randn(&[3, 16, K as i32], 7), spec, None).unwrap();
        let x = randn(&[4, 1, K as i32], 8);
        let rhs = Array::from_slice(&[2u32, 0, 2, 1], &[4]).unwrap();
        compare(
            "gather_affine_qmm",
            |a| kernels::gather_qmm(&a[0], &affine(&q, &a[1], &a[2]), spec, None, Some(&rhs), false),
            |a| {
                let w = quant::dequantize(&affine(&q, &a[1], &a[2]), spec, None, Some(Dtype::F32))?;
                ops::gather_mm(&a[0], &w.swapaxes(-1, -2)?, None, Some(&rhs), false)
            },
            &[x, q.scales.clone(), q.biases.clone().unwrap()],
            &[0, 1, 2],
        );
        // Two projections of the same x as one node (a KDA layer's projections): x's gradient sums both.
        let q1 = quant::quantize(&randn(&[16, K as i32], 9), spec, None).unwrap();
        let q2 = quant::quantize(&randn(&[8, K as i32], 10), spec, None).unwrap();
        let x = randn(&[3, K as i32], 11);
        let both = |a: &[Array], f: &dyn Fn(&Quantized, &Array) -> Result<Array>| -> Result<Array> {
            let y1 = f(&affine(&q1, &a[1], &a[2]), &a[0])?;
            let y2 = f(&affine(&q2, &a[3], &a[4]), &a[0])?;
            ops::concatenate(&[&y1, &y2], -1)
        };
        compare(
            "affine_qmm_multi",
            |a| {
                let ys = kernels::fast_quantized_matmul_many(
                    &a[0],
                    &[(&affine(&q1, &a[1], &a[2]), spec), (&affine(&q2, &a[3], &a[4]), spec)],
                )?;
                ops::concatenate(&[&ys[0], &ys[1]], -1)
            },
            |a| both(a, &|q, x| x.matmul(&quant::dequantize(q, spec, None, Some(Dtype::F32))?.swapaxes(-1, -2)?)),
            &[x, q1.scales.clone(), q1.biases.clone().unwrap(), q2.scales.clone(), q2.biases.clone().unwrap()],
            &[0, 1, 2, 3, 4],
        );
    });
}

#[test]
fn mxfp4_fast_path_x() {
    cpu(|| {
        let spec = QuantSpec::default_for(QuantMode::Mxfp4);
        let q = quant::quantize(&randn(&[24, K as i32], 12), spec, None).unwrap();
        let w = quant::dequantize(&q, spec, None, Some(Dtype::F32)).unwrap();
        compare(
            "mxfp4_qmm",
            |a| kernels::fast_quantized_matmul(&a[0], &q, spec),
            |a| a[0].matmul(&w.swapaxes(-1, -2)?),
            &[randn(&[2, K as i32], 13)],
            &[0],
        );
    });
}

#[test]
fn gather_tiered_qmm_x_codebook_scales_and_affine_scales_biases() {
    cpu(|| {
        // Six experts: two codebook, two MXFP4, two affine, interleaved so slots differ from expert ids.
        let tiers = [Tier::Affine, Tier::Codebook, Tier::Mxfp4, Tier::Codebook, Tier::Affine, Tier::Mxfp4];
        let spec = QuantSpec::affine(64, 4);
        let (t, _) = tiered::build_tiered(&randn(&[6, 16, K as i32], 14), &tiers, spec, None).unwrap();
        let cb = t.codebook.clone().unwrap();
        let (aq, _) = t.affine.clone().unwrap();
        let with = |a: &[Array]| TieredExperts {
            tier: t.tier.clone(),
            slot: t.slot.clone(),
            codebook: Some(with_scales(&cb, &a[1])),
            mxfp4: t.mxfp4.clone(),
            affine: Some((affine(&aq, &a[2], &a[3]), spec)),
        };
        let x = randn(&[4, 1, K as i32], 15);
        let lhs = Array::from_slice(&[0u32, 1, 1, 2, 3, 3, 0], &[7]).unwrap();
        let rhs = Array::from_slice(&[1u32, 0, 5, 3, 4, 2, 0], &[7]).unwrap();
        compare(
            "gather_tiered_qmm",
            |a| tiered::gather_tiered_qmm(&a[0], &with(a), Some(&lhs), Some(&rhs)),
            |a| {
                let w = tiered::dequantize_tiered(&with(a))?.swapaxes(-1, -2)?;
                ops::gather_mm(&a[0], &w, Some(&lhs), Some(&rhs), false)
            },
            &[x, cb.scales.clone(), aq.scales.clone(), aq.biases.clone().unwrap()],
            &[0, 1, 2, 3],
        );
    });
}

#[test]
fn no_gradient_for_packed_bits_and_zero_for_indices() {
    cpu(|| {
        let cb = codebook_weights(2, 8, 64, 16);
        let x = randn(&[2, 1, 64], 17);
        let rhs = Array::from_slice(&[1u32, 0], &[2]).unwrap();
        // The packed codes: a named error, not a wrong gradient.
        let err = transforms::grad(
            |a: &[Array]| {
                let c = Codebook { codes: a[1].clone(), qh: cb.qh.clone(), scales: cb.scales.clone() };
                Ok(vec![codebook::gather_codebook_qmm(&a[0], &c, None, Some(&rhs))?.sum_all(false)?])
            },
            &[x.clone(), cb.codes.clone()],
            &[1],
        )
        .unwrap_err();
        assert!(err.to_string().contains("not to the packed weight bits"), "{err}");
        // The expert indices: zeros (they select, they do not scale).
        let g = transforms::grad(
            |a: &[Array]| Ok(vec![codebook::gather_codebook_qmm(&a[0], &cb, None, Some(&a[1]))?.sum_all(false)?]),
            &[x, rhs],
            &[1],
        )
        .unwrap();
        assert_eq!(g[0].to_vec::<u32>().unwrap(), vec![0, 0]);
    });
}

/// Items 1 and 2 together, as DWQ uses them: the codebook's f16 super-block scales trained by Adam (f32 master
/// copies) to match a float teacher's outputs on fixed activations, gradients through `codebook_qmm`'s vjp.
/// The distillation loss must fall at every one of the first ten steps and end well below where it started
/// (measured: 165.5 -> 126.5 over 30 steps at lr 1e-3, falling at every step; the bound is 0.85x).
#[test]
fn adam_on_codebook_scales_lowers_the_distillation_loss() {
    cpu(|| {
        let (n, k) = (32usize, 512usize);
        let w = randn(&[n as i32, k as i32], 20);
        let (h, _) = codebook::quantize(&w.to_vec_f32().unwrap(), n, k, None).unwrap();
        let cb = h.to_arrays().unwrap();
        let x = randn(&[16, k as i32], 21);
        let teacher = x.matmul(&w.swapaxes(-1, -2).unwrap()).unwrap();
        let loss = |a: &[Array]| -> Result<Vec<Array>> {
            let y = codebook::codebook_qmm(&x, &with_scales(&cb, &a[0]))?;
            Ok(vec![y.subtract(&teacher)?.square()?.mean_all(false)?])
        };
        let mut opt = mlx_k3::optim::Adam::new(1e-3).unwrap();
        opt.add("scales", &cb.scales).unwrap();
        let mut losses = Vec::new();
        for _ in 0..30 {
            let (v, g) = transforms::value_and_grad(loss, &[opt.param("scales").unwrap()], &[0]).unwrap();
            losses.push(v[0].item::<f32>().unwrap());
            opt.update(&[("scales", &g[0])]).unwrap();
        }
        assert!(losses.windows(2).take(10).all(|p| p[1] < p[0]), "{losses:?}");
        assert!(losses[29] < 0.85 * losses[0], "{losses:?}");
    });
}

/// The backward of a gathered codebook or tiered product dequantizes only the experts the pairs route to
/// (docs/architecture.md): with a subset of the stack routed, the gradients equal the whole-stack reference's,
/// the unrouted experts' scales get exact zeros, and the backward's peak memory stays below one f32 copy of
/// the whole stack (which the whole-stack path must hold: 64 experts of 64 × 256, 4 MiB).
#[test]
fn gathered_backward_reads_only_the_routed_experts() {
    cpu(|| {
        // Codebook stack, experts 1 and 4 of 6 routed.
        let cb = codebook_weights(6, 16, K, 30);
        let x = randn(&[3, 1, K as i32], 31);
        let lhs = Array::from_slice(&[0u32, 1, 2, 2], &[4]).unwrap();
        let rhs = Array::from_slice(&[4u32, 1, 1, 4], &[4]).unwrap();
        let ours = |a: &[Array]| codebook::gather_codebook_qmm(&a[0], &with_scales(&cb, &a[1]), Some(&lhs), Some(&rhs));
        compare(
            "gather_codebook_qmm",
            ours,
            |a| {
                let w = codebook::dequantize_reference(&with_scales(&cb, &a[1]))?.swapaxes(-1, -2)?;
                ops::gather_mm(&a[0], &w, Some(&lhs), Some(&rhs), false)
            },
            &[x.clone(), cb.scales.clone()],
            &[0, 1],
        );
        let g =
            transforms::grad(|a: &[Array]| Ok(vec![ours(a)?.sum_all(false)?]), &[x, cb.scales.clone()], &[1]).unwrap();
        let per = (g[0].size() / 6) as usize;
        let gv = g[0].to_vec_f32().unwrap();
        for e in 0..6 {
            let any = gv[e * per..(e + 1) * per].iter().any(|v| *v != 0.0);
            assert_eq!(any, e == 1 || e == 4, "expert {e}: gradient nonzero = {any}");
        }

        // Tiered stack, experts 0 (affine) and 3 (codebook) routed: the MXFP4 tier is not read at all.
        let tiers = [Tier::Affine, Tier::Codebook, Tier::Mxfp4, Tier::Codebook, Tier::Affine, Tier::Mxfp4];
        let spec = QuantSpec::affine(64, 4);
        let (t, _) = tiered::build_tiered(&randn(&[6, 16, K as i32], 32), &tiers, spec, None).unwrap();
        let tcb = t.codebook.clone().unwrap();
        let (aq, _) = t.affine.clone().unwrap();
        let with = |a: &[Array]| TieredExperts {
            tier: t.tier.clone(),
            slot: t.slot.clone(),
            codebook: Some(with_scales(&tcb, &a[1])),
            mxfp4: t.mxfp4.clone(),
            affine: Some((affine(&aq, &a[2], &a[3]), spec)),
        };
        let x = randn(&[4, 1, K as i32], 33);
        let lhs = Array::from_slice(&[0u32, 1, 2, 3, 3], &[5]).unwrap();
        let rhs = Array::from_slice(&[3u32, 0, 0, 3, 0], &[5]).unwrap();
        compare(
            "gather_tiered_qmm",
            |a| tiered::gather_tiered_qmm(&a[0], &with(a), Some(&lhs), Some(&rhs)),
            |a| {
                let w = tiered::dequantize_tiered(&with(a))?.swapaxes(-1, -2)?;
                ops::gather_mm(&a[0], &w, Some(&lhs), Some(&rhs), false)
            },
            &[x, tcb.scales.clone(), aq.scales.clone(), aq.biases.clone().unwrap()],
            &[0, 1, 2, 3],
        );

        // Peak memory of the backward with 2 of 64 experts routed; with all 64 routed (the whole stack is
        // then dequantized, as it must be) the same measurement sees at least the f32 stack.
        let (e, n, k) = (64usize, 64usize, 256usize);
        let big = codebook_weights(e, n, k, 34);
        let peak = |tokens: usize, rhs: &[u32]| -> usize {
            let x = randn(&[tokens as i32, 1, k as i32], 35);
            let rhs = Array::from_slice(rhs, &[rhs.len() as i32]).unwrap();
            mlx_k3::eval(&[&big.codes, &big.qh, &big.scales, &x, &rhs]).unwrap();
            mlx_k3::memory::clear_cache();
            let base = mlx_k3::memory::active();
            mlx_k3::memory::reset_peak();
            let g = transforms::grad(
                |a: &[Array]| {
                    let y = codebook::gather_codebook_qmm(&x, &with_scales(&big, &a[0]), None, Some(&rhs))?;
                    Ok(vec![y.sum_all(false)?])
                },
                &[big.scales.clone()],
                &[0],
            )
            .unwrap();
            g[0].eval().unwrap();
            mlx_k3::memory::peak().saturating_sub(base)
        };
        let whole = e * n * k * 4;
        let two = peak(2, &[7, 50]);
        let all = peak(e, &(0..e as u32).collect::<Vec<_>>());
        eprintln!(
            "backward peak above the inputs: {two} bytes with 2 experts routed, {all} with all {e} (f32 stack {whole})"
        );
        assert!(all >= whole, "the measurement misses the whole stack: {all} < {whole}");
        assert!(two < whole / 4, "the backward held {two} bytes, a whole f32 stack is {whole}");
    });
}
