"""Sample from k3-nano with mlx-lm's model and plain greedy / temperature sampling.

    .venv/bin/python scripts/k3_nano/sample.py --prompt "def " --temp 0.8 --tokens 150 --seed 1

[BOS] is prepended to the prompt; generation stops at [EOS] or <|im_end|> (generation_config.json). The bf16
checkpoint runs upcast to fp32 on a CPU (MLX's CPU GatherMM is fp32-only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.check_pins()
common.maybe_reexec_with_openblas()

import mlx.core as mx  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from infer import load_encoding, sample  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=common.OUT)
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
    enc = load_encoding(args.model)
    gen = json.loads((args.model / "generation_config.json").read_text())
    bos = enc.encode_single_token("[BOS]")
    print(sample(model, enc, args.prompt, bos, set(gen["eos_token_id"]), args.tokens, args.temp, args.seed))


if __name__ == "__main__":
    main()
