//! The fused MoE router against the plain-ops composition it replaces (mlx-lm's `_group_expert_select`
//! written with MLX ops: sigmoid, bias add, negate, argpartition, slice, take_along_axis, sum, divide,
//! scale, cast), at Kimi K3's shape (896 experts, top-16, ungrouped, with the correction bias) for one
//! decode token and a 512-token prefill chunk, plus a grouped configuration (256 experts, 8 groups, top-4
//! groups, top-8). mlx-lm's compiled function is timed by `scripts/bench_router_mlx_lm.py` (Python).
//!
//! Graph building and evaluation are inside the timer. Run: `cargo bench -p mlx-k3 --bench router`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mlx_k3::kernels::{moe_router, route_reference, RouterParams};
use mlx_k3::{random, Array, Dtype};

fn randn(shape: &[i32], scale: f32, seed: u64) -> Array {
    let a = random::normal(shape, Dtype::F32, 0.0, scale, Some(&random::key(seed).unwrap())).unwrap();
    a.eval().unwrap();
    a
}

fn bench_router(c: &mut Criterion) {
    let mut g = c.benchmark_group("router");
    for (name, e, k, ng, kg) in [("k3_896_top16", 896, 16, 1, 1), ("grouped_256_8g4_top8", 256, 8, 8, 4)] {
        let p = RouterParams { top_k: k, n_group: ng, topk_group: kg, routed_scaling_factor: 2.827, renormalize: true };
        let bias = randn(&[e], 0.05, 2);
        for tokens in [1, 512] {
            let x = randn(&[1, tokens, e], 2.0, 1);
            g.throughput(Throughput::Elements(tokens as u64));
            let id = format!("{name}/{tokens}tok");
            g.bench_with_input(BenchmarkId::new("fused", &id), &(), |b, _| {
                b.iter(|| {
                    let r = moe_router(&x, Some(&bias), None, p).unwrap();
                    mlx_k3::eval(&[&r.indices, &r.weights]).unwrap()
                })
            });
            g.bench_with_input(BenchmarkId::new("floor_negate", &id), &(), |b, _| {
                b.iter(|| x.negative().unwrap().eval().unwrap())
            });
            g.bench_with_input(BenchmarkId::new("plain_ops", &id), &(), |b, _| {
                b.iter(|| {
                    let (i, w) = route_reference(&x, Some(&bias), p).unwrap();
                    mlx_k3::eval(&[&i, &w]).unwrap()
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench_router);
criterion_main!(benches);
