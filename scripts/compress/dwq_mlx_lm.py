#!/usr/bin/env python3
"""mlx-lm's DWQ next to `mlx-k3 dwq` on the same build, data, steps and learning rate (docs/compression.md#dwq).

Runs mlx-lm 0.32.2's `mlx_lm.quant.dwq.dwq_quantize` (end to end: KL of the logits at temperature 2, Adam with
bias correction on float32 copies of the scales and biases of every affine module below 8 bits, and of every
float parameter the loaded model leaves trainable: norms, KDA's A_log, ...; dwq_quantize freezes nothing) on a build
that mlx-lm loads (MLX formats only), with the calibration windows `mlx-k3 dwq` uses, then measures with mlx-lm
KL(teacher || model), top-1 flips and the perplexity on held-out evaluation windows, for the build, mlx-lm's
result and (given --ours) the output of `mlx-k3 dwq`.

Models are loaded with mlx-lm's `load_model` and run in float32 (MLX's CPU gather_mm is f32-only; the packed
weights keep their packing). mlx-lm trains its float32 copies with the forward seeing them in float32; after
training they are rounded to bfloat16, the dtype the build stores them in, before they are measured
(`mlx-k3 dwq`'s forward sees the stored dtype throughout).

usage: .venv/bin/python scripts/compress/dwq_mlx_lm.py --teacher models/k3-nano \\
           --build /tmp/k3-dwq-ledger/experts_a2_clip --ours /tmp/k3-dwq-ledger/experts_a2_clip-dwq \\
           [--steps 32 --lr 1e-4 --batch 4] [--out report.json]

Step count: `mlx-k3 dwq --steps S --windows W --batch B` gives every trained parameter S Adam steps over
W windows in batches of B; here the W windows are repeated S * B / W times so that mlx-lm's single pass
makes the same S steps of B windows.
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optimizers
import numpy as np
from mlx_lm.quant.dwq import dwq_quantize
from mlx.utils import tree_map
from mlx_lm.utils import load_model


def windows(path, ctx, skip, count):
    tokens = np.array(mx.load(str(path))["tokens"]).reshape(-1)
    have = len(tokens) // ctx
    if skip + count > have:
        sys.exit(f"{path}: {have} windows of {ctx}; --skip {skip} + {count} do not fit")
    return [tokens[(skip + i) * ctx : (skip + i + 1) * ctx].tolist() for i in range(count)]


def measure(model, teacher_logp, eval_windows):
    """Mean KL(teacher || model) per position, top-1 flip rate and perplexity over the windows."""
    kl, flips, nll, n = 0.0, 0, 0.0, 0
    for w, tlp in zip(eval_windows, teacher_logp):
        x = mx.array(w[:-1])[None]
        logits = model(x)[0].astype(mx.float32)
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kl += mx.sum(mx.exp(tlp) * (tlp - logq)).item()
        flips += mx.sum(mx.argmax(tlp, -1) != mx.argmax(logq, -1)).item()
        nll -= mx.sum(mx.take_along_axis(logq, mx.array(w[1:])[:, None], axis=-1)).item()
        n += len(w) - 1
    return {"kl_mean": kl / n, "top1_flip_rate": flips / n, "ppl": float(np.exp(nll / n)), "positions": n}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--build", required=True, help="an MLX-format build (affine experts) mlx-lm loads")
    ap.add_argument("--ours", help="the output of `mlx-k3 dwq` on the same build, measured alongside")
    ap.add_argument("--out", help="also write the report (JSON) here")
    ap.add_argument("--data", default="models/k3-nano/heldout.safetensors")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--skip", type=int, default=150)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--val-skip", type=int, default=40)
    ap.add_argument("--val-windows", type=int, default=4)
    ap.add_argument("--eval-windows", type=int, default=32, help="evaluation windows 0..N")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    mx.random.seed(a.seed)

    train = windows(a.data, a.ctx, a.skip, a.windows)
    valid = windows(a.data, a.ctx, a.val_skip, a.val_windows)
    evalw = windows(a.data, a.ctx, 0, a.eval_windows)
    repeat = max(1, a.steps * a.batch // len(train))
    train_data = [(w, 0) for w in train] * repeat
    valid_data = [(w, 0) for w in valid]

    def load(path):
        model, _ = load_model(Path(path))
        model.set_dtype(mx.float32)
        return model

    teacher = load(a.teacher)
    teacher_logp = []
    for w in evalw:
        lg = teacher(mx.array(w[:-1])[None])[0].astype(mx.float32)
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        mx.eval(lp)
        teacher_logp.append(lp)

    def target_fn(batch, idx, split):
        return teacher(batch)

    student = load(a.build)
    before = measure(student, teacher_logp, evalw)
    opt = optimizers.Adam(learning_rate=a.lr, bias_correction=True)
    dwq_quantize(
        student,
        target_fn,
        opt,
        train_data,
        valid_data,
        batch_size=a.batch,
        max_seq_length=a.ctx,
        seed=a.seed,
        dtype=mx.float32,
    )
    trained = student.trainable_parameters()
    student.update(tree_map(lambda x: x.astype(mx.bfloat16).astype(mx.float32), trained))
    after = measure(student, teacher_logp, evalw)

    report = {
        "mlx_lm_steps": len(train_data) // a.batch,
        "lr": a.lr,
        "batch": a.batch,
        "train_windows": [a.skip, a.skip + a.windows],
        "eval_windows": [0, a.eval_windows],
        "build": before,
        "mlx_lm_dwq": after,
    }
    if a.ours:
        report["mlx_k3_dwq"] = measure(load(a.ours), teacher_logp, evalw)
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
