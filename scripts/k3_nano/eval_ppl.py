"""Held-out perplexity of k3-nano with mlx-lm, and a reference file for the Rust engine.

    .venv/bin/python scripts/k3_nano/eval_ppl.py [--model models/k3-nano] [--window 256]

Definition (exactly what is computed):
  * tokens: `tokens` of <model>/heldout.safetensors, the held-out stream written by train.py
    ([BOS] text [EOS] for each held-out file, files in sorted path order, concatenated; int32);
  * windows: non-overlapping, W = 256 tokens each: window i = tokens[i*W : (i+1)*W] for
    i = 0 .. floor(len/W) - 1 (the trailing partial window is dropped). Every window starts from an empty
    state (no cache, no carry-over);
  * per window: one cache-less forward of window[:-1] through mlx-lm (`model(inputs)`, causal), logits in
    fp32, cross-entropy of the next token: loss_t = logsumexp(logits_t) - logits_t[window[t+1]] for
    t = 0 .. W-2, so W-1 = 255 predicted tokens per window; window_loss[i] = mean over those 255;
  * mean_loss = mean over ALL predicted tokens (= mean of window_loss, every window has 255);
    perplexity = exp(mean_loss).

Model: loaded with `mlx_lm.utils.load_model` (bf16 weights, A_log / dt_bias / e_score_correction_bias fp32),
then upcast to fp32 with `model.set_dtype(mx.float32)` (lossless) and run in fp32: MLX's CPU backend runs
GatherMM (the routed experts) in fp32 only. mlx-lm's own KDA path (the per-token loop) is used, not the
chunked training form.

Output: <model>/eval_reference.safetensors
  tokens        int32   [N, W]   the windows
  window_loss   float32 [N]      mean next-token cross-entropy per window (nats)
  window_len    int32   [1]      W
  mean_loss     float32 [1]
  perplexity    float32 [1]
  token_loss    float32 [4, W-1] per-token losses of the first 4 windows (for debugging a mismatch)
and the same numbers in the safetensors metadata (as strings).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.check_pins()
BLAS = common.maybe_reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

WINDOW = 256
BATCH = 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=common.OUT)
    ap.add_argument("--window", type=int, default=WINDOW)
    ap.add_argument("--limit", type=int, default=None, help="only the first N windows (quick checks)")
    args = ap.parse_args()
    W = args.window
    t0 = time.time()

    model, _ = load_model(args.model)
    model.set_dtype(mx.float32)
    model.eval()

    tokens = np.array(mx.load(str(args.model / "heldout.safetensors"))["tokens"]).astype(np.int32)
    n = len(tokens) // W
    if args.limit:
        n = min(n, args.limit)
    windows = tokens[: n * W].reshape(n, W)

    losses = []
    for i in range(0, n, BATCH):
        w = mx.array(windows[i : i + BATCH])
        logits = model(w[:, :-1]).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, w[:, 1:], reduction="none")  # [b, W-1]
        mx.eval(ce)
        losses.append(np.array(ce))
    token_loss = np.concatenate(losses).astype(np.float32)  # [n, W-1]
    window_loss = token_loss.mean(axis=1, dtype=np.float64).astype(np.float32)
    mean_loss = float(token_loss.mean(dtype=np.float64))
    ppl = math.exp(mean_loss)

    meta = {
        "definition": "non-overlapping windows tokens[i*W:(i+1)*W] of heldout.safetensors; cache-less forward "
        "of window[:-1]; fp32 next-token cross-entropy on window[1:]; window_loss = mean over W-1 tokens; "
        "perplexity = exp(mean over all predicted tokens)",
        "model": "mlx_lm.utils.load_model, bf16 weights upcast to fp32 (set_dtype), fp32 compute, CPU",
        "window_len": str(W),
        "windows": str(n),
        "predicted_tokens": str(n * (W - 1)),
        "mean_loss": repr(mean_loss),
        "perplexity": repr(ppl),
        "mlx": mx.__version__,
        "blas": BLAS,
    }
    mx.save_safetensors(
        str(args.model / "eval_reference.safetensors"),
        {
            "tokens": mx.array(windows),
            "window_loss": mx.array(window_loss),
            "window_len": mx.array([W], dtype=mx.int32),
            "mean_loss": mx.array([mean_loss], dtype=mx.float32),
            "perplexity": mx.array([ppl], dtype=mx.float32),
            "token_loss": mx.array(token_loss[:4]),
        },
        metadata=meta,
    )
    print(json.dumps({**meta, "seconds": round(time.time() - t0, 1),
                      "window_loss_min_max": [float(window_loss.min()), float(window_loss.max())]}, indent=1))


if __name__ == "__main__":
    main()
