import sys, time
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models import kimi_k3
sys.path.insert(0, "scripts/k3_nano")
from bench_step_cfg import cfg
import kda_chunked
B, T, heads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if sys.argv[4] == "1": kda_chunked.install()
c = cfg(heads=heads)
args = kimi_k3.TextArgs.from_dict(c)
mx.random.seed(0)
x = mx.random.normal((B, T, args.hidden_size))
kda = kimi_k3.KimiK3DeltaAttention(args, 0)
g = nn.value_and_grad(kda, lambda m, x: m(x, None, None).astype(mx.float32).square().mean())
for i in range(3):
    t0 = time.time(); l, gr = g(kda, x); mx.eval(l, gr); t1 = time.time()
print(B, T, heads, sys.argv[4], "kda fwd+bwd", round(t1-t0, 3), flush=True)
if len(sys.argv) > 5:
    kimi_k3.gated_delta_update = lambda q, k, v, a, b, *r, **kw: (v * mx.sigmoid(b)[..., None] + q * a, None)
    for i in range(3):
        t0 = time.time(); l, gr = g(kda, x); mx.eval(l, gr); t1 = time.time()
    print("no recurrence", round(t1-t0, 3))
