"""mlx-lm's logits for a checkpoint written by `mlx-k3 convert`: the fixture that checks mlx-lm reads our output.

usage: .venv/bin/python scripts/compress/mlx_lm_logits.py MODEL_DIR OUT.safetensors TOKEN,TOKEN,...

Needs mlx 0.32.4 and mlx-lm 0.32.2 (scripts/k3_nano/requirements.txt). The checkpoint is loaded with mlx-lm's
own `load_model` (per-path quantization from config.json), upcast to float32 (quantized weights keep their
packing) and run on the prompt; the output holds `logits` [T, vocab] (f32) and, as metadata, the SHA-256 of
every file of MODEL_DIR the logits were computed from, so a test can tell when the fixture is stale.

The committed fixture (mlx-k3/tests/fixtures/compress/mlx_lm_mix_logits.safetensors) is made by:

    mlx-k3 convert --from models/k3-nano --to /tmp/mlx_mix \
        --recipe mlx-k3/tests/fixtures/compress/mlx_mix.json
    .venv/bin/python scripts/compress/mlx_lm_logits.py /tmp/mlx_mix \
        mlx-k3/tests/fixtures/compress/mlx_lm_mix_logits.safetensors \
        2046,474,300,12,99,1500,7,260,2000,44,512,1024
"""
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model


def main():
    model_dir, out, tokens = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    model, _ = load_model(model_dir)
    # MLX's CPU gather_mm (dense expert stacks) is f32-only; quantized weights keep their packing.
    model.set_dtype(mx.float32)
    ids = mx.array([[int(t) for t in tokens.split(",")]])
    logits = model(ids).astype(mx.float32)[0]
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.iterdir())
        if p.name.endswith(".safetensors") or p.name == "config.json"
    }
    meta = {"tokens": tokens, "files_sha256": json.dumps(files, sort_keys=True)}
    mx.save_safetensors(out, {"logits": logits}, metadata=meta)


if __name__ == "__main__":
    main()
