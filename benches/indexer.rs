//! The DSA indexer's decode step (one query row) at 4096, 16384 and 65536 cached positions, top-2048, with
//! Kimi K3.1's indexer shape (32 heads x 128) and DeepSeek-V3.2's (64 x 128), keys in f32 and bf16 (the cache
//! holds the model's dtype): the fused CPU primitive (`kernels::indexer_topk`: one pass over the keys, radix
//! selection) against the MLX ops it replaces (`kernels::indexer_topk_reference`: matmul, relu, the head
//! weights, the sum over heads, argpartition; what the model ran before). mlx-lm's `deepseek_v32.Indexer` is
//! timed by `scripts/bench_indexer_mlx_lm.py`; `scripts/bench_indexer.sh` runs both, alternated.
//!
//! Graph building and evaluation are inside the timer. Run: `cargo bench -p mlx-k3 --bench indexer`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mlx_k3::kernels::{indexer_topk, indexer_topk_reference};
use mlx_k3::{random, Array, Device, Dtype};

fn randn(shape: &[i32], dtype: Dtype, seed: u64) -> Array {
    let a = random::normal(shape, Dtype::F32, 0.0, 1.0, Some(&random::key(seed).unwrap())).unwrap();
    let a = a.astype(dtype).unwrap();
    a.eval().unwrap();
    a
}

fn bench_indexer(c: &mut Criterion) {
    // The CPU primitive and the CPU ops, whatever the default device.
    mlx_k3::with_device(Device::Cpu, || bench_cpu(c)).unwrap();
}

fn bench_cpu(c: &mut Criterion) {
    let mut g = c.benchmark_group("indexer");
    g.sample_size(10);
    const TOPK: i32 = 2048;
    const D: i32 = 128;
    for (name, heads) in [("k31_32x128", 32), ("v32_64x128", 64)] {
        for dt in [Dtype::F32, Dtype::BF16] {
            let q = randn(&[1, heads, D], dt, 1);
            let w = randn(&[1, heads], dt, 2).multiply(0.1f32).unwrap();
            w.eval().unwrap();
            for s in [4096, 16384, 65536] {
                // The cache's layout: [B, 1, capacity, d], the first s positions in use.
                let keys = randn(&[1, 1, s + 256, D], dt, 3).slice_axis(2, 0, s).unwrap();
                g.throughput(Throughput::Bytes((s as u64) * D as u64 * dt.size_of() as u64));
                let id = format!("{name}/{dt:?}/{s}");
                g.bench_with_input(BenchmarkId::new("fused", &id), &(), |b, _| {
                    b.iter(|| indexer_topk(&q, &w, &keys, TOPK).unwrap().eval().unwrap())
                });
                g.bench_with_input(BenchmarkId::new("mlx_ops", &id), &(), |b, _| {
                    b.iter(|| indexer_topk_reference(&q, &w, &keys, TOPK).unwrap().eval().unwrap())
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench_indexer);
criterion_main!(benches);
