//! SiTU: the fused primitive against the plain-ops composition it replaces (mlx-lm's `_situ` written with
//! MLX ops: two casts, two tanh, a sigmoid and four multiplies, each a separate pass over memory).
//!
//! Both run inside the timer including graph building and evaluation (MLX is lazy). Throughput counts the
//! bytes that must move at least once: two inputs read and one output written.
//!
//! Run: `cargo bench -p mlx-k3 --bench situ`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mlx_k3::kernels::{situ, situ_reference};
use mlx_k3::{random, Array, Dtype};

fn inputs(rows: i32, cols: i32, dtype: Dtype) -> (Array, Array) {
    let k = random::key(0).unwrap();
    let ks = random::split(&k, 2).unwrap();
    let k0 = ks.slice_axis(0, 0, 1).unwrap().squeeze(&[0]).unwrap();
    let k1 = ks.slice_axis(0, 1, 2).unwrap().squeeze(&[0]).unwrap();
    let up = random::normal(&[rows, cols], Dtype::F32, 0.0, 2.0, Some(&k0)).unwrap().astype(dtype).unwrap();
    let gate = random::normal(&[rows, cols], Dtype::F32, 0.0, 2.0, Some(&k1)).unwrap().astype(dtype).unwrap();
    mlx_k3::eval(&[&up, &gate]).unwrap();
    (up, gate)
}

fn bench_situ(c: &mut Criterion) {
    let mut group = c.benchmark_group("situ");
    // Decode: 16 routed experts x 3072 intermediate (Kimi K3's top-16); a prefill chunk: 1024 (token, expert)
    // rows x 3072.
    for (name, rows, cols) in [("decode_16x3072", 16, 3072), ("chunk_1024x3072", 1024, 3072)] {
        for dtype in [Dtype::F32, Dtype::BF16] {
            let (up, gate) = inputs(rows, cols, dtype);
            let bytes = 3 * (rows as u64) * (cols as u64) * dtype.size_of() as u64;
            group.throughput(Throughput::Bytes(bytes));
            let id = format!("{name}/{dtype}");
            group.bench_with_input(BenchmarkId::new("primitive", &id), &(), |b, _| {
                b.iter(|| situ(&up, &gate, 1.0, Some(8.0)).and_then(|y| y.eval()).unwrap())
            });
            group.bench_with_input(BenchmarkId::new("plain_ops", &id), &(), |b, _| {
                b.iter(|| situ_reference(&up, &gate, 1.0, Some(8.0)).and_then(|y| y.eval()).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_situ);
criterion_main!(benches);
