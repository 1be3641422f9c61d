import sys, time
import mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3
sys.path.insert(0, "scripts/k3_nano")
from bench_step_cfg import cfg
B, T, comp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
c = cfg(L=6, kda=(1,2,4,5), heads=int(sys.argv[4]), H=256)
c["intermediate_size"] = 256
mx.random.seed(0)
model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(c))
print("params", sum(v.size for _, v in tree_flatten(model.parameters())))
opt = optim.AdamW(1e-3)
lg = nn.value_and_grad(model, lambda m, x, y: nn.losses.cross_entropy(m(x), y).mean())
def step(x, y):
    l, g = lg(model, x, y); opt.update(model, g); return l
if comp:
    state = [model.state, opt.state]
    step = mx.compile(step, inputs=state, outputs=state)
x = mx.random.randint(0, 3000, (B, T+1))
for i in range(4):
    t0 = time.time(); l = step(x[:, :-1], x[:, 1:]); mx.eval(l, model.parameters(), opt.state); dt = time.time()-t0
    print(i, round(float(l), 3), round(dt, 3), "tok/s", round(B*T/dt), flush=True)
