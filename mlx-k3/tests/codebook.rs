//! The ternary codebook format and the packed-weight kernels.
//!
//! Decoding is checked bit for bit against the `gguf` package's IQ1_S dequantization (fixtures made by
//! scripts/make_codebook_fixtures.py). Kernels are checked against plain-ops references: the codebook matmul
//! against MLX ops that dequantize then matmul, the fast affine/mxfp4 paths against MLX's own
//! quantized_matmul / gather_qmm. Tolerance for kernels: the same products summed in another order; with
//! K <= 1024 terms the difference stays below ~1e-6 of the largest |output|, checked at 2e-5 (f32).

use std::path::{Path, PathBuf};

use half::f16;
use mlx_k3::codebook::{self, Codebook, CodebookHost};
use mlx_k3::gguf::GgufFile;
use mlx_k3::io::Safetensors;
use mlx_k3::quant::{self, Gather, QuantMode, QuantSpec, Quantized};
use mlx_k3::tiered::{self, Tier, TieredExperts};
use mlx_k3::{kernels, ops, random, Array, Dtype};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/codebook").join(name)
}

fn randn(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::F32, 0.0, 1.0, Some(&random::key(seed).unwrap())).unwrap()
}

/// force_scalar and the q8 activation mode are process-wide: tests that toggle them, and tests of kernels
/// they affect, hold this lock so each checks the path it names.
static SCALAR: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rel_err(got: &Array, want: &Array) -> f32 {
    rel_err_vec(&got.to_vec_f32().unwrap(), &want.to_vec_f32().unwrap())
}

/// A random codebook matrix: random valid planes (any index, scale, sign is a valid IQ1_S block).
fn random_codebook(n: usize, k: usize, seed: u64) -> CodebookHost {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    CodebookHost {
        n,
        k,
        codes: (0..n * k / 8).map(|_| next() as u8).collect(),
        qh: (0..n * k / 32).map(|_| next() as u16).collect(),
        scales: (0..n * codebook::super_blocks(k))
            .map(|_| f16::from_f32(((next() % 1000) as f32 / 1000.0 + 0.05) * 0.02))
            .collect(),
    }
}

#[test]
fn decoding_is_bit_exact_with_gguf() {
    let st = Safetensors::load(fixture("iq1s_blocks.safetensors")).unwrap();
    let blocks = st.get("blocks").unwrap().to_vec::<u8>().unwrap();
    let want = st.get("decoded").unwrap().to_vec::<f32>().unwrap();
    let n = want.len() / 256;
    let h = codebook::from_iq1s_blocks(&blocks, n, 256).unwrap();
    let got = codebook::decode_host(&h);
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    // The MLX plain-ops dequantization is the same arithmetic, so also bit-exact.
    let mlx = codebook::dequantize_reference(&h.to_arrays().unwrap()).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(
        mlx.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn gguf_import_is_bit_exact_and_errors_name_the_problem() {
    let g = GgufFile::open(fixture("tiny_iq1s.gguf")).unwrap();
    let h = g.iq1s_tensor("blk.0.ffn_up.weight").unwrap();
    assert_eq!((h.n, h.k), (4, 512));
    let want = Safetensors::load(fixture("tiny_iq1s_expected.safetensors")).unwrap().get("weight").unwrap();
    let want = want.to_vec::<f32>().unwrap();
    assert_eq!(codebook::decode_host(&h), want);
    let norm = g.f32_tensor("blk.0.attn_norm.weight").unwrap();
    assert_eq!((norm.len(), norm[0], norm[511]), (512, -1.0, 1.0));
    // Bad input.
    let e = g.iq1s_tensor("nope").unwrap_err().to_string();
    assert!(e.contains("nope") && e.contains("tiny_iq1s.gguf"), "{e}");
    let e = g.iq1s_tensor("blk.0.attn_norm.weight").unwrap_err().to_string();
    assert!(e.contains("not IQ1_S"), "{e}");
    let bytes = std::fs::read(fixture("tiny_iq1s.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("cut.gguf");
    // Cut inside the f32 tensor (the last one), then inside the IQ1_S tensor.
    std::fs::write(&cut, &bytes[..bytes.len() - 700]).unwrap();
    let e = GgufFile::open(&cut).and_then(|g| g.f32_tensor("blk.0.attn_norm.weight")).unwrap_err().to_string();
    assert!(e.contains("cut.gguf") && e.contains("truncated") && e.contains("attn_norm"), "{e}");
    std::fs::write(&cut, &bytes[..bytes.len() - 2300]).unwrap();
    let e = GgufFile::open(&cut).and_then(|g| g.iq1s_tensor("blk.0.ffn_up.weight")).unwrap_err().to_string();
    assert!(e.contains("cut.gguf") && e.contains("truncated") && e.contains("ffn_up"), "{e}");
    for len in [3, 40, 100] {
        std::fs::write(&cut, &bytes[..len]).unwrap();
        assert!(GgufFile::open(&cut).is_err());
    }
    std::fs::write(&cut, b"NOPE and more bytes here").unwrap();
    assert!(GgufFile::open(&cut).unwrap_err().to_string().contains("magic"));
}

fn check_codebook_qmm(m: i32, n: usize, k: usize, seed: u64) -> f32 {
    let cb = random_codebook(n, k, seed).to_arrays().unwrap();
    let x = randn(&[m, k as i32], seed + 1);
    let got = codebook::codebook_qmm(&x, &cb).unwrap();
    let want = x.matmul(&codebook::dequantize_reference(&cb).unwrap().t().unwrap()).unwrap();
    assert_eq!(got.shape(), [m, n as i32]);
    let e = rel_err(&got, &want);
    assert!(e <= 2e-5, "codebook_qmm m={m} n={n} k={k}: rel err {e}");
    e
}

#[test]
fn codebook_qmm_matches_dequantize_then_matmul() {
    let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    for scalar in [false, true] {
        kernels::force_scalar(scalar);
        let mut worst = 0f32;
        // K % 256 != 0 (a short last super-block): 32, 96, 128, 288, 416.
        for (m, n, k) in [
            (1, 1, 256),
            (1, 300, 1024),
            (3, 65, 512),
            (4, 64, 256),
            (7, 33, 768),
            (33, 17, 256),
            (1, 70, 32),
            (2, 33, 96),
            (1, 64, 128),
            (5, 20, 288),
            (1, 41, 416),
        ] {
            worst = worst.max(check_codebook_qmm(m, n, k, (m * 7 + n as i32) as u64));
        }
        println!("codebook_qmm (scalar={scalar}): worst rel err {worst:e}");
    }
    kernels::force_scalar(false);
    // Batched x keeps its leading dims; f16 inputs come back as f16.
    let cb = random_codebook(8, 256, 5).to_arrays().unwrap();
    let x = randn(&[2, 3, 256], 9).astype(Dtype::F16).unwrap();
    let y = codebook::codebook_qmm(&x, &cb).unwrap();
    assert_eq!((y.shape(), y.dtype()), (vec![2, 3, 8], Dtype::F16));
}

#[test]
fn gather_codebook_qmm_matches_per_expert_references() {
    for k in [512usize, 160] {
        check_gather_codebook_qmm(k);
    }
}

/// A stack of `e` random codebook experts [E, N, K] and its plain-ops dequantization.
fn codebook_stack(e: usize, n: usize, k: usize) -> (Codebook, Array) {
    let hosts: Vec<CodebookHost> = (0..e).map(|i| random_codebook(n, k, 100 + i as u64)).collect();
    let stack = |f: &dyn Fn(&CodebookHost) -> Array| {
        let parts: Vec<Array> = hosts.iter().map(f).collect();
        ops::stack(&parts.iter().collect::<Vec<_>>(), 0).unwrap()
    };
    let cb = Codebook {
        codes: stack(&|h| h.to_arrays().unwrap().codes),
        qh: stack(&|h| h.to_arrays().unwrap().qh),
        scales: stack(&|h| h.to_arrays().unwrap().scales),
    };
    let deq = codebook::dequantize_reference(&cb).unwrap();
    (cb, deq)
}

fn check_gather_codebook_qmm(k: usize) {
    let n = 40usize;
    let (cb, deq) = codebook_stack(6, n, k); // deq [E, N, K]
    let lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    for scalar in [false, true] {
        kernels::force_scalar(scalar);
        // SwitchGLU decode shape: x (B=2, T=3, 1, 1, K), rhs (2, 3, k=2) -> (2, 3, 2, 1, N).
        let x = randn(&[2, 3, 1, 1, k as i32], 1);
        let rhs = Array::from_slice(&[5u32, 0, 2, 2, 1, 3, 0, 0, 4, 1, 3, 5], &[2, 3, 2]).unwrap();
        let got = codebook::gather_codebook_qmm(&x, &cb, None, Some(&rhs)).unwrap();
        let want = ops::gather_mm(&x, &deq.swapaxes(-1, -2).unwrap(), None, Some(&rhs), false).unwrap();
        assert_eq!(got.shape(), [2, 3, 2, 1, n as i32]);
        let err = rel_err(&got, &want);
        assert!(err <= 2e-5, "unsorted: {err}");
        // Sorted prefill shape: x (P, 1, K) with lhs/rhs, and several rows per expert.
        let x = randn(&[10, 3, k as i32], 2);
        let lhs = Array::from_slice(&[0u32, 1, 2, 3, 4, 5, 6, 7], &[8]).unwrap();
        let rhs = Array::from_slice(&[0u32, 0, 0, 2, 2, 3, 5, 5], &[8]).unwrap();
        let got = codebook::gather_codebook_qmm(&x, &cb, Some(&lhs), Some(&rhs)).unwrap();
        let want = ops::gather_mm(&x, &deq.swapaxes(-1, -2).unwrap(), Some(&lhs), Some(&rhs), true).unwrap();
        assert_eq!(got.shape(), [8, 3, n as i32]);
        let err = rel_err(&got, &want);
        assert!(err <= 2e-5, "sorted: {err}");
    }
    kernels::force_scalar(false);
    drop(lock);
    // An expert index past the stack is an error at evaluation, not a crash.
    let x = randn(&[1, 1, k as i32], 3);
    let bad = Array::from_slice(&[9u32], &[1]).unwrap();
    let e = codebook::gather_codebook_qmm(&x, &cb, None, Some(&bad)).and_then(|y| y.eval()).unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
}

#[test]
fn bad_codebook_shapes_are_named_errors() {
    let cb = random_codebook(4, 256, 1).to_arrays().unwrap();
    // x's K (128) against K = 256 weights: named by qh, whose shape follows K in either layout (the compact codes
    // of K = 256 have the ternary trits' width for K = 128).
    let e = codebook::codebook_qmm(&randn(&[1, 128], 1), &cb).unwrap_err().to_string();
    assert!(e.contains("[codebook_qmm]") && e.contains("qh") && e.contains("shape"), "{e}");
    let e = codebook::codebook_qmm(&randn(&[1, 512], 1), &cb).unwrap_err().to_string();
    assert!(e.contains("[codebook_qmm]") && e.contains("shape"), "{e}");
    let e = codebook::codebook_qmm(&randn(&[1, 100], 1), &cb).unwrap_err().to_string();
    assert!(e.contains("[codebook_qmm]") && e.contains("not a multiple of 32"), "{e}");
    // A short last super-block still needs its scale: [4, 1] scales for K = 288 (two super-blocks) is named.
    let short = random_codebook(4, 288, 2).to_arrays().unwrap();
    let bad = Codebook { scales: short.scales.slice_axis(1, 0, 1).unwrap(), ..short };
    let e = codebook::codebook_qmm(&randn(&[1, 288], 1), &bad).unwrap_err().to_string();
    assert!(e.contains("scales") && e.contains("shape"), "{e}");
    let bad = Codebook { codes: cb.codes.astype(Dtype::I32).unwrap(), ..cb.clone() };
    let e = codebook::codebook_qmm(&randn(&[1, 256], 1), &bad).unwrap_err().to_string();
    assert!(e.contains("codes") && e.contains("dtype"), "{e}");
    let bad = Codebook { qh: cb.qh.slice_axis(1, 0, 4).unwrap(), ..cb };
    let e = codebook::codebook_qmm(&randn(&[1, 256], 1), &bad).unwrap_err().to_string();
    assert!(e.contains("qh") && e.contains("shape"), "{e}");
}

#[test]
fn quantizer_is_deterministic_and_honours_importance() {
    let (n, k) = (24usize, 512usize);
    let w = randn(&[n as i32, k as i32], 11).to_vec::<f32>().unwrap();
    let (a, ra) = codebook::quantize(&w, n, k, None).unwrap();
    let (b, rb) = codebook::quantize(&w, n, k, None).unwrap();
    assert_eq!(a, b, "deterministic");
    assert_eq!(ra, rb);
    // IQ1_S on Gaussian weights keeps the sign and rough size of each weight: relative squared error well
    // below 1 (0 would be lossless, 1 is as bad as all-zero), and the decode matches what was reported.
    assert!(ra.plain_rel_err < 0.35, "{ra:?}");
    let dec = codebook::decode_host(&a);
    let num: f64 = dec.iter().zip(&w).map(|(d, x)| ((d - x) as f64).powi(2)).sum();
    let den: f64 = w.iter().map(|x| (*x as f64).powi(2)).sum();
    assert!((num / den - ra.plain_rel_err).abs() < 1e-9, "report {} vs measured {}", ra.plain_rel_err, num / den);
    // Importance on every 4th column lowers those columns' error relative to uniform importance (importance
    // acts within each 32-weight block, where it decides which values the ternary levels fit best).
    let imp: Vec<f32> = (0..k).map(|j| if j % 4 == 0 { 100.0 } else { 0.01 }).collect();
    let (c, rc) = codebook::quantize(&w, n, k, Some(&imp)).unwrap();
    let (u, _) = codebook::quantize(&w, n, k, Some(&vec![1.0; k])).unwrap();
    let col_err = |h: &CodebookHost| {
        let d = codebook::decode_host(h);
        (0..n)
            .flat_map(|r| (0..k).step_by(4).map(move |j| r * k + j))
            .map(|i| ((d[i] - w[i]) as f64).powi(2))
            .sum::<f64>()
    };
    assert!(col_err(&c) < col_err(&u), "important columns: {} vs {}", col_err(&c), col_err(&u));
    let (_, ru) = codebook::quantize(&w, n, k, Some(&vec![1.0; k])).unwrap();
    println!(
        "IQ1_S quantizer on N(0,1): plain rel err {:.4} (x^2 weighting), {:.4} (uniform importance); \
         every-4th-column importance: weighted {:.4}",
        ra.plain_rel_err, ru.plain_rel_err, rc.weighted_rel_err
    );
    assert!(codebook::quantize(&w, n, 500, None).is_err());
    assert!(codebook::quantize(&w[..10], n, k, None).is_err());
    assert!(codebook::quantize(&w, n, k, Some(&[1.0; 3])).is_err());
}

fn check_fast_path(spec: QuantSpec, m: i32, n: i32, k: i32, seed: u64) -> f32 {
    let w = randn(&[n, k], seed);
    let q = quant::quantize(&w, spec, None).unwrap();
    let x = randn(&[m, k], seed + 1);
    let got = kernels::fast_quantized_matmul(&x, &q, spec).unwrap();
    let want = quant::quantized_matmul(&x, &q, spec, true).unwrap();
    let e = rel_err(&got, &want);
    assert!(e <= 2e-5, "{spec:?} m={m}: rel err {e}");
    e
}

/// Each output row is computed by exactly one task, so the kernels' results cannot depend on how the thread
/// pool splits the rows: outputs with 2, 3 and 8 threads (8 oversubscribes a small machine, so idle threads
/// poll, yield and sleep between calls) are bit-identical to one thread's, over many back-to-back calls (a
/// lost, repeated or still-running task would show as a differing row).
#[test]
fn kernels_are_bit_identical_for_any_thread_count() {
    let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    let cb = random_codebook(515, 512, 7).to_arrays().unwrap();
    let specs = [QuantSpec::affine(64, 4), QuantSpec::affine(32, 2), QuantSpec::affine(64, 8)];
    let ws: Vec<Quantized> =
        specs.iter().map(|s| quant::quantize(&randn(&[515, 512], 11), *s, None).unwrap()).collect();
    let run = |x: &Array| -> Vec<Vec<u32>> {
        let mut outs: Vec<Array> =
            specs.iter().zip(&ws).map(|(s, q)| kernels::fast_quantized_matmul(x, q, *s).unwrap()).collect();
        outs.push(codebook::codebook_qmm(x, &cb).unwrap());
        outs.iter().map(|o| o.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect()).collect()
    };
    let xs: Vec<Array> = (0..3).map(|i| randn(&[1 + 2 * i, 512], 20 + i as u64)).collect();
    kernels::set_num_threads(1);
    let want: Vec<_> = xs.iter().map(&run).collect();
    for threads in [2, 3, 8] {
        kernels::set_num_threads(threads);
        for rep in 0..20 {
            for (x, w) in xs.iter().zip(&want) {
                assert!(run(x) == *w, "{threads} threads, call {rep}: outputs differ from one thread's");
            }
        }
    }
    kernels::set_num_threads(0);
}

#[test]
fn fast_affine_and_mxfp4_match_mlx() {
    let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    // MLX's own formats have only SIMD kernels here (elsewhere the op runs MLX's kernel), so one pass.
    {
        let mut worst = 0f32;
        for bits in [2, 3, 4, 5, 6, 8] {
            for group in [32, 64, 128] {
                for m in [1, 3, 5] {
                    worst = worst.max(check_fast_path(
                        QuantSpec::affine(group, bits),
                        m,
                        70,
                        512,
                        (bits * group + m) as u64,
                    ));
                }
            }
        }
        // The 2-bit kernel reads 128 values of a row at a time; K % 128 of 32, 64 or 96 takes its per-block tail.
        // An odd row count leaves a single-row tile.
        for (group, k) in [(32, 544), (64, 576), (32, 608), (64, 704), (128, 640)] {
            for m in [1, 2, 4, 6] {
                worst = worst.max(check_fast_path(QuantSpec::affine(group, 2), m, 71, k, (k + m) as u64));
            }
        }
        for m in [1, 4, 9] {
            worst = worst.max(check_fast_path(QuantSpec::default_for(QuantMode::Mxfp4), m, 70, 512, m as u64));
        }
        // Scales and biases as the checkpoint stores them (f16 / bf16, quantized from f16 / bf16 weights): the
        // kernels read them directly; both q8 and f32 activations.
        for dt in [Dtype::F16, Dtype::BF16] {
            for (bits, group) in [(2, 64), (4, 32), (8, 128), (3, 64)] {
                let spec = QuantSpec::affine(group, bits);
                let w = randn(&[70, 512], 90 + bits as u64).astype(dt).unwrap();
                let q = quant::quantize(&w, spec, None).unwrap();
                assert_eq!(q.scales.dtype(), dt);
                let x = randn(&[3, 512], 91);
                let got = kernels::fast_quantized_matmul(&x, &q, spec).unwrap();
                let q32 = quant::Quantized {
                    weight: q.weight.clone(),
                    scales: q.scales.astype(Dtype::F32).unwrap(),
                    biases: Some(q.biases.as_ref().unwrap().astype(Dtype::F32).unwrap()),
                };
                // The same values as f32 arrays: identical products, so identical results.
                let want = kernels::fast_quantized_matmul(&x, &q32, spec).unwrap();
                assert_eq!(got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap(), "{dt:?} {spec:?}");
                let e = rel_err(&got, &quant::quantized_matmul(&x, &q, spec, true).unwrap());
                assert!(e <= 2e-5, "{dt:?} {spec:?} vs MLX: {e}");
                kernels::set_qmm_activations(Some(kernels::QmmActivations::Q8));
                let (g8, w8) = (
                    kernels::fast_quantized_matmul(&x, &q, spec).unwrap(),
                    kernels::fast_quantized_matmul(&x, &q32, spec).unwrap(),
                );
                kernels::set_qmm_activations(None);
                assert_eq!(g8.to_vec_f32().unwrap(), w8.to_vec_f32().unwrap(), "q8 {dt:?} {spec:?}");
                worst = worst.max(e);
            }
        }
        println!("fast affine/mxfp4: worst rel err vs MLX {worst:e}");
    }
}

#[test]
fn fast_gather_qmm_matches_mlx() {
    let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    for (spec, dt) in [
        (QuantSpec::affine(64, 4), Dtype::F32),
        (QuantSpec::affine(32, 2), Dtype::F32),
        (QuantSpec::affine(32, 3), Dtype::F32),
        (QuantSpec::affine(64, 6), Dtype::F32),
        (QuantSpec::default_for(QuantMode::Mxfp4), Dtype::F32),
        (QuantSpec::affine(64, 2), Dtype::BF16),
        (QuantSpec::affine(32, 8), Dtype::F16),
    ] {
        let w = randn(&[5, 48, 256], 7).astype(dt).unwrap();
        let q = quant::quantize(&w, spec, None).unwrap();
        let x = randn(&[2, 4, 1, 1, 256], 8);
        let rhs = Array::from_slice(&[0u32, 4, 1, 1, 3, 2, 2, 0], &[2, 4, 1]).unwrap();
        mlx_k3::eval(&[&x, &rhs, &q.weight, &q.scales]).unwrap();
        let got = kernels::gather_qmm(&x, &q, spec, None, Some(&rhs), false).unwrap();
        if dt == Dtype::F32 {
            // The op is one graph node: the index operands go in as they are (no arange, broadcast or flatten
            // nodes; the primitive broadcasts them itself).
            assert_eq!(mlx_k3::graph_nodes(&[&got], None).unwrap(), 1, "{spec:?}");
        }
        let want =
            quant::gather_qmm(&x, &q, spec, true, Gather { rhs_indices: Some(&rhs), ..Default::default() }).unwrap();
        assert_eq!(got.shape(), want.shape());
        let e = rel_err(&got, &want);
        assert!(e <= 2e-5, "{spec:?}: {e}");
        // The other index forms of MLX's gather_qmm, against MLX's op: no indices (x's batch runs over the
        // experts), lhs and rhs that broadcast against each other, and strided (transposed) index views.
        let x5 = randn(&[5, 3, 256], 9);
        let lhs = Array::from_slice(&[2u32, 0, 1, 1, 0, 2], &[3, 2]).unwrap().transpose(&[1, 0]).unwrap(); // [2, 3]
        let rhs_b = Array::from_slice(&[4u32, 0, 3], &[3, 1]).unwrap().transpose(&[1, 0]).unwrap(); // [1, 3]
        let x3 = randn(&[3, 2, 256], 10);
        for (x, lhs, rhs) in [(&x5, None, None), (&x3, Some(&lhs), Some(&rhs_b)), (&x3, None, Some(&rhs_b))] {
            let g = Gather { lhs_indices: lhs, rhs_indices: rhs, ..Default::default() };
            let want = quant::gather_qmm(x, &q, spec, true, g).unwrap();
            let got = kernels::gather_qmm(x, &q, spec, lhs, rhs, false).unwrap();
            assert_eq!(
                got.shape(),
                want.shape(),
                "{spec:?} lhs {:?} rhs {:?}",
                lhs.map(|a| a.shape()),
                rhs.map(|a| a.shape())
            );
            let e = rel_err(&got, &want);
            assert!(e <= 2e-5, "{spec:?} lhs {:?} rhs {:?}: {e}", lhs.map(|a| a.shape()), rhs.map(|a| a.shape()));
        }
    }
}

#[test]
fn gather_tiered_qmm_matches_the_dequantized_stack_on_both_paths() {
    let (e, n, k) = (6, 40, 512);
    let w = randn(&[e, n, k], 21).multiply(0.05f32).unwrap();
    let tiers_of = [Tier::Codebook, Tier::Mxfp4, Tier::Affine, Tier::Codebook, Tier::Affine, Tier::Mxfp4];
    // 3-bit affine: the odd-width AVX2 decoder (and the scalar path).
    for affine in [QuantSpec::affine(64, 4), QuantSpec::affine(32, 3)] {
        let (t, _) = tiered::build_tiered(&w, &tiers_of, affine, None).unwrap();
        let deq = tiered::dequantize_tiered(&t).unwrap();
        let x = randn(&[3, 2, 1, 1, k], 22);
        let rhs = Array::from_slice(&[5u32, 0, 2, 2, 1, 3, 4, 0, 3, 1, 5, 4], &[3, 2, 2]).unwrap();
        let want = ops::gather_mm(&x, &deq.swapaxes(-1, -2).unwrap(), None, Some(&rhs), false).unwrap();
        let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
        // The codebook tier in the ternary layout too (as `--codebook-layout ternary` loads it).
        let mut tt = t.clone();
        tt.codebook = Some(t.codebook.as_ref().unwrap().to_ternary().unwrap());
        for scalar in [false, true] {
            kernels::force_scalar(scalar);
            for (layout, t) in [("compact", &t), ("ternary", &tt)] {
                let got = tiered::gather_tiered_qmm(&x, t, None, Some(&rhs)).unwrap();
                assert_eq!(got.shape(), want.shape());
                let err = rel_err(&got, &want);
                assert!(err <= 2e-5, "{affine:?} {layout} scalar={scalar}: {err}");
            }
        }
        kernels::force_scalar(false);
    }
}

/// The activation rounding of q8 mode, written out independently of the kernels: per row, each 256-chunk
/// (the last may be short) scaled to [-127, 127] by 127 / max|x|, rounded half to even, then scaled back.
fn q8_rounded(x: &Array) -> Array {
    let k = *x.shape().last().unwrap() as usize;
    let v = x.to_vec_f32().unwrap();
    let mut out = vec![0f32; v.len()];
    for (row, o) in v.chunks(k).zip(out.chunks_mut(k)) {
        for (c, oc) in row.chunks(256).zip(o.chunks_mut(256)) {
            let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (d, id) = (amax / 127.0, if amax > 0.0 { 127.0 / amax } else { 0.0 });
            for (v, o) in c.iter().zip(oc.iter_mut()) {
                *o = (v * id).round_ties_even().clamp(-127.0, 127.0) * d;
            }
        }
    }
    Array::from_slice(&out, &x.shape()).unwrap()
}

/// q8 mode: every codebook kernel (plain, gathered, tiered; SIMD and scalar) equals the f32 reference applied
/// to the q8-rounded activations, within f32 reassociation (the block dots are exact integers; only the
/// per-super-block f32 products and their sum are rounded). Against f32 activations the outputs move by the
/// rounding itself, which the test bounds (and requires to be nonzero, so the mode must have taken effect).
#[test]
fn q8_activations_match_the_reference_on_rounded_inputs() {
    use kernels::QmmActivations::{F32, Q8};
    let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    let mut worst = (0f32, 0f32);
    for scalar in [false, true] {
        kernels::force_scalar(scalar);
        // K % 256 != 0 (short last super-block): 96, 416; M > 4 (several row tiles): 7.
        for (m, n, k) in [(1, 300, 1024), (3, 65, 512), (7, 33, 768), (2, 33, 96), (1, 41, 416), (5, 20, 288)] {
            let cb = random_codebook(n, k, 60 + k as u64).to_arrays().unwrap();
            let x = randn(&[m, k as i32], 61 + n as u64);
            // One row of zeros: d = 0 must give zeros, not NaN.
            let x = if m > 2 { x.multiply(mask_row(m, k)).unwrap() } else { x };
            let deq_t = codebook::dequantize_reference(&cb).unwrap().t().unwrap();
            kernels::set_qmm_activations(Some(Q8));
            let got = codebook::codebook_qmm(&x, &cb).unwrap();
            kernels::set_qmm_activations(Some(F32));
            let exact = codebook::codebook_qmm(&x, &cb).unwrap();
            let want = q8_rounded(&x).matmul(&deq_t).unwrap();
            let e = rel_err(&got, &want);
            assert!(e <= 2e-5, "q8 codebook_qmm m={m} n={n} k={k} scalar={scalar}: rel err {e}");
            assert!(got.to_vec_f32().unwrap().iter().all(|v| v.is_finite()));
            let r = rel_err(&got, &exact);
            assert!(r > 1e-4 && r < 0.03, "q8 vs f32 activations m={m} n={n} k={k}: {r}");
            worst = (worst.0.max(e), worst.1.max(r));
        }
        // Gathered (unsorted decode shape) and tiered stacks.
        let (e, n, k) = (6usize, 40usize, 288usize);
        let hosts: Vec<CodebookHost> = (0..e).map(|i| random_codebook(n, k, 200 + i as u64)).collect();
        let parts: Vec<Codebook> = hosts.iter().map(|h| h.to_arrays().unwrap()).collect();
        let st = |f: &dyn Fn(&Codebook) -> &Array| ops::stack(&parts.iter().map(f).collect::<Vec<_>>(), 0).unwrap();
        let cb = Codebook { codes: st(&|c| &c.codes), qh: st(&|c| &c.qh), scales: st(&|c| &c.scales) };
        let deq = codebook::dequantize_reference(&cb).unwrap().swapaxes(-1, -2).unwrap();
        let x = randn(&[2, 3, 1, 1, k as i32], 7);
        let rhs = Array::from_slice(&[5u32, 0, 2, 2, 1, 3, 0, 0, 4, 1, 3, 5], &[2, 3, 2]).unwrap();
        kernels::set_qmm_activations(Some(Q8));
        let got = codebook::gather_codebook_qmm(&x, &cb, None, Some(&rhs)).unwrap();
        let want = ops::gather_mm(&q8_rounded(&x), &deq, None, Some(&rhs), false).unwrap();
        let err = rel_err(&got, &want);
        assert!(err <= 2e-5, "q8 gather scalar={scalar}: {err}");
        // Tiered (codebook, MXFP4 and affine experts): every tier in q8 mode, each against its reference.
        let (n, k) = (40usize, 512usize);
        let w = randn(&[6, n as i32, k as i32], 21).multiply(0.05f32).unwrap();
        let tiers_of = [Tier::Codebook, Tier::Mxfp4, Tier::Affine, Tier::Codebook, Tier::Affine, Tier::Mxfp4];
        let (t, _) = tiered::build_tiered(&w, &tiers_of, QuantSpec::affine(64, 4), None).unwrap();
        let x = randn(&[3, 2, 1, 1, k as i32], 22);
        let experts = [5u32, 0, 2, 2, 1, 3, 4, 0, 3, 1, 5, 4];
        let rhs = Array::from_slice(&experts, &[3, 2, 2]).unwrap();
        let got = tiered::gather_tiered_qmm(&x, &t, None, Some(&rhs)).unwrap().to_vec_f32().unwrap();
        // Two experts per token: pair p reads row p / 2.
        let e = rel_err_vec(&got, &tiered_q8_reference(&t, &tiers_of, &x, &experts, |p| p / 2));
        assert!(e <= 2e-5, "tiered q8 scalar={scalar}: rel err {e}");
    }
    kernels::force_scalar(false);
    kernels::set_qmm_activations(None);
    println!(
        "q8 codebook kernels vs reference on rounded activations: {:e}; vs f32 activations: {:.4}",
        worst.0, worst.1
    );
}

/// q8 mode at prefill shapes: at least 6 rows per matrix or per expert and K % 256 == 0, which on CPUs with
/// AVX-512 VNNI take the int8 GEMM (mlx-k3-metal's qmm_cpu_x86_vnni.cpp; elsewhere the row kernels). Both
/// codebook layouts, plain, gathered with rows sorted by expert, and tiered, against the f32 reference on the
/// q8-rounded activations, within the same bound as the row kernels (the GEMM's integer sums are exact too).
#[test]
fn q8_prefill_shapes_match_the_reference() {
    use kernels::QmmActivations::Q8;
    let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    kernels::force_scalar(false);
    kernels::set_qmm_activations(Some(Q8));
    let mut worst = 0f32;
    // One partial 16-row tile; two tiles and a partial one with a row of zeros.
    for (m, n, k) in [(6, 37, 768), (40, 37, 512)] {
        let cb = random_codebook(n, k, 70 + m as u64).to_arrays().unwrap();
        let x = randn(&[m, k as i32], 71 + m as u64).multiply(mask_row(m, k)).unwrap();
        let want = q8_rounded(&x).matmul(&codebook::dequantize_reference(&cb).unwrap().t().unwrap()).unwrap();
        for (layout, w) in [("compact", cb.clone()), ("ternary", cb.to_ternary().unwrap())] {
            let e = rel_err(&codebook::codebook_qmm(&x, &w).unwrap(), &want);
            assert!(e <= 2e-5, "q8 {layout} codebook_qmm m={m} n={n} k={k}: rel err {e}");
            worst = worst.max(e);
        }
    }
    // Gathered, one row per routed token sorted by expert: runs of 16, 7, 6 and 19 rows, expert 1 unused.
    let (n, k) = (40usize, 512usize);
    let (cb, deq) = codebook_stack(6, n, k);
    let experts: Vec<u32> =
        [(0u32, 16), (2, 7), (3, 6), (5, 19)].iter().flat_map(|&(e, c)| std::iter::repeat(e).take(c)).collect();
    let p = experts.len() as i32;
    let x = randn(&[p, 1, k as i32], 72);
    let lhs = Array::from_slice(&(0..p as u32).collect::<Vec<_>>(), &[p]).unwrap();
    let rhs = Array::from_slice(&experts, &[p]).unwrap();
    let want = ops::gather_mm(&q8_rounded(&x), &deq.swapaxes(-1, -2).unwrap(), Some(&lhs), Some(&rhs), true).unwrap();
    let tcb = cb.to_ternary().unwrap();
    for (layout, w) in [("compact", &cb), ("ternary", &tcb)] {
        let e = rel_err(&codebook::gather_codebook_qmm(&x, w, Some(&lhs), Some(&rhs)).unwrap(), &want);
        assert!(e <= 2e-5, "q8 {layout} sorted gather: rel err {e}");
        worst = worst.max(e);
    }
    // Tiered: the codebook experts (0 and 3) get 9 and 12 rows, the MXFP4 and affine ones a few.
    let w = randn(&[6, n as i32, k as i32], 23).multiply(0.05f32).unwrap();
    let tiers_of = [Tier::Codebook, Tier::Mxfp4, Tier::Affine, Tier::Codebook, Tier::Affine, Tier::Mxfp4];
    let (t, _) = tiered::build_tiered(&w, &tiers_of, QuantSpec::affine(64, 4), None).unwrap();
    let mut tt = t.clone();
    tt.codebook = Some(t.codebook.as_ref().unwrap().to_ternary().unwrap());
    let experts: Vec<u32> =
        [(0u32, 9), (1, 2), (2, 3), (3, 12), (5, 1)].iter().flat_map(|&(e, c)| std::iter::repeat(e).take(c)).collect();
    let p = experts.len();
    let x = randn(&[p as i32, 1, 1, k as i32], 24);
    let rhs = Array::from_slice(&experts, &[p as i32, 1]).unwrap();
    let want = tiered_q8_reference(&t, &tiers_of, &x, &experts, |i| i);
    for (layout, t) in [("compact", &t), ("ternary", &tt)] {
        let got = tiered::gather_tiered_qmm(&x, t, None, Some(&rhs)).unwrap().to_vec_f32().unwrap();
        let e = rel_err_vec(&got, &want);
        assert!(e <= 2e-5, "tiered q8 {layout}, sorted rows: rel err {e}");
        worst = worst.max(e);
    }
    kernels::set_qmm_activations(None);
    println!("q8 codebook kernels at prefill shapes vs reference on rounded activations: {worst:e}");
}

/// The q8 reference of a tiered stack `t` (built with `tiers_of`) for the routed pairs `experts`, pair i reading
/// row `row_of(i)` of `x` [rows, .., K]: each pair's `q8_reference_rows` against its expert's dequantized rows,
/// the affine experts' bias term on the exact activations.
fn tiered_q8_reference(
    t: &TieredExperts,
    tiers_of: &[Tier],
    x: &Array,
    experts: &[u32],
    row_of: impl Fn(usize) -> usize,
) -> Vec<f32> {
    let deq = tiered::dequantize_tiered(t).unwrap();
    let (n, k) = (deq.shape()[1] as usize, deq.shape()[2] as usize);
    let deq = deq.to_vec_f32().unwrap();
    let (aq, aspec) = t.affine.as_ref().unwrap();
    let abias = aq.biases.as_ref().unwrap().to_vec_f32().unwrap(); // [affine experts, N, K / group]
    let slots = t.slot.to_vec::<u32>().unwrap();
    let (xv, xr) = (x.to_vec_f32().unwrap(), q8_rounded(x).to_vec_f32().unwrap());
    let (g, ng) = (aspec.group_size as usize, k / aspec.group_size as usize);
    let mut want = Vec::new();
    for (i, &ex) in experts.iter().enumerate() {
        let r = row_of(i);
        let (xs, rs) = (&xv[r * k..(r + 1) * k], &xr[r * k..(r + 1) * k]);
        let wx = &deq[ex as usize * n * k..(ex as usize + 1) * n * k];
        let bias = matches!(tiers_of[ex as usize], Tier::Affine).then(|| {
            let s = slots[ex as usize] as usize;
            (&abias[s * n * ng..(s + 1) * n * ng], g)
        });
        want.extend(q8_reference_rows(xs, rs, wx, n, bias));
    }
    want
}

/// Largest absolute difference over the largest |want|.
fn rel_err_vec(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// One activation row against `n` weight rows `w` [n, k] in f64: the rounded activations `xr` multiply the
/// weights; for affine weights (`bias` = (biases [n, k / group], group)) the bias term takes the exact `x`,
/// as the q8 kernels do (w = scale * q + bias: sum(scale * q * xr) + bias * sum(x)).
fn q8_reference_rows(x: &[f32], xr: &[f32], w: &[f32], n: usize, bias: Option<(&[f32], usize)>) -> Vec<f32> {
    let k = x.len();
    (0..n)
        .map(|r| {
            (0..k)
                .map(|i| {
                    let b = bias.map_or(0.0, |(b, g)| b[r * (k / g) + i / g] as f64);
                    (w[r * k + i] as f64 - b) * xr[i] as f64 + b * x[i] as f64
                })
                .sum::<f64>() as f32
        })
        .collect()
}

/// q8 mode for MLX's formats (the SIMD paths; the scalar ones are checked through the tiered stack above):
/// affine 2/4/8-bit with groups 32/64/128 and MXFP4, K = 256 to 1024, match `q8_reference_rows`; f32, bf16 and
/// f16 scales/biases (the 2/4/8-bit q8 kernels read them in their own dtype); widths without q8 kernels
/// (3/5/6-bit) give exactly their f32 results. With the AVX-512 paths on and off: 2-bit rows with K % 256 == 0
/// take the AVX-512 VNNI kernel where the CPU has it (one activation row: four weight rows at a time, n = 70
/// leaving a remainder), the AVX2 kernel otherwise.
#[test]
fn q8_activations_for_mlx_formats() {
    use kernels::QmmActivations::{F32, Q8};
    let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    let n = 70usize;
    let mut worst = 0f32;
    let mut specs: Vec<(QuantSpec, usize, Dtype)> = [2, 4, 8, 3, 6]
        .iter()
        .flat_map(|&b| [32, 64, 128].map(|g| (QuantSpec::affine(g, b), 512, Dtype::F32)))
        .collect();
    specs.push((QuantSpec::default_for(QuantMode::Mxfp4), 512, Dtype::F32));
    // K % 256 != 0: the kernels' tails (2 bits: an interleaved 128-chunk and/or single 32-blocks; 4 bits: 64-chunks
    // and/or one 32-block) and a short last activation chunk.
    for (g, b, k) in
        [(32, 2, 544), (64, 2, 576), (64, 2, 640), (32, 2, 704), (64, 4, 576), (32, 4, 544), (32, 4, 608), (32, 8, 544)]
    {
        specs.push((QuantSpec::affine(g, b), k, Dtype::F32));
    }
    specs.push((QuantSpec::default_for(QuantMode::Mxfp4), 544, Dtype::F32));
    // Other K % 256 == 0 (the 2-bit VNNI kernel's one and four chunks per row).
    for (g, b, k) in [(64, 2, 256), (64, 2, 1024), (128, 2, 1024), (32, 2, 256)] {
        specs.push((QuantSpec::affine(g, b), k, Dtype::F32));
    }
    // Half-precision scales and biases (what bf16/f16 checkpoints carry).
    for (g, b, k, dt) in [
        (32, 2, 512, Dtype::BF16),
        (64, 2, 704, Dtype::F16),
        (128, 2, 512, Dtype::F16),
        (64, 2, 576, Dtype::BF16),
        (64, 4, 512, Dtype::BF16),
        (32, 8, 512, Dtype::F16),
        (64, 2, 1024, Dtype::BF16),
    ] {
        specs.push((QuantSpec::affine(g, b), k, dt));
    }
    for avx512 in [true, false] {
        kernels::set_avx512(Some(avx512));
        for (i, &(spec, k, wdt)) in specs.iter().enumerate() {
            let w = randn(&[n as i32, k as i32], 70 + i as u64).astype(wdt).unwrap();
            let q = quant::quantize(&w, spec, None).unwrap();
            // The reference decodes with f32 scales and biases (MLX's dequantize of half scales rounds each weight
            // to that precision; the kernels keep w = scale * code + bias in f32).
            let f32_scales = |a: &Array| if a.dtype() == Dtype::U8 { a.clone() } else { a.astype(Dtype::F32).unwrap() };
            let qf = Quantized {
                weight: q.weight.clone(),
                scales: f32_scales(&q.scales),
                biases: q.biases.as_ref().map(|b| b.astype(Dtype::F32).unwrap()),
            };
            let wd = quant::dequantize(&qf, spec, None, Some(Dtype::F32)).unwrap().to_vec_f32().unwrap();
            let bias = q.biases.as_ref().map(|b| (b.to_vec_f32().unwrap(), spec.group_size as usize));
            for m in [1, 5] {
                let x = randn(&[m, k as i32], 80 + i as u64);
                kernels::set_qmm_activations(Some(Q8));
                let got = kernels::fast_quantized_matmul(&x, &q, spec).unwrap().to_vec_f32().unwrap();
                assert_eq!(q.scales.dtype(), if matches!(spec.mode, QuantMode::Affine) { wdt } else { Dtype::U8 });
                kernels::set_qmm_activations(Some(F32));
                let exact = kernels::fast_quantized_matmul(&x, &q, spec).unwrap().to_vec_f32().unwrap();
                if matches!(spec.mode, QuantMode::Affine) && ![2, 4, 8].contains(&spec.bits) {
                    assert_eq!(got, exact, "{spec:?}: no q8 kernel, so f32 results");
                    continue;
                }
                let (xv, xr) = (x.to_vec_f32().unwrap(), q8_rounded(&x).to_vec_f32().unwrap());
                let want: Vec<f32> = (0..m as usize)
                    .flat_map(|r| {
                        let b = bias.as_ref().map(|(b, g)| (b.as_slice(), *g));
                        q8_reference_rows(&xv[r * k..(r + 1) * k], &xr[r * k..(r + 1) * k], &wd, n, b)
                    })
                    .collect();
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                let e = got.iter().zip(&want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / scale;
                assert!(e <= 2e-5, "q8 {spec:?} {wdt:?} m={m} k={k} avx512={avx512}: rel err {e}");
                let r = exact.iter().zip(&got).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / scale;
                assert!(r > 1e-4 && r < 0.03, "q8 vs f32 activations {spec:?} m={m} k={k}: {r}");
                worst = worst.max(e);
            }
        }
    }
    kernels::set_avx512(None);
    kernels::set_qmm_activations(None);
    println!("q8 affine/mxfp4 kernels vs reference: worst rel err {worst:e}");
}

/// [m, k] ones with row 1 zeroed.
fn mask_row(m: i32, k: usize) -> Array {
    let mut v = vec![1f32; m as usize * k];
    v[k..2 * k].fill(0.0);
    Array::from_slice(&v, &[m, k as i32]).unwrap()
}

/// K % 256 != 0: the last super-block of each row is short. The host decoder and the plain-ops reference
/// agree exactly; every full super-block decodes as the IQ1_S block with the same bytes; the quantizer
/// handles the short block like a full one (error of the same size as for K = 256 on the same data).
#[test]
fn short_last_super_block() {
    for k in [32usize, 96, 128, 288] {
        let h = random_codebook(7, k, 40 + k as u64);
        assert_eq!(h.scales.len(), 7 * k.div_ceil(256));
        let host = codebook::decode_host(&h);
        let reference = codebook::dequantize_reference(&h.to_arrays().unwrap()).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(host, reference, "K = {k}: host decode vs plain-ops reference");
        assert_eq!(codebook::row_bytes(k) * 7, h.codes.len() + 2 * h.qh.len() + 2 * h.scales.len());
        if k > 256 {
            // The first super-block of each row, cut out as a K = 256 matrix (an IQ1_S row), decodes the same.
            let first = CodebookHost {
                n: 7,
                k: 256,
                codes: (0..7).flat_map(|r| h.codes[r * k / 8..r * k / 8 + 32].to_vec()).collect(),
                qh: (0..7).flat_map(|r| h.qh[r * k / 32..r * k / 32 + 8].to_vec()).collect(),
                scales: (0..7).map(|r| h.scales[r * 2]).collect(),
            };
            let d = codebook::decode_host(&first);
            for r in 0..7 {
                assert_eq!(&d[r * 256..(r + 1) * 256], &host[r * k..r * k + 256]);
            }
        }
    }
    // Quantizer: the same 128-wide rows cost 1.625 bits per weight and reconstruct as well as when they sit
    // inside 256-wide rows (the 3-bit block scales are set against the same kind of super-block maximum).
    let (n, k) = (32usize, 128usize);
    let w = randn(&[n as i32, k as i32], 12).to_vec::<f32>().unwrap();
    let (a, ra) = codebook::quantize(&w, n, k, None).unwrap();
    assert_eq!(codebook::quantize(&w, n, k, None).unwrap().0, a, "deterministic");
    assert_eq!(codebook::row_bytes(k) as f64 * 8.0 / k as f64, 1.625);
    let (_, r256) = codebook::quantize(&w, n / 2, 2 * k, None).unwrap();
    assert!(ra.plain_rel_err < 0.35 && (ra.plain_rel_err - r256.plain_rel_err).abs() < 0.05, "{ra:?} vs {r256:?}");
    let dec = codebook::decode_host(&a);
    let num: f64 = dec.iter().zip(&w).map(|(d, x)| ((d - x) as f64).powi(2)).sum();
    let den: f64 = w.iter().map(|x| (*x as f64).powi(2)).sum();
    assert!((num / den - ra.plain_rel_err).abs() < 1e-9);
    println!(
        "K = 128 rows: plain rel err {:.4} (the same values as K = 256 rows: {:.4})",
        ra.plain_rel_err, r256.plain_rel_err
    );
}

/// `quantized_matmul_many`: several projections of one x as one graph node whose outputs are bit-identical to
/// `kernels::fast_quantized_matmul` per weight (same row kernels; a row's value cannot depend on the task split),
/// and within the fast-path tolerance of MLX's own op; x as a strided view and with several rows; a weight
/// without a project kernel (mxfp8) or bf16 activations run each projection as the single op would; a weight
/// whose K differs is an error naming the op.
#[test]
fn quantized_matmul_many_is_one_node_with_the_single_ops_results() {
    let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    let k = 256;
    let specs = [
        QuantSpec::affine(64, 8),
        QuantSpec::affine(32, 4),
        QuantSpec::affine(64, 2),
        QuantSpec { group_size: 32, bits: 4, mode: QuantMode::Mxfp4 },
        QuantSpec::affine(64, 8),
    ];
    let ns = [96, 200, 130, 64, 8];
    let ws: Vec<Quantized> = specs
        .iter()
        .zip(ns)
        .enumerate()
        .map(|(i, (s, n))| quant::quantize(&randn(&[n, k], 40 + i as u64), *s, None).unwrap())
        .collect();
    let pairs: Vec<(&Quantized, QuantSpec)> = ws.iter().zip(specs).collect();
    let bits = |a: &Array| -> Vec<u32> { a.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect() };
    let xs = [
        randn(&[1, 1, k], 50),
        randn(&[2, 5, k], 51),
        randn(&[k, 3], 52).transpose(&[1, 0]).unwrap(), // strided [3, k]
    ];
    // Inputs evaluated first, so each census below holds only the op under test.
    let mut inputs: Vec<&Array> = xs.iter().collect();
    for q in &ws {
        inputs.extend([&q.weight, &q.scales]);
        inputs.extend(q.biases.as_ref());
    }
    mlx_k3::eval(&inputs).unwrap();
    for x in &xs {
        let got = kernels::fast_quantized_matmul_many(x, &pairs).unwrap();
        assert_eq!(got.len(), specs.len());
        let census = mlx_k3::graph_census(&got.iter().collect::<Vec<_>>()).unwrap();
        let multi: Vec<_> = census.iter().filter(|r| r.primitive == "packed_qmm_multi").collect();
        assert!(multi.len() == 1 && multi[0].nodes == 1, "{census:?}");
        assert!(!census.iter().any(|r| r.primitive.contains("qmm") && r.primitive != "packed_qmm_multi"), "{census:?}");
        for ((g, (q, s)), n) in got.iter().zip(&pairs).zip(ns) {
            let mut want_shape = x.shape();
            *want_shape.last_mut().unwrap() = n;
            assert_eq!(g.shape(), want_shape);
            let single = kernels::fast_quantized_matmul(x, q, *s).unwrap();
            assert!(bits(g) == bits(&single), "{s:?} x {:?}: differs from the single op", x.shape());
            let e = rel_err(g, &quant::quantized_matmul(x, q, *s, true).unwrap());
            assert!(e <= 2e-5, "{s:?}: rel err {e} to MLX");
        }
    }
    // All affine: named so in the census.
    let affine: Vec<_> = pairs.iter().filter(|(_, s)| s.mode == QuantMode::Affine).cloned().collect();
    let got = kernels::fast_quantized_matmul_many(&xs[0], &affine).unwrap();
    let census = mlx_k3::graph_census(&got.iter().collect::<Vec<_>>()).unwrap();
    assert!(census.iter().any(|r| r.primitive == "affine_qmm_multi" && r.nodes == 1), "{census:?}");

    // A weight with no project kernel: each projection as the single op.
    let fp8 = QuantSpec { group_size: 32, bits: 8, mode: QuantMode::Mxfp8 };
    let q8 = quant::quantize(&randn(&[48, k], 60), fp8, None).unwrap();
    mlx_k3::eval(&[&q8.weight, &q8.scales]).unwrap();
    let mixed = [pairs[0], (&q8, fp8), pairs[1]];
    let xb = xs[1].astype(Dtype::BF16).unwrap();
    xb.eval().unwrap();
    for x in [&xs[1], &xb] {
        let got = kernels::fast_quantized_matmul_many(x, &mixed).unwrap();
        let census = mlx_k3::graph_census(&got.iter().collect::<Vec<_>>()).unwrap();
        assert!(!census.iter().any(|r| r.primitive.ends_with("_multi")), "{census:?}");
        for (g, (q, s)) in got.iter().zip(&mixed) {
            assert!(bits(g) == bits(&kernels::fast_quantized_matmul(x, q, *s).unwrap()), "{s:?} {:?}", x.dtype());
        }
    }
    // bf16 activations with weights that all have kernels: MLX's op per projection (not the f32 kernels).
    let got = kernels::fast_quantized_matmul_many(&xb, &pairs[..2]).unwrap();
    for (g, (q, s)) in got.iter().zip(&pairs[..2]) {
        assert!(bits(g) == bits(&quant::quantized_matmul(&xb, q, *s, true).unwrap()), "{s:?}");
    }
    // Bad input: a weight made for another K.
    let other = quant::quantize(&randn(&[32, 128], 70), specs[0], None).unwrap();
    let err = kernels::fast_quantized_matmul_many(&xs[0], &[pairs[0], (&other, specs[0])]).unwrap_err().to_string();
    assert!(err.contains("quantized_matmul_multi") && err.contains("shape"), "{err}");
}

/// The GPU kernel (mlx-k3-metal/kernels/packed_qmm.cu on CUDA, packed_qmm.metal on Apple) on each GPU device
/// present, against the plain-ops references of the CPU tests above (computed on the CPU): the plain, gathered
/// (decode and sorted-prefill forms) and tiered matmuls, plus the kernel's answer to an expert index past the
/// stack (NaN in that pair's rows: a kernel cannot raise). Where no GPU is present this runs nothing; CI checks
/// both kernels on the CPU under emulators of CUDA and Metal (mlx-k3-metal/tests/gpu_emulation.rs), and
/// scripts/gpu_check.sh runs this on a CUDA GPU.
#[test]
fn codebook_and_tiered_matmuls_match_on_gpu_devices() {
    use mlx_k3::{with_device, Device};
    let gpus: Vec<Device> = Device::available().into_iter().filter(|d| *d != Device::Cpu).collect();
    if gpus.is_empty() {
        return;
    }
    let (n, k) = (40usize, 512usize);
    let (cb, deq) = codebook_stack(6, n, k);
    let single = random_codebook(n, k, 7).to_arrays().unwrap();
    let x_plain = randn(&[7, k as i32], 31);
    let x_dec = randn(&[2, 3, 1, 1, k as i32], 32);
    let rhs_dec = Array::from_slice(&[5u32, 0, 2, 2, 1, 3, 0, 0, 4, 1, 3, 5], &[2, 3, 2]).unwrap();
    let x_pre = randn(&[10, 3, k as i32], 33);
    let lhs_pre = Array::from_slice(&[0u32, 1, 2, 3, 4, 5, 6, 7], &[8]).unwrap();
    let rhs_pre = Array::from_slice(&[0u32, 0, 0, 2, 2, 3, 5, 5], &[8]).unwrap();
    let w = randn(&[6, n as i32, k as i32], 34).multiply(0.05f32).unwrap();
    let tiers_of = [Tier::Codebook, Tier::Mxfp4, Tier::Affine, Tier::Codebook, Tier::Affine, Tier::Mxfp4];
    let (tiered, _) = tiered::build_tiered(&w, &tiers_of, QuantSpec::affine(64, 4), None).unwrap();
    let (want_plain, want_dec, want_pre, want_tiered) = with_device(Device::Cpu, || {
        let deq_t = deq.swapaxes(-1, -2).unwrap();
        let tier_t = tiered::dequantize_tiered(&tiered).unwrap().swapaxes(-1, -2).unwrap();
        (
            x_plain.matmul(&codebook::dequantize_reference(&single).unwrap().t().unwrap()).unwrap(),
            ops::gather_mm(&x_dec, &deq_t, None, Some(&rhs_dec), false).unwrap(),
            ops::gather_mm(&x_pre, &deq_t, Some(&lhs_pre), Some(&rhs_pre), true).unwrap(),
            ops::gather_mm(&x_dec, &tier_t, None, Some(&rhs_dec), false).unwrap(),
        )
    })
    .unwrap();
    for device in gpus {
        with_device(device, || {
            let got = codebook::codebook_qmm(&x_plain, &single).unwrap();
            let e_plain = rel_err(&got, &want_plain);
            let got = codebook::gather_codebook_qmm(&x_dec, &cb, None, Some(&rhs_dec)).unwrap();
            assert_eq!(got.shape(), want_dec.shape());
            let e_dec = rel_err(&got, &want_dec);
            let got = codebook::gather_codebook_qmm(&x_pre, &cb, Some(&lhs_pre), Some(&rhs_pre)).unwrap();
            assert_eq!(got.shape(), want_pre.shape());
            let e_pre = rel_err(&got, &want_pre);
            let got = tiered::gather_tiered_qmm(&x_dec, &tiered, None, Some(&rhs_dec)).unwrap();
            assert_eq!(got.shape(), want_tiered.shape());
            let e_tiered = rel_err(&got, &want_tiered);
            println!(
                "{device:?}: rel err codebook {e_plain:.2e}, gathered {e_dec:.2e} / {e_pre:.2e}, tiered {e_tiered:.2e}"
            );
            for (what, e) in [("plain", e_plain), ("decode", e_dec), ("prefill", e_pre), ("tiered", e_tiered)] {
                assert!(e <= 2e-5, "{device:?} {what}: {e}");
            }
            // Expert 9 of 6 for the second pair: NaN there (one row of N), finite elsewhere.
            let bad = Array::from_slice(&[1u32, 9, 4], &[3]).unwrap();
            let x = randn(&[1, 1, k as i32], 35);
            let y = codebook::gather_codebook_qmm(&x, &cb, None, Some(&bad)).unwrap().to_vec_f32().unwrap();
            for (i, v) in y.iter().enumerate() {
                assert_eq!(v.is_nan(), i / n == 1, "{device:?}: output {i} = {v}");
            }
        })
        .unwrap();
    }
}

/// Host planes whose rows use every one of the 2048 grid entries (entry i as group i of the matrix), with
/// random scales, block scales and delta signs.
fn every_grid_entry(k: usize, seed: u64) -> CodebookHost {
    let mut h = random_codebook(2048 * 8 / k, k, seed);
    for g in 0..2048usize {
        let (row, grp) = (g * 8 / k, g % (k / 8)); // group grp of row `row` (4 groups per 32-block)
        let b = grp / 4;
        h.codes[row * k / 8 + grp] = g as u8;
        let q = &mut h.qh[row * k / 32 + b];
        let sh = 3 * (grp % 4);
        *q = (*q & !(7 << sh)) | (((g >> 8) as u16) << sh);
    }
    h
}

/// The ternary execution layout is lossless: over every grid entry and over random planes (K with short last
/// super-blocks and 128-chunks too), the kernels' converter writes exactly the trits of the independent host
/// writer, and the two layouts decode to the same f32 values bit for bit, on the host and with MLX ops.
#[test]
fn ternary_layout_is_bit_exact() {
    let mut cases = vec![every_grid_entry(256, 1), every_grid_entry(512, 2)];
    for k in [32usize, 96, 160, 288, 416, 1024] {
        cases.push(random_codebook(9, k, 70 + k as u64));
    }
    for h in &cases {
        let cb = h.to_arrays().unwrap();
        assert_eq!(cb.layout(), codebook::CodebookLayout::Compact);
        let t = cb.to_ternary().unwrap();
        assert_eq!(t.layout(), codebook::CodebookLayout::Ternary);
        assert_eq!(t.codes.shape(), [h.n as i32, codebook::ternary_row_bytes(h.k) as i32]);
        let trits = t.codes.to_vec::<u8>().unwrap();
        assert_eq!(trits, codebook::ternary_host(h), "K = {}: trits", h.k);
        let compact = codebook::decode_host(h);
        let ternary = codebook::decode_ternary_host(h, &trits);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&compact), bits(&ternary), "K = {}: host decodes", h.k);
        let reference = codebook::dequantize_reference(&t).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(bits(&compact), bits(&reference), "K = {}: plain-ops decode of the ternary layout", h.k);
        assert_eq!(t.stored_bytes(), cb.nbytes());
        assert_eq!(t.nbytes(), cb.nbytes() + h.n * (codebook::ternary_row_bytes(h.k) - h.k / 8));
    }
    // Stacks convert per row, the same as each expert alone.
    let (stack, _) = codebook_stack(3, 16, 288);
    let t = stack.to_ternary().unwrap();
    assert_eq!(t.codes.shape(), [3, 16, codebook::ternary_row_bytes(288) as i32]);
    let want = codebook::dequantize_reference(&stack).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(codebook::dequantize_reference(&t).unwrap().to_vec::<f32>().unwrap(), want);
    // Named errors: a codes plane that is neither layout's shape, a bad layout name.
    let bad =
        Codebook { codes: ops::zeros(&[4, 48], Dtype::U8).unwrap(), ..random_codebook(4, 256, 3).to_arrays().unwrap() };
    let e = codebook::codebook_qmm(&randn(&[1, 256], 1), &bad).unwrap_err().to_string();
    assert!(e.contains("[codebook_qmm]") && e.contains("ternary") && e.contains("shape"), "{e}");
    let e = codebook::CodebookLayout::parse("fast").unwrap_err().to_string();
    assert!(e.contains("fast") && e.contains("ternary"), "{e}");
}

/// The ternary layout's kernels (plain, gathered: decode and sorted-prefill shapes) against the plain-ops
/// reference (dequantize, then matmul): f32 activations with the AVX-512 and the AVX2 paths (where the CPU has
/// AVX-512) and the scalar path, within the tolerance of the compact kernels (2e-5 of the largest output: the
/// same products summed in another order); q8 activations against the reference on the q8-rounded activations
/// (exact integer block dots, so the same bound), and bit-identical to the compact layout's q8 kernel, whose
/// integers they reproduce.
#[test]
fn ternary_kernels_match_the_reference() {
    use kernels::QmmActivations::{F32, Q8};
    let _lock = SCALAR.lock().unwrap_or_else(|e| e.into_inner());
    let mut worst = 0f32;
    for (scalar, avx512) in [(false, true), (false, false), (true, false)] {
        kernels::force_scalar(scalar);
        kernels::set_avx512(Some(avx512));
        for (m, n, k) in
            [(1, 300, 1024), (3, 65, 512), (7, 33, 768), (2, 33, 96), (1, 41, 416), (5, 20, 288), (1, 9, 32)]
        {
            let cb = random_codebook(n, k, 90 + k as u64).to_arrays().unwrap();
            let t = cb.to_ternary().unwrap();
            let x = randn(&[m, k as i32], 91 + n as u64);
            let deq_t = codebook::dequantize_reference(&cb).unwrap().t().unwrap();
            kernels::set_qmm_activations(Some(F32));
            let got = codebook::codebook_qmm(&x, &t).unwrap();
            let e = rel_err(&got, &x.matmul(&deq_t).unwrap());
            assert!(e <= 2e-5, "ternary f32 m={m} n={n} k={k} scalar={scalar} avx512={avx512}: rel err {e}");
            kernels::set_qmm_activations(Some(Q8));
            let got = codebook::codebook_qmm(&x, &t).unwrap();
            let e8 = rel_err(&got, &q8_rounded(&x).matmul(&deq_t).unwrap());
            assert!(e8 <= 2e-5, "ternary q8 m={m} n={n} k={k} scalar={scalar}: rel err {e8}");
            let compact = codebook::codebook_qmm(&x, &cb).unwrap();
            if !scalar {
                assert_eq!(
                    got.to_vec_f32().unwrap(),
                    compact.to_vec_f32().unwrap(),
                    "q8 ternary vs compact m={m} k={k}"
                );
            }
            worst = worst.max(e).max(e8);
        }
        // Gathered: decode shape (unsorted) and sorted prefill rows, f32 and q8.
        let (stack, deq) = codebook_stack(6, 40, 288);
        let t = stack.to_ternary().unwrap();
        let deq = deq.swapaxes(-1, -2).unwrap();
        for q8 in [false, true] {
            kernels::set_qmm_activations(Some(if q8 { Q8 } else { F32 }));
            let x = randn(&[2, 3, 1, 1, 288], 1);
            let xr = if q8 { q8_rounded(&x) } else { x.clone() };
            let rhs = Array::from_slice(&[5u32, 0, 2, 2, 1, 3, 0, 0, 4, 1, 3, 5], &[2, 3, 2]).unwrap();
            let got = codebook::gather_codebook_qmm(&x, &t, None, Some(&rhs)).unwrap();
            let err = rel_err(&got, &ops::gather_mm(&xr, &deq, None, Some(&rhs), false).unwrap());
            assert!(err <= 2e-5, "ternary gather q8={q8} scalar={scalar}: {err}");
            let x = randn(&[10, 3, 288], 2);
            let xr = if q8 { q8_rounded(&x) } else { x.clone() };
            let lhs = Array::from_slice(&[0u32, 1, 2, 3, 4, 5, 6, 7], &[8]).unwrap();
            let rhs = Array::from_slice(&[0u32, 0, 0, 2, 2, 3, 5, 5], &[8]).unwrap();
            let got = codebook::gather_codebook_qmm(&x, &t, Some(&lhs), Some(&rhs)).unwrap();
            let err = rel_err(&got, &ops::gather_mm(&xr, &deq, Some(&lhs), Some(&rhs), true).unwrap());
            assert!(err <= 2e-5, "ternary sorted gather q8={q8} scalar={scalar}: {err}");
            worst = worst.max(err);
        }
    }
    kernels::force_scalar(false);
    kernels::set_avx512(None);
    kernels::set_qmm_activations(None);
    println!("ternary codebook kernels vs reference: worst rel err {worst:e}");
}
