import sys, time
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models import kimi_k3
from mlx_lm.models.base import create_causal_mask
sys.path.insert(0, "scripts/k3_nano")
from bench_step_cfg import cfg
B, T = 32, 128
c = cfg(L=6, kda=(1,2,4,5), heads=2); c["intermediate_size"] = 256
args = kimi_k3.TextArgs.from_dict(c)
mx.random.seed(0)
x = mx.random.normal((B, T, args.hidden_size))
def timeit(name, mod, f):
    g = nn.value_and_grad(mod, lambda m, x: f(m, x).astype(mx.float32).square().mean())
    for i in range(2):
        t0 = time.time(); l, gr = g(mod, x); mx.eval(l, gr); t1 = time.time()
    print(name, "fwd+bwd", round(t1-t0, 3), flush=True)
timeit("kda", kimi_k3.KimiK3DeltaAttention(args, 0), lambda m, x: m(x, None, None))
cm = create_causal_mask(T, 0)
timeit("mla", kimi_k3.KimiK3MLAAttention(args), lambda m, x: m(x, cm, None))
timeit("moe", kimi_k3.KimiK3SparseMoE(args), lambda m, x: m(x))
timeit("mlp", kimi_k3.KimiK3MLP(args), lambda m, x: m(x))
head = nn.Linear(256, 3072, bias=False)
y = mx.random.randint(0, 3000, (B, T))
timeit("head+ce", head, lambda m, x: nn.losses.cross_entropy(m(x), y))
