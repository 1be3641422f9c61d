"""End-to-end reference for images in a Kimi K3 chat: from image files to greedy tokens, all in mlx-vlm 0.7.10.

`mlx-k3/tests/vision_chat.rs` loads the checkpoint this script writes with `Pipeline::load` and runs the same
chats through `Pipeline::encode_chat_media` (decode, the K3 image processor, the chat encoding with its image
placeholders expanded, the MoonViT-3d tower and projector) and `generate_tokens_media`; this script records
what mlx-vlm's `KimiK3Processor` (`apply_chat_template`, then `__call__` with the images) and its `kimi_k3`
`Model` give for the same files: the prompt ids, the log-probabilities of the prefill's last position and of
each greedy decode step, and the greedy tokens.

The checkpoint (`mlx-k3/tests/fixtures/vision_chat/`) is the tiny random `kimi_k3` model of
`make_vision_k3_fixtures.py` (same text and vision configs and initialization) with the vocabulary widened to
the tokenizer's, `media_placeholder_token_id` set to the tokenizer's `<|media_pad|>`, the tokenizer of the
preprocessing fixtures (`tests/fixtures/vision_preprocess/tokenizer`: the K3 chat fixture tokenizer plus the
media tokens), and a `preprocessor_config.json` whose patch limit makes one of the two images shrink (so the
bicubic resize is part of the path). The images are the preprocessing fixtures' `rgb.png` and `wide.png`
(lossless: PNG decoding is exact, so both sides start from the same pixels).

Before writing, the script checks that every greedy step's top-1/top-2 log-probability gap is far above fp32
noise (else it tries the next candidate user text), so greedy tokens are a fair comparison.

Run with the vision virtualenv of `make_vision_k3_fixtures.py` plus `tiktoken` (the K3 tokenizer conversion
needs it):

    python3 -m venv /tmp/vlm-venv
    /tmp/vlm-venv/bin/pip install mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 mlx-vlm==0.7.10 tiktoken
    /tmp/vlm-venv/bin/python scripts/make_vision_chat_fixtures.py
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_vision_k3_fixtures as v3  # noqa: E402  (checks the pins on import)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_vlm.models.kimi_k3 import Model, ModelConfig, TextConfig, VisionConfig  # noqa: E402
from mlx_vlm.models.kimi_k3.processing_kimi_k3 import (  # noqa: E402
    KimiK3ImageProcessor,
    KimiK3Processor,
    _convert_kimi_k3_tiktoken,
)
from mlx_vlm.utils import load_model  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = v3.ROOT
OUT = ROOT / "mlx-k3" / "tests" / "fixtures" / "vision_chat"
TOKENIZER = ROOT / "mlx-k3" / "tests" / "fixtures" / "vision_preprocess" / "tokenizer"
IMAGES = ROOT / "mlx-k3" / "tests" / "fixtures" / "vision_preprocess"
VOCAB = 2304
DECODE_STEPS = 8
# The processor's media_proc_cfg: patch 14 as the tower, and a patch limit that wide.png (6 x 1 patches) exceeds.
PROC = {"patch_size": 14, "in_patch_limit": 4, "merge_kernel_size": [2, 2], "patch_limit_on_one_side": 512}
CANDIDATE_TEXTS = ["What is in the picture?", "Describe it.", "Which is wider?", "Name the colors.",
                   "Count the stripes.", "Is it dark?", "What differs?", "Say one word."]


def chats(text: str) -> list[dict]:
    return [
        {"images": ["rgb.png"],
         "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]},
        {"images": ["rgb.png", "wide.png"],
         "messages": [{"role": "system", "content": "You compare pictures."},
                      {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                   {"type": "image"}, {"type": "text", "text": text}]}]},
        # Two image parts side by side (nothing between their expansions), the CLI's `--image a --image b`.
        {"images": ["rgb.png", "wide.png"],
         "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                   {"type": "text", "text": text}]}]},
    ]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(np.float32)


def run(model, called) -> dict:
    ids = np.array(called["input_ids"])
    cache = model.make_cache()
    out = model(mx.array(ids), mx.array(called["pixel_values"]), cache=cache, grid_thws=called["grid_thws"])
    rows = [np.array(out.logits[0, -1])]
    tokens = []
    for _ in range(DECODE_STEPS):
        tok = int(np.argmax(rows[-1]))
        tokens.append(tok)
        rows.append(np.array(model.language_model(mx.array([[tok]], dtype=mx.int32), cache=cache).logits[0, -1]))
    lp = log_softmax(np.stack(rows[:DECODE_STEPS]))
    gap = min(v3.top_gap(r) for r in lp)
    return {"ids": ids[0].astype(np.int32), "tokens": np.array(tokens, dtype=np.int32), "logprobs": lp, "gap": gap}


def build(tmp: Path) -> dict:
    tok_cfg = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    pad = next(int(k) for k, v in tok_cfg["added_tokens_decoder"].items() if v["content"] == "<|media_pad|>")
    text_cfg = copy.deepcopy(v3.TEXT)
    text_cfg["vocab_size"] = VOCAB
    config = copy.deepcopy(v3.CONFIG)
    config.update({"media_placeholder_token_id": pad, "vocab_size": VOCAB, "text_config": text_cfg})
    model = Model(ModelConfig(text_config=TextConfig.from_dict(copy.deepcopy(text_cfg)),
                              vision_config=VisionConfig.from_dict(copy.deepcopy(v3.VISION)),
                              media_placeholder_token_id=pad))
    v3.init_weights(model)
    ckpt = tmp / "vision_chat"
    ckpt.mkdir()
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(ckpt / "model.safetensors"), dict(sorted(weights.items())), metadata={"format": "mlx"})
    (ckpt / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (ckpt / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": PROC}, indent=2) + "\n")
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, ckpt / f)

    # The reference: mlx-vlm's loader on the saved folder, its processor on the image files.
    model = load_model(ckpt)
    tok = _convert_kimi_k3_tiktoken(ckpt / "tiktoken.model", ckpt / "tokenizer_config.json")
    proc = KimiK3Processor(image_processor=KimiK3ImageProcessor(**PROC), tokenizer=tok)
    for text in CANDIDATE_TEXTS:
        cases, arrays = [], {}
        for i, chat in enumerate(chats(text)):
            images = []
            for name in chat["images"]:
                im = Image.open(IMAGES / name)
                im.load()
                images.append(im)
            rendered = proc.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=True)
            called = proc(images=images, text=rendered)
            r = run(model, called)
            assert int(np.sum(r["ids"] == pad)) == sum(int(np.prod(g)) // 4 for g in np.array(called["grid_thws"]))
            cases.append({**chat, "prompt_tokens": int(len(r["ids"])), "grids": np.array(called["grid_thws"]).tolist(),
                          "min_top2_logprob_gap": round(r["gap"], 6)})
            arrays.update({f"case{i}_ids": r["ids"], f"case{i}_tokens": r["tokens"], f"case{i}_logprobs": r["logprobs"]})
        if min(c["min_top2_logprob_gap"] for c in cases) >= v3.MIN_GREEDY_GAP:
            mx.save_safetensors(str(ckpt / "expected.safetensors"), {k: mx.array(v) for k, v in sorted(arrays.items())},
                                metadata={"generator": "scripts/make_vision_chat_fixtures.py",
                                          "mlx-vlm": v3.PINS["mlx-vlm"]})
            manifest = {"generator": "scripts/make_vision_chat_fixtures.py", "mlx_vlm": v3.PINS["mlx-vlm"],
                        "placeholder": pad, "decode_steps": DECODE_STEPS, "images_from": "../vision_preprocess",
                        "cases": cases}
            (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
            return manifest
    raise RuntimeError("no candidate text gave greedy steps with clear top-1 margins")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        manifest = build(tmp)
        if OUT.exists():
            shutil.rmtree(OUT)
        shutil.copytree(tmp / "vision_chat", OUT)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT.relative_to(ROOT)} ({total / 1024:.0f} KiB): {json.dumps(manifest['cases'])}")


if __name__ == "__main__":
    main()
