"""Reference outputs of mlx-lm's `_group_expert_select` (mlx_lm/models/kimi_k3.py, compiled, CPU) for the
fused router's parity test (mlx-k3/tests/router.rs).

Writes mlx-k3/tests/fixtures/router/group_expert_select.safetensors: per case i, `case{i}.logits`
(the logits as given, f32 or bf16), `case{i}.bias` (f32, when the case has one), `case{i}.inds` (uint32, in the
order mlx-lm returns them) and `case{i}.weights` (the logits' dtype); the metadata key `cases` holds the
router parameters of each case as JSON. Deterministic (numpy default_rng(2026)).

Run: .venv/bin/python scripts/make_router_fixtures.py
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.kimi_k3 import _group_expert_select

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "mlx-k3/tests/fixtures/router/group_expert_select.safetensors"

# (rows, experts, top_k, n_group, topk_group, scale, renormalize, logits pattern, bias pattern, dtype)
CASES = [
    (8, 896, 16, 1, 1, 2.5, True, "normal", "small", "float32"),
    (4, 896, 16, 1, 1, 1.0, True, "levels", "none", "float32"),
    (8, 256, 8, 8, 4, 2.5, True, "normal", "negative", "float32"),
    (4, 1024, 32, 1, 1, 1.0, True, "saturated", "levels", "float32"),
    (8, 64, 6, 8, 3, 1.0, False, "levels", "levels", "float32"),
    (4, 384, 8, 1, 1, 2.827, True, "normal", "small", "bfloat16"),
    (6, 128, 8, 4, 2, 1.0, True, "equal", "none", "float32"),
]


def logits(rng, rows, e, pattern):
    if pattern == "normal":
        return 2.0 * rng.standard_normal((rows, e))
    if pattern == "levels":
        return rng.choice([-1.0, 0.0, 0.5, 1.0], size=(rows, e))
    if pattern == "saturated":
        return rng.choice([-120.0, -40.0, 17.0, 40.0, 100.0, 0.0], size=(rows, e))
    return np.full((rows, e), 0.25)


def bias(rng, e, pattern):
    if pattern == "none":
        return None
    if pattern == "small":
        return 0.05 * rng.standard_normal(e)
    if pattern == "negative":
        return -2.0 + 0.1 * rng.standard_normal(e)
    return rng.choice([0.0, 0.125, -0.125], size=e)


def main():
    rng = np.random.default_rng(2026)
    tensors, meta = {}, []
    for i, (rows, e, k, ng, kg, scale, renorm, lp, bp, dt) in enumerate(CASES):
        x = mx.array(logits(rng, rows, e, lp).astype(np.float32)).astype(getattr(mx, dt))
        b = bias(rng, e, bp)
        b = None if b is None else mx.array(b.astype(np.float32))
        inds, w = _group_expert_select(x, b, k, ng, kg, scale, renorm)
        tensors[f"case{i}.logits"] = x
        if b is not None:
            tensors[f"case{i}.bias"] = b
        tensors[f"case{i}.inds"] = inds
        tensors[f"case{i}.weights"] = w
        meta.append(dict(top_k=k, n_group=ng, topk_group=kg, routed_scaling_factor=scale, renormalize=renorm,
                         has_bias=b is not None))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(OUT), tensors, metadata={"cases": json.dumps(meta)})
    print(f"wrote {len(CASES)} cases to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
