#!/usr/bin/env python3
"""mlx-lm's DWQ on a tiny model: the fixture for `mlx-k3 dwq --mode end-to-end`'s parity test.

Writes mlx-k3/tests/fixtures/dwq_parity/:

- `config.json`, `model.safetensors`, `model.safetensors.index.json`: the tiny K3 teacher of
  mlx-k3/tests/fixtures/k3/a_latent_norm_attnres quantized by mlx-lm 0.32.2 (`quantize_model`: routed experts
  affine 2-bit, groups of 32; every other module affine 8-bit, groups of 32, except the attention-residual
  projections, left float; float32 scales and biases);
- `tokens.safetensors`: 3 windows of 32 random token ids (`tokens`, int32, numpy seed 7): 2 to train on, one
  held out;
- `expected.json`: what mlx-lm's `mlx_lm.quant.dwq.dwq_quantize` does on that model with the teacher: 3 Adam
  steps (bias correction, lr 1e-3) on the batch of both windows, temperature 2, parameters and forward in
  float32, everything but the 2-bit modules' scales and biases frozen first (see below). For each step: the training loss (mean over positions of KL(teacher ‖ student) at temperature 2,
  computed with mlx-lm's `kl_div_loss` as its loss does, at the parameters the step starts from) and the
  global L2 norm of the gradient it applied (recorded by the optimizer), and the trained parameter count.

The optimizer is mlx's `Adam(bias_correction=True)` with one hook: `apply_gradients` records the gradient and
the parameters it returns, so the losses are evaluated at exactly the parameters mlx-lm's steps produced.

usage: .venv/bin/python scripts/compress/dwq_parity_fixture.py
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optimizers
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.quant.dwq import dwq_quantize
from mlx_lm.tuner.losses import kl_div_loss
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

ROOT = Path(__file__).resolve().parents[2]
TEACHER = ROOT / "mlx-k3/tests/fixtures/k3/a_latent_norm_attnres"
OUT = ROOT / "mlx-k3/tests/fixtures/dwq_parity"
CTX, WINDOWS, STEPS, LR, TEMP = 32, 2, 3, 1e-3, 2.0


class Recording(optimizers.Adam):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.grads, self.params = [], []

    def apply_gradients(self, gradients, parameters):
        out = super().apply_gradients(gradients, parameters)
        mx.eval(out, gradients)
        self.grads.append(gradients)
        self.params.append(out)
        return out


def main():
    mx.set_default_device(mx.cpu)
    mx.random.seed(0)
    teacher, config = load_model(TEACHER)
    teacher.set_dtype(mx.float32)
    student, _ = load_model(TEACHER)
    student.set_dtype(mx.float32)

    def predicate(path, module):
        # The attention-residual projections ([1, hidden]) stay float, as mlx-lm's conversions leave them.
        if not hasattr(module, "to_quantized") or "res_proj" in path:
            return False
        bits = 2 if "switch_mlp" in path else 8
        return {"group_size": 32, "bits": bits, "mode": "affine"}

    student, qconfig = quantize_model(student, dict(config), 32, 8, quant_predicate=predicate)
    OUT.mkdir(parents=True, exist_ok=True)
    save_model(OUT, student)
    save_config(qconfig, OUT / "config.json")

    rng = np.random.default_rng(7)
    # The training windows, then one held out for `mlx-k3 dwq`'s validation (mlx-lm validates on the training
    # windows here; its validation does not change what it trains).
    tokens = rng.integers(0, 256, size=(WINDOWS + 1) * CTX).astype(np.int32)
    mx.save_safetensors(str(OUT / "tokens.safetensors"), {"tokens": mx.array(tokens)})
    windows = [tokens[i * CTX : (i + 1) * CTX].tolist() for i in range(WINDOWS)]
    # One batch of both windows per step: mlx-lm's batches are consecutive length-sorted windows (all equal).
    train = [(w, 0) for w in windows] * STEPS
    batches = []

    def target_fn(batch, idx, split):
        if split == "train":
            batches.append(batch)
        return teacher(batch)

    # mlx-lm's DWQ unfreezes the scales and biases of the sub-8-bit quantized modules but freezes nothing
    # itself: on a model loaded as is, every float parameter (norms, KDA's A_log and convolution, ...) trains
    # too. Frozen first, it trains what `mlx-k3 dwq --only-below-8-bits` trains.
    student.freeze()
    opt = Recording(learning_rate=LR, bias_correction=True)
    start = dict(tree_flatten(student.parameters()))
    dwq_quantize(student, target_fn, opt, train, [(w, 0) for w in windows], batch_size=WINDOWS,
                 max_seq_length=CTX, seed=0, dtype=mx.float32, temperature=TEMP)
    assert len(batches) == STEPS and len(opt.grads) == STEPS
    for b in batches:
        rows = sorted(np.array(b).tolist())
        assert rows == sorted(w[:-1] for w in windows), "a batch is not the two windows"
    # Trainable after dwq_quantize's unfreeze: the scales and biases of the 2-bit modules.
    names = sorted(k for k, _ in tree_flatten(student.trainable_parameters()))
    assert names and all("switch_mlp" in n and n.rsplit(".", 1)[1] in ("scales", "biases") for n in names), names

    scale = 1.0 / TEMP
    losses, norms = [], []
    params = [{n: start[n] for n in names}] + [dict(tree_flatten(p)) for p in opt.params[:-1]]
    for p, g, b in zip(params, opt.grads, batches):
        student.update(tree_unflatten_dict(p))
        logits, targets = student(b), teacher(b)
        loss = kl_div_loss(scale * logits, scale * targets).mean()
        losses.append(loss.item())
        norms.append(float(np.sqrt(sum(float(mx.sum(v.astype(mx.float32) ** 2).item()) for _, v in tree_flatten(g)))))
    expected = {
        "mlx_lm": "0.32.2",
        "ctx": CTX,
        "windows": WINDOWS,
        "steps": STEPS,
        "lr": LR,
        "temperature": TEMP,
        "trained_tensors": len(names),
        "trained_params": int(sum(start[n].size for n in names)),
        "train_loss": losses,
        "grad_norm": norms,
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(json.dumps(expected, indent=2))


def tree_unflatten_dict(flat):
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(flat.items()))


if __name__ == "__main__":
    main()
