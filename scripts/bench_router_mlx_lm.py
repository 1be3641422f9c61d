"""Times mlx-lm's compiled `_group_expert_select` (kimi_k3) on the CPU at Kimi K3's router shape (896 experts,
top-16, ungrouped, with the correction bias) for 1 and 512 tokens, as `mlx-k3 bench --router` times the fused
primitive: median microseconds of one call (graph build + evaluation), and per call when 64 (1 token) or 8
(512 tokens) calls share one evaluation.

Run: .venv/bin/python scripts/bench_router_mlx_lm.py
"""

import time

import mlx.core as mx
from mlx_lm.models.kimi_k3 import _group_expert_select

mx.set_default_device(mx.cpu)
E, K = 896, 16
bias = mx.random.normal((E,), key=mx.random.key(2)) * 0.05


def call(x):
    return _group_expert_select(x, bias, K, 1, 1, 2.827, True)


def time_calls(xs, reps, f=call):
    times = []
    for rep in range(reps + 3):
        t = time.perf_counter()
        outs = [a for x in xs for a in f(x)]
        mx.eval(outs)
        if rep >= 3:
            times.append((time.perf_counter() - t) * 1e6 / len(xs))
    times.sort()
    return times[len(times) // 2]


print(f"mlx-lm _group_expert_select (@mx.compile), {E} experts top-{K}: microseconds per call (median)")
print(f"{'tokens':>7} {'call':>12} {'in graph':>12}")
for tokens in (1, 512):
    xs = [mx.random.normal((1, tokens, E), key=mx.random.key(10 + i)) * 2.0 for i in range(64)]
    mx.eval(xs)
    if tokens == 1:
        # The floor under an isolated call: one `x + 1` graph built and evaluated (as `mlx-k3 bench --router`).
        floor = time_calls(xs[:1], 400, lambda x: [x + 1])
    single = time_calls(xs[:1], 400 if tokens == 1 else 20)
    batch = 64 if tokens == 1 else 8
    many = time_calls(xs[:batch], 40 if tokens == 1 else 3)
    print(f"{tokens:>7} {single:>12.1f} {many:>12.1f}")
print(f"one call of a one-op graph (x + 1, 1 token): {floor:.1f} µs, the floor under an isolated call")
