"""Times mlx-lm 0.32.2's DSA indexer (`deepseek_v32.Indexer`) for one decode token on the CPU at 4096, 16384
and 65536 cached positions, top-2048, with Kimi K3.1's indexer shape (32 heads x 128) and DeepSeek-V3.2's
(64 x 128), in f32 and bf16, as `cargo bench -p mlx-k3 --bench indexer` times mlx-k3's decode step:

- "call": `Indexer.__call__` with a KVCache holding the other positions (random weights, hidden 4096 and
  q_lora_rank 1536, mlx-lm's defaults): the projections, the rotation, the cache update and the selection;
- "select": the part of that call mlx-k3's fused step replaces, exactly as mlx-lm writes it (q @ k^T, relu,
  the head weights, the sum over heads, argpartition, the slice) on precomputed q, w and keys.

Median milliseconds of one call, graph build + evaluation. Run: .venv/bin/python scripts/bench_indexer_mlx_lm.py
"""

import math
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.models.deepseek_v32 import Indexer, ModelArgs

mx.set_default_device(mx.cpu)
TOPK, D = 2048, 128


def median_ms(f, reps):
    times = []
    for rep in range(reps + 2):
        t = time.perf_counter()
        mx.eval(f())
        if rep >= 2:
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def select(q, k, w):
    # deepseek_v32.Indexer.__call__ from `scores = q @ k.swapaxes(-1, -2)` on, one query (s == 1), no mask.
    scores = q @ k.swapaxes(-1, -2)
    scores = mx.maximum(scores, 0)
    scores = scores * w
    scores = scores.sum(axis=1, keepdims=True)
    return mx.argpartition(scores, kth=-TOPK, axis=-1)[..., -TOPK:]


def main():
    sizes = [int(a) for a in sys.argv[1:]] or [4096, 16384, 65536]
    print("mlx-lm deepseek_v32.Indexer, one decode token, top-2048: milliseconds per call (median)")
    print(f"{'shape':>12} {'dtype':>9} {'positions':>9} {'call':>9} {'select':>9}")
    for name, heads in (("k31_32x128", 32), ("v32_64x128", 64)):
        for dt in (mx.float32, mx.bfloat16):
            args = ModelArgs(model_type="deepseek_v32", index_n_heads=heads, index_head_dim=D, index_topk=TOPK)
            idx = Indexer(args)
            idx.set_dtype(dt)
            mx.eval(idx.parameters())
            x = mx.random.normal((1, 1, args.hidden_size), key=mx.random.key(1)).astype(dt)
            qr = mx.random.normal((1, 1, args.q_lora_rank), key=mx.random.key(2)).astype(dt)
            for s in sizes:
                reps = 20 if s <= 16384 else 8
                cache = KVCache()
                cap = math.ceil(s / KVCache.step) * KVCache.step
                cache.keys = mx.random.normal((1, 1, cap, D), key=mx.random.key(3)).astype(dt)
                cache.values = mx.zeros_like(cache.keys)
                mx.eval(cache.keys, cache.values)

                def call():
                    cache.offset = s - 1  # the same step again: s positions after the update
                    return idx(x, qr, None, cache)

                q = mx.random.normal((1, heads, 1, D), key=mx.random.key(4)).astype(dt)
                w = (mx.random.normal((1, heads, 1, 1), key=mx.random.key(5)) * 0.1).astype(dt)
                k = cache.keys[:, :, :s, :]
                mx.eval(q, w, k)
                c = median_ms(call, reps)
                sel = median_ms(lambda: select(q, k, w), reps)
                print(f"{name:>12} {str(dt).split('.')[-1]:>9} {s:>9} {c:>9.2f} {sel:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
