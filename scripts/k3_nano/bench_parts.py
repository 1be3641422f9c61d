import sys, time
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models import kimi_k3
sys.path.insert(0, "scripts/k3_nano")
from bench_step_cfg import cfg
B, T = 16, 128
c = cfg()
args = kimi_k3.TextArgs.from_dict(c)
mx.random.seed(0)
x = mx.random.normal((B, T, args.hidden_size))
def timeit(name, mod, f):
    g = nn.value_and_grad(mod, lambda m, x: f(m, x).astype(mx.float32).square().mean())
    for i in range(2):
        t0 = time.time(); l, gr = g(mod, x); mx.eval(l, gr); t1 = time.time()
        y = f(mod, x); mx.eval(y); t2 = time.time()
        print(name, "fwd+bwd", round(t1-t0, 3), "fwd", round(t2-t1, 3), flush=True)
kda = kimi_k3.KimiK3DeltaAttention(args, 0)
timeit("kda", kda, lambda m, x: m(x, None, None))
mla = kimi_k3.KimiK3MLAAttention(args)
mask = mx.triu(mx.full((T, T), False), 0)
from mlx_lm.models.base import create_causal_mask
cm = create_causal_mask(T, 0)
timeit("mla", mla, lambda m, x: m(x, cm, None))
moe = kimi_k3.KimiK3SparseMoE(args)
timeit("moe", moe, lambda m, x: m(x))
mlp = kimi_k3.KimiK3MLP(args)
timeit("mlp", mlp, lambda m, x: m(x))
