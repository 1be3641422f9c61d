//! Packed-weight matmuls on the CPU: the project's kernels against MLX's stock ops and a dense f32 matmul,
//! in the same run. Graph building and evaluation are inside the timer (MLX is lazy). Throughput is bytes of
//! weights read per call (the packed size), so GB/s compares formats directly; GFLOP/s is in the README.
//!
//! Run: `cargo bench -p mlx-k3 --bench qmm` (add a filter such as `gemv` to run a subset).
//!
//! Shapes: GEMV 1 x K @ (N x K)ᵀ for 4096x4096, 3072x7168, 7168x3072, 4096x14336 (ggml's perf shape); Kimi K3 expert shapes (latent 3584 ->
//! 3072 -> 3584) for 16 routed experts at batch 1, from a stack of 64 experts (the per-token work is that of
//! top-16 of 896; a full 896-expert stack would not fit this machine's memory in every format); and a
//! 512-token prefill through sorted experts at the mid-size configuration's expert shape (1024 -> 512, 8 of
//! 128 experts per token), which is the largest that times in seconds on two cores.

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput};
use mlx_k3::codebook::{self, Codebook};
use mlx_k3::kernels::QmmActivations;
use mlx_k3::quant::{self, Gather, QuantMode, QuantSpec, Quantized};
use mlx_k3::{kernels, ops, random, Array, Dtype};

fn randn(shape: &[i32], seed: u64) -> Array {
    let a = random::normal(shape, Dtype::F32, 0.0, 0.02, Some(&random::key(seed).unwrap())).unwrap();
    a.eval().unwrap();
    a
}

/// A codebook matrix (stack) with random planes: every index / scale / sign is valid, and the kernels' cost
/// does not depend on the values.
fn random_codebook(shape: &[i32], seed: u64) -> Codebook {
    let k = *shape.last().unwrap();
    let lead = &shape[..shape.len() - 1];
    let mk = |last: i32, dt: Dtype, s: u64| {
        let mut sh = lead.to_vec();
        sh.push(last);
        let a = random::randint(0, 1 << 16, &sh, Dtype::U32, Some(&random::key(s).unwrap())).unwrap();
        let a = match dt {
            Dtype::U8 => a.bitwise_and(0xffu32).unwrap().astype(Dtype::U8).unwrap(),
            Dtype::U16 => a.astype(Dtype::U16).unwrap(),
            _ => random::uniform(0.001, 0.01, &sh, Dtype::F16, Some(&random::key(s).unwrap())).unwrap(),
        };
        a.eval().unwrap();
        a
    };
    Codebook {
        codes: mk(k / 8, Dtype::U8, seed),
        qh: mk(k / 32, Dtype::U16, seed + 1),
        scales: mk(k / 256, Dtype::F16, seed + 2),
    }
}

fn packed(w: &Array, spec: QuantSpec) -> Quantized {
    let sh = w.shape();
    if sh.len() == 3 && sh[0] > 8 {
        // An expert stack, 8 experts at a time: MLX 0.32.4's quantize crashes (SIGSEGV in a broadcast subtract)
        // on the 64 x 3072 x 3584 f32 stack in MXFP4 mode.
        let parts: Vec<Quantized> = (0..sh[0])
            .step_by(8)
            .map(|e| packed(&w.slice(&[e, 0, 0], &[(e + 8).min(sh[0]), sh[1], sh[2]], &[1, 1, 1]).unwrap(), spec))
            .collect();
        let cat = |f: &dyn Fn(&Quantized) -> &Array| {
            let a = ops::concatenate(&parts.iter().map(f).collect::<Vec<_>>(), 0).unwrap();
            a.eval().unwrap();
            a
        };
        let has_biases = parts[0].biases.is_some();
        return Quantized {
            weight: cat(&|q| &q.weight),
            scales: cat(&|q| &q.scales),
            biases: has_biases.then(|| cat(&|q| q.biases.as_ref().unwrap())),
        };
    }
    let q = quant::quantize(w, spec, None).unwrap();
    let mut arrays = vec![&q.weight, &q.scales];
    arrays.extend(q.biases.iter());
    mlx_k3::eval(&arrays).unwrap();
    q
}

fn qbytes(q: &Quantized) -> u64 {
    (q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, |b| b.nbytes())) as u64
}

fn cbytes(c: &Codebook) -> u64 {
    (c.codes.nbytes() + c.qh.nbytes() + c.scales.nbytes()) as u64
}

/// The codebook in the ternary execution layout (`--codebook-layout ternary`), evaluated.
fn ternary(cb: &Codebook) -> Codebook {
    let t = cb.to_ternary().unwrap();
    t.codes.eval().unwrap();
    t
}

/// Where the CPU has AVX-512, times `f` once more with the AVX2 kernels (`K3_AVX512` off for that row), so the
/// two kernels meet in the same run; elsewhere adds nothing.
fn bench_avx2(g: &mut BenchmarkGroup<'_, WallTime>, id: BenchmarkId, mut f: impl FnMut()) {
    if kernels::avx512().unwrap() {
        g.bench_function(id, |b| {
            kernels::set_avx512(Some(false));
            b.iter(&mut f);
            kernels::set_avx512(None);
        });
    }
}

fn gemv(c: &mut Criterion) {
    let mut g = c.benchmark_group("gemv");
    g.sample_size(20);
    // 4096x14336 is the shape ggml's `test-backend-ops perf -o MUL_MAT` times (m=4096, n=1, k=14336), for a
    // same-machine comparison with llama.cpp's CPU kernels (README).
    for (n, k) in [(4096, 4096), (3072, 7168), (7168, 3072), (4096, 14336)] {
        let x = randn(&[1, k], 1);
        let w = randn(&[n, k], 2);
        let id = |name: &str| BenchmarkId::new(name, format!("{n}x{k}"));
        g.throughput(Throughput::Bytes((n * k * 4) as u64));
        g.bench_function(id("dense_f32_mlx"), |b| b.iter(|| x.matmul(&w.t().unwrap()).and_then(|y| y.eval()).unwrap()));
        let cb = random_codebook(&[n, k], 3);
        g.throughput(Throughput::Bytes(cbytes(&cb)));
        g.bench_function(id("codebook_k3"), |b| {
            b.iter(|| codebook::codebook_qmm(&x, &cb).and_then(|y| y.eval()).unwrap())
        });
        bench_avx2(&mut g, id("codebook_avx2_k3"), || {
            codebook::codebook_qmm(&x, &cb).and_then(|y| y.eval()).unwrap();
        });
        // q8 mode (`*_q8_k3`): int8 activations, as ggml's dot products use; the op is built inside the timer.
        g.bench_function(id("codebook_q8_k3"), |b| {
            kernels::set_qmm_activations(Some(QmmActivations::Q8));
            b.iter(|| codebook::codebook_qmm(&x, &cb).and_then(|y| y.eval()).unwrap());
            kernels::set_qmm_activations(None);
        });
        // The ternary layout of the same weights (`*_ternary*`: its resident bytes as the throughput).
        let cbt = ternary(&cb);
        g.throughput(Throughput::Bytes(cbytes(&cbt)));
        g.bench_function(id("codebook_ternary_k3"), |b| {
            b.iter(|| codebook::codebook_qmm(&x, &cbt).and_then(|y| y.eval()).unwrap())
        });
        bench_avx2(&mut g, id("codebook_ternary_avx2_k3"), || {
            codebook::codebook_qmm(&x, &cbt).and_then(|y| y.eval()).unwrap();
        });
        g.bench_function(id("codebook_ternary_q8_k3"), |b| {
            kernels::set_qmm_activations(Some(QmmActivations::Q8));
            b.iter(|| codebook::codebook_qmm(&x, &cbt).and_then(|y| y.eval()).unwrap());
            kernels::set_qmm_activations(None);
        });
        drop(cbt);
        for (name, spec) in [
            ("affine4", QuantSpec::affine(64, 4)),
            ("affine2", QuantSpec::affine(64, 2)),
            ("affine8", QuantSpec::affine(64, 8)),
            ("affine3", QuantSpec::affine(64, 3)),
            ("affine6", QuantSpec::affine(64, 6)),
            ("mxfp4", QuantSpec::default_for(QuantMode::Mxfp4)),
        ] {
            let q = packed(&w, spec);
            g.throughput(Throughput::Bytes(qbytes(&q)));
            g.bench_function(id(&format!("{name}_k3")), |b| {
                b.iter(|| kernels::fast_quantized_matmul(&x, &q, spec).and_then(|y| y.eval()).unwrap())
            });
            g.bench_function(id(&format!("{name}_mlx")), |b| {
                b.iter(|| quant::quantized_matmul(&x, &q, spec, true).and_then(|y| y.eval()).unwrap())
            });
            // Where an AVX-512 kernel runs (2-, 4- and 8-bit and MXFP4 with f32 activations), the AVX2 one in the
            // same run.
            if ["affine4", "affine2", "affine8", "mxfp4"].contains(&name) {
                bench_avx2(&mut g, id(&format!("{name}_avx2_k3")), || {
                    kernels::fast_quantized_matmul(&x, &q, spec).and_then(|y| y.eval()).unwrap();
                });
            }
            if ["affine4", "affine2", "affine8", "mxfp4"].contains(&name) {
                g.bench_function(id(&format!("{name}_q8_k3")), |b| {
                    kernels::set_qmm_activations(Some(QmmActivations::Q8));
                    b.iter(|| kernels::fast_quantized_matmul(&x, &q, spec).and_then(|y| y.eval()).unwrap());
                    kernels::set_qmm_activations(None);
                });
            }
            if ["affine4", "affine2"].contains(&name) {
                // bf16 scales and biases, as bf16 checkpoints carry them (4.5 / 2.5 bits per weight at group 64:
                // q4_0's size, and a little under q2_K's 2.625).
                let qh = packed(&w.astype(Dtype::BF16).unwrap(), spec);
                g.throughput(Throughput::Bytes(qbytes(&qh)));
                g.bench_function(id(&format!("{name}_bf16_k3")), |b| {
                    b.iter(|| kernels::fast_quantized_matmul(&x, &qh, spec).and_then(|y| y.eval()).unwrap())
                });
                g.bench_function(id(&format!("{name}_bf16_q8_k3")), |b| {
                    kernels::set_qmm_activations(Some(QmmActivations::Q8));
                    b.iter(|| kernels::fast_quantized_matmul(&x, &qh, spec).and_then(|y| y.eval()).unwrap());
                    kernels::set_qmm_activations(None);
                });
            }
        }
    }
    g.finish();
}

fn experts(c: &mut Criterion) {
    let mut g = c.benchmark_group("experts_decode");
    g.sample_size(10);
    // 16 routed experts of 64 at batch 1, up projection 3584 -> 3072 (SwitchGLU layout: x [1, 1, 1, K]).
    let (e, n, k) = (64, 3072, 3584);
    let x = randn(&[1, 1, 1, k], 4);
    let idx: Vec<u32> = (0..16).map(|i| (i * 4 + 1) as u32).collect();
    let rhs = Array::from_slice(&idx, &[1, 16]).unwrap();
    let per_expert = |bytes: u64| bytes / e as u64 * 16;
    let cb = random_codebook(&[e, n, k], 5);
    g.throughput(Throughput::Bytes(per_expert(cbytes(&cb))));
    g.bench_function("codebook_k3", |b| {
        b.iter(|| codebook::gather_codebook_qmm(&x, &cb, None, Some(&rhs)).and_then(|y| y.eval()).unwrap())
    });
    bench_avx2(&mut g, BenchmarkId::from_parameter("codebook_avx2_k3"), || {
        codebook::gather_codebook_qmm(&x, &cb, None, Some(&rhs)).and_then(|y| y.eval()).unwrap();
    });
    g.bench_function("codebook_q8_k3", |b| {
        kernels::set_qmm_activations(Some(QmmActivations::Q8));
        b.iter(|| codebook::gather_codebook_qmm(&x, &cb, None, Some(&rhs)).and_then(|y| y.eval()).unwrap());
        kernels::set_qmm_activations(None);
    });
    let cbt = ternary(&cb);
    g.throughput(Throughput::Bytes(per_expert(cbytes(&cbt))));
    g.bench_function("codebook_ternary_k3", |b| {
        b.iter(|| codebook::gather_codebook_qmm(&x, &cbt, None, Some(&rhs)).and_then(|y| y.eval()).unwrap())
    });
    bench_avx2(&mut g, BenchmarkId::from_parameter("codebook_ternary_avx2_k3"), || {
        codebook::gather_codebook_qmm(&x, &cbt, None, Some(&rhs)).and_then(|y| y.eval()).unwrap();
    });
    g.bench_function("codebook_ternary_q8_k3", |b| {
        kernels::set_qmm_activations(Some(QmmActivations::Q8));
        b.iter(|| codebook::gather_codebook_qmm(&x, &cbt, None, Some(&rhs)).and_then(|y| y.eval()).unwrap());
        kernels::set_qmm_activations(None);
    });
    bench_avx2(&mut g, BenchmarkId::from_parameter("codebook_ternary_q8_avx2_k3"), || {
        kernels::set_qmm_activations(Some(QmmActivations::Q8));
        codebook::gather_codebook_qmm(&x, &cbt, None, Some(&rhs)).and_then(|y| y.eval()).unwrap();
        kernels::set_qmm_activations(None);
    });
    drop(cbt);
    let w = randn(&[e, n, k], 6);
    for (name, spec) in [
        ("affine2", QuantSpec::affine(64, 2)),
        ("affine4", QuantSpec::affine(64, 4)),
        ("mxfp4", QuantSpec::default_for(QuantMode::Mxfp4)),
    ] {
        let q = packed(&w, spec);
        g.throughput(Throughput::Bytes(per_expert(qbytes(&q))));
        g.bench_function(format!("{name}_k3"), |b| {
            b.iter(|| kernels::gather_qmm(&x, &q, spec, None, Some(&rhs), false).and_then(|y| y.eval()).unwrap())
        });
        g.bench_function(format!("{name}_q8_k3"), |b| {
            kernels::set_qmm_activations(Some(QmmActivations::Q8));
            b.iter(|| kernels::gather_qmm(&x, &q, spec, None, Some(&rhs), false).and_then(|y| y.eval()).unwrap());
            kernels::set_qmm_activations(None);
        });
        g.bench_function(format!("{name}_mlx"), |b| {
            b.iter(|| {
                quant::gather_qmm(&x, &q, spec, true, Gather { rhs_indices: Some(&rhs), ..Default::default() })
                    .and_then(|y| y.eval())
                    .unwrap()
            })
        });
    }
    drop(w);
    g.finish();

    // Short expert rows: the mid-size K3 checkpoint's routed down projection (scripts/bench_e2e.py), 8 of 128
    // experts, 512 -> 1024, batch 1, affine 2-bit. Four stacks (four layers' worth, 100 MB, more than the L3s of
    // the development VMs) taken in turn, so the weights come from memory as in a decode step.
    let mut g = c.benchmark_group("experts_decode_short");
    g.sample_size(20);
    let (e, n, k, layers) = (128, 1024, 512, 4);
    let spec = QuantSpec::affine(64, 2);
    let stacks: Vec<Quantized> = (0..layers).map(|l| packed(&randn(&[e, n, k], 30 + l as u64), spec)).collect();
    let x = randn(&[1, 1, 1, k], 34);
    let idx: Vec<u32> = (0..8).map(|i| (i * 13 + 5) as u32 % e as u32).collect();
    let rhs = Array::from_slice(&idx, &[1, 8]).unwrap();
    g.throughput(Throughput::Bytes(qbytes(&stacks[0]) / e as u64 * 8));
    let mut layer = 0;
    let mut step = move || {
        layer = (layer + 1) % layers;
        kernels::set_qmm_activations(Some(QmmActivations::Q8));
        kernels::gather_qmm(&x, &stacks[layer], spec, None, Some(&rhs), false).and_then(|y| y.eval()).unwrap();
        kernels::set_qmm_activations(None);
    };
    g.bench_function("affine2_q8_k3", |b| b.iter(&mut step));
    // AVX-512 off: the AVX2 row kernel, which the AVX-512 VNNI one replaces at K <= 2048 on VNNI CPUs.
    bench_avx2(&mut g, BenchmarkId::from_parameter("affine2_q8_avx2_k3"), &mut step);
    g.finish();

    let mut g = c.benchmark_group("experts_prefill512");
    g.sample_size(10);
    // 512 tokens x top-8 of 128 experts, sorted by expert (mlx-lm's SwitchGLU sorts when tokens x k >= 64).
    let (e, n, k, tokens, top) = (128, 512, 1024, 512, 8);
    let x = randn(&[tokens * top, 1, k], 7);
    let mut idx: Vec<u32> = (0..tokens * top).map(|i| ((i * 37 + i / 7) % e) as u32).collect();
    idx.sort_unstable();
    let rhs = Array::from_slice(&idx, &[tokens * top]).unwrap();
    let cb = random_codebook(&[e, n, k], 8);
    g.throughput(Throughput::Bytes(cbytes(&cb)));
    g.bench_function("codebook_k3", |b| {
        b.iter(|| codebook::gather_codebook_qmm(&x, &cb, None, Some(&rhs)).and_then(|y| y.eval()).unwrap())
    });
    bench_avx2(&mut g, BenchmarkId::from_parameter("codebook_avx2_k3"), || {
        codebook::gather_codebook_qmm(&x, &cb, None, Some(&rhs)).and_then(|y| y.eval()).unwrap();
    });
    g.bench_function("codebook_q8_k3", |b| {
        kernels::set_qmm_activations(Some(QmmActivations::Q8));
        b.iter(|| codebook::gather_codebook_qmm(&x, &cb, None, Some(&rhs)).and_then(|y| y.eval()).unwrap());
        kernels::set_qmm_activations(None);
    });
    // q8 with AVX-512 off: the row kernels, which the int8 GEMM replaces at this shape on VNNI CPUs.
    bench_avx2(&mut g, BenchmarkId::from_parameter("codebook_q8_avx2_k3"), || {
        kernels::set_qmm_activations(Some(QmmActivations::Q8));
        codebook::gather_codebook_qmm(&x, &cb, None, Some(&rhs)).and_then(|y| y.eval()).unwrap();
        kernels::set_qmm_activations(None);
    });
    let cbt = ternary(&cb);
    g.throughput(Throughput::Bytes(cbytes(&cbt)));
    g.bench_function("codebook_ternary_k3", |b| {
        b.iter(|| codebook::gather_codebook_qmm(&x, &cbt, None, Some(&rhs)).and_then(|y| y.eval()).unwrap())
    });
    bench_avx2(&mut g, BenchmarkId::from_parameter("codebook_ternary_avx2_k3"), || {
        codebook::gather_codebook_qmm(&x, &cbt, None, Some(&rhs)).and_then(|y| y.eval()).unwrap();
    });
    g.bench_function("codebook_ternary_q8_k3", |b| {
        kernels::set_qmm_activations(Some(QmmActivations::Q8));
        b.iter(|| codebook::gather_codebook_qmm(&x, &cbt, None, Some(&rhs)).and_then(|y| y.eval()).unwrap());
        kernels::set_qmm_activations(None);
    });
    bench_avx2(&mut g, BenchmarkId::from_parameter("codebook_ternary_q8_avx2_k3"), || {
        kernels::set_qmm_activations(Some(QmmActivations::Q8));
        codebook::gather_codebook_qmm(&x, &cbt, None, Some(&rhs)).and_then(|y| y.eval()).unwrap();
        kernels::set_qmm_activations(None);
    });
    drop(cbt);
    let w = randn(&[e, n, k], 9);
    for (name, spec) in [("affine2", QuantSpec::affine(64, 2)), ("affine4", QuantSpec::affine(64, 4))] {
        let q = packed(&w, spec);
        g.throughput(Throughput::Bytes(qbytes(&q)));
        g.bench_function(format!("{name}_k3"), |b| {
            b.iter(|| kernels::gather_qmm(&x, &q, spec, None, Some(&rhs), true).and_then(|y| y.eval()).unwrap())
        });
        g.bench_function(format!("{name}_q8_k3"), |b| {
            kernels::set_qmm_activations(Some(QmmActivations::Q8));
            b.iter(|| kernels::gather_qmm(&x, &q, spec, None, Some(&rhs), true).and_then(|y| y.eval()).unwrap());
            kernels::set_qmm_activations(None);
        });
        g.bench_function(format!("{name}_mlx"), |b| {
            b.iter(|| {
                quant::gather_qmm(
                    &x,
                    &q,
                    spec,
                    true,
                    Gather { rhs_indices: Some(&rhs), sorted_indices: true, ..Default::default() },
                )
                .and_then(|y| y.eval())
                .unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, gemv, experts);
criterion_main!(benches);
