"""Reference trajectory of `mlx.optimizers.Adam` with bias correction, for mlx-k3's Adam parity test
(mlx-k3/tests/optim.rs).

The problem: a linear least-squares fit, loss = mean((x @ w + b - y)^2), with x [8, 4], y [8, 3] and the
parameters w [4, 3], b [3] (float32), trained for 6 steps by Adam(learning_rate=0.05, betas=(0.9, 0.999),
eps=1e-8, bias_correction=True) on the CPU. The gradients come from mx.value_and_grad.

Writes mlx-k3/tests/fixtures/optim/adam.safetensors: `x`, `y`, `w0`, `b0` (the start), `w{t}`, `b{t}` and
`loss{t}` (the loss before step t) for t = 1..6; metadata records the hyper-parameters and the MLX version.

Run: .venv/bin/python scripts/make_adam_fixture.py
"""

import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pins  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "mlx-k3/tests/fixtures/optim/adam.safetensors"
STEPS = 6
LR, BETAS, EPS = 0.05, (0.9, 0.999), 1e-8


def main():
    if mx.__version__ != pins.MLX:
        sys.exit(f"mlx {mx.__version__} is installed; the fixture is made with the pinned mlx {pins.MLX}")
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(2026)
    x = mx.array(rng.standard_normal((8, 4)).astype(np.float32))
    y = mx.array(rng.standard_normal((8, 3)).astype(np.float32))
    params = {
        "w": mx.array(rng.standard_normal((4, 3)).astype(np.float32)),
        "b": mx.array(rng.standard_normal((3,)).astype(np.float32)),
    }
    out = {"x": x, "y": y, "w0": params["w"], "b0": params["b"]}

    def loss_fn(p):
        return mx.mean(mx.square(x @ p["w"] + p["b"] - y))

    opt = optim.Adam(learning_rate=LR, betas=list(BETAS), eps=EPS, bias_correction=True)
    for t in range(1, STEPS + 1):
        loss, grads = mx.value_and_grad(loss_fn)(params)
        params = opt.apply_gradients(grads, params)
        mx.eval(params, opt.state)
        out[f"loss{t}"] = loss
        out[f"w{t}"] = params["w"]
        out[f"b{t}"] = params["b"]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    meta = {"lr": str(LR), "betas": f"{BETAS[0]},{BETAS[1]}", "eps": str(EPS), "steps": str(STEPS), "mlx": mx.__version__}
    mx.save_safetensors(str(OUT), out, metadata=meta)
    print(f"wrote {OUT.relative_to(ROOT)}: {STEPS} steps, final loss {loss_fn(params).item():.6f}")


if __name__ == "__main__":
    main()
