import sys, time
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models import kimi_k3
sys.path.insert(0, "scripts/k3_nano")
from bench_step_cfg import cfg
B, T, comp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
c = cfg(heads=int(sys.argv[4]) if len(sys.argv) > 4 else 4)
args = kimi_k3.TextArgs.from_dict(c)
mx.random.seed(0)
x = mx.random.normal((B, T, args.hidden_size))
kda = kimi_k3.KimiK3DeltaAttention(args, 0)
g = nn.value_and_grad(kda, lambda m, x: m(x, None, None).astype(mx.float32).square().mean())
if comp:
    g = mx.compile(g)
for i in range(3):
    t0 = time.time(); l, gr = g(kda, x); mx.eval(l, gr); t1 = time.time()
    print(B, T, "comp" if comp else "", "kda fwd+bwd", round(t1-t0, 3), "per 1k tok", round((t1-t0)/(B*T)*1000, 3), flush=True)
