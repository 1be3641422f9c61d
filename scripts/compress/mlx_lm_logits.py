"""mlx-lm's logits for a checkpoint written by `mlx-k3 convert`: the fixture that checks mlx-lm reads our output.

usage: .venv/bin/python scripts/compress/mlx_lm_logits.py MODEL_DIR OUT.safetensors TOKEN,TOKEN,... \
           [--requantize-experts BITS]

Needs mlx 0.32.4 and mlx-lm 0.32.2 (scripts/k3_nano/requirements.txt). The checkpoint is loaded with mlx-lm's
own `load_model` (per-path quantization from config.json), upcast to float32 (quantized weights keep their
packing) and run on the prompt; the output holds `logits` [T, vocab] (f32) and, as metadata, the SHA-256 of
every file of MODEL_DIR the logits were computed from, so a test can tell when the fixture is stale.

`--requantize-experts BITS` is the independent reference for re-quantizing a release checkpoint's MXFP4
routed experts: after loading, every MXFP4 expert stack is decoded by MLX (`mx.dequantize`), rounded to
bfloat16 (exact: E2M1 code x power-of-two scale) and quantized again by MLX's own `mx.quantize`, affine BITS
bits in groups of 32 (min-max), before the forward. MODEL_DIR is then the release checkpoint, not our output.

The committed fixtures (mlx-k3/tests/fixtures/compress/) are made by:

    # mlx_lm_mix_logits.safetensors: mlx-lm reads a k3-nano mix written by convert
    mlx-k3 convert --from models/k3-nano --to /tmp/mlx_mix \
        --recipe mlx-k3/tests/fixtures/compress/mlx_mix.json
    .venv/bin/python scripts/compress/mlx_lm_logits.py /tmp/mlx_mix \
        mlx-k3/tests/fixtures/compress/mlx_lm_mix_logits.safetensors \
        2046,474,300,12,99,1500,7,260,2000,44,512,1024

    # the release-format fixture (bf16 + compressed-tensors MXFP4 experts) and its prompt
    R=mlx-k3/tests/fixtures/k3/a_latent_norm_attnres_bf16_mxfp4_release
    T=186,0,30,33,49,35,194,97,89,158,234,214
    # mlx_lm_release_a2_logits.safetensors: mlx-lm reads the release converted with 2-bit experts
    mlx-k3 convert --from $R --to /tmp/release_a2 \
        --recipe mlx-k3/tests/fixtures/compress/release_experts_a2.toml
    .venv/bin/python scripts/compress/mlx_lm_logits.py /tmp/release_a2 \
        mlx-k3/tests/fixtures/compress/mlx_lm_release_a2_logits.safetensors $T
    # mlx_lm_release_requant4_logits.safetensors: the release with its experts re-quantized by MLX itself
    .venv/bin/python scripts/compress/mlx_lm_logits.py $R \
        mlx-k3/tests/fixtures/compress/mlx_lm_release_requant4_logits.safetensors $T --requantize-experts 4
"""
import argparse
import hashlib
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model


def requantize_experts(model, bits: int) -> int:
    """Every MXFP4 routed-expert stack decoded and quantized again as affine `bits` bits in groups of 32."""
    done = 0
    for layer in model.language_model.model.layers:
        switch = getattr(layer.mlp, "switch_mlp", None)
        if switch is None:
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            proj = getattr(switch, name)
            assert (proj.mode, proj.bits, proj.group_size) == ("mxfp4", 4, 32), (name, proj.mode)
            w = mx.dequantize(proj.weight, proj.scales, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
            wq, scales, biases = mx.quantize(w.astype(mx.bfloat16), group_size=32, bits=bits, mode="affine")
            proj.weight, proj.scales, proj.biases = wq, scales, biases
            proj.mode, proj.bits = "affine", bits
            done += 1
    return done


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out")
    ap.add_argument("tokens")
    ap.add_argument("--requantize-experts", type=int, metavar="BITS")
    args = ap.parse_args()
    model, _ = load_model(args.model_dir)
    # MLX's CPU gather_mm (dense expert stacks) is f32-only; quantized weights keep their packing.
    model.set_dtype(mx.float32)
    meta = {"tokens": args.tokens}
    if args.requantize_experts is not None:
        n = requantize_experts(model, args.requantize_experts)
        assert n > 0, "no MXFP4 routed experts to re-quantize"
        meta["requantize_experts"] = f"affine {args.requantize_experts} bits, group 32, mx.quantize, {n} stacks"
    ids = mx.array([[int(t) for t in args.tokens.split(",")]])
    logits = model(ids).astype(mx.float32)[0]
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(args.model_dir.iterdir())
        if p.name.endswith(".safetensors") and p.name != "expected.safetensors" or p.name == "config.json"
    }
    meta["files_sha256"] = json.dumps(files, sort_keys=True)
    mx.save_safetensors(args.out, {"logits": logits}, metadata=meta)


if __name__ == "__main__":
    main()
