"""Loading the k3-nano tokenizer with tiktoken, and plain sampling with an mlx-lm model."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import tiktoken

import bpe
import common


def load_encoding(path: Path) -> tiktoken.Encoding:
    """tiktoken.Encoding from a k3-nano (Kimi-format) tokenizer folder."""
    ranks = bpe.load_tiktoken(path / "tiktoken.model")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    n = len(ranks)
    specials = {}
    for i in range(n, n + common.NUM_SPECIAL_TOKENS):
        e = cfg["added_tokens_decoder"].get(str(i))
        specials[e["content"] if e else f"<|reserved_token_{i}|>"] = i
    return tiktoken.Encoding("k3-nano", pat_str=common.PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def sample(model, enc, prompt: str, bos: int, stop_ids, n: int, temp: float, seed: int) -> str:
    """Plain autoregressive sampling with mlx-lm's cache (temp 0 = greedy)."""
    ids = [bos] + enc.encode_ordinary(prompt)
    key = mx.random.key(seed)
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        if temp == 0:
            t = int(mx.argmax(logits).item())
        else:
            key, sub = mx.random.split(key)
            t = int(mx.random.categorical(logits.astype(mx.float32) / temp, key=sub).item())
        if t in stop_ids:
            break
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return prompt + enc.decode(out)
