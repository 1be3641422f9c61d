#!/usr/bin/env python3
"""Writes mlx-k3/tests/fixtures/gguf: a tiny `deepseek_v3` model as llama.cpp's `deepseek2` GGUF, and the
reference its import is checked against.

    deepseek2_mixed/model.gguf        the model in llama.cpp's tensor names and metadata keys, written with
                                      the `gguf` package (gguf-py 0.19.0): norms, router and MLA's
                                      attn_v_b F32; attn_kv_a_mqa and attn_k_b F16; a shared expert BF16;
                                      Q8_0 and Q4_0 for the other projections (quantized by gguf-py)
    deepseek2_mixed/expected.safetensors
                                      mlx-lm 0.32.2's deepseek_v3 run on the GGUF's tensors as gguf-py
                                      dequantizes them (prompt, prefill/decode/full logits, greedy tokens,
                                      as make_deepseek_v3_fixtures.py), and every dequantized tensor under
                                      `w.<mlx-lm name>` for the bit-for-bit check of the exact types

    deepseek2_split/model-0000N-of-00003.gguf
                                      deepseek2_mixed's GGUF as three split shards (gguf-py's writer with
                                      split_max_tensors, as llama.cpp's gguf-split lays them out)

    deepseek2_kv_b/                   the same model in the older MLA layout: one attn_kv_b (Q8_0) per layer
                                      and per-head key_length / value_length, no *_mla keys

deepseek2_mixed uses the newer llama.cpp MLA layout: attn_k_b / attn_v_b (kv_b_proj split per head), which
are mlx-lm's `embed_q` / `unembed_out` weights. YaRN uses mscale = mscale_all_dim (as DeepSeek-V3 and Kimi K2 do):
GGUF keeps only `yarn_log_multiplier` = 0.1 * mscale_all_dim.

Needs the pinned mlx 0.32.4 and mlx-lm 0.32.2 (checked on import) and gguf 0.19.0. Run (CPU, seconds):

    .venv/bin/python scripts/make_gguf_fixtures.py
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_deepseek_v3_fixtures as ds3  # noqa: E402  (checks the pins on import)

import gguf  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# Writers for the GGML types gguf-py 0.19.0 only decodes (K-quants, IQ1_S). Validity, not llama.cpp's quality:
# each returns the block bytes and the values it meant them to hold, and `encode` checks that gguf-py's
# dequantizer reads exactly those values back.

QK = 256


def _f16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float16)


def _sub_scales(x: np.ndarray, sub: int, levels: int, with_min: bool, sbits: int):
    """Per super-block (rows of 256) a float16 d (and dmin) and integer sub-block scales (and mins) of
    `sbits` bits, for codes 0..levels: value = d*sc*q - dmin*m."""
    nb = x.shape[0]
    xs = x.reshape(nb, -1, sub)
    smax = (1 << sbits) - 1
    if with_min:
        lo = np.minimum(xs.min(axis=-1), 0.0)
        hi = xs.max(axis=-1)
        scale = (hi - lo) / levels
        mn = -lo
        d = _f16(scale.max(axis=-1) / smax).astype(np.float32)
        dmin = _f16(mn.max(axis=-1) / smax).astype(np.float32)
        sc = np.clip(np.round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), 0, smax)
        m = np.clip(np.round(np.divide(mn, dmin[:, None], out=np.zeros_like(mn), where=dmin[:, None] > 0)), 0, smax)
        dl = d[:, None] * sc
        ml = dmin[:, None] * m
        q = np.clip(np.round(np.divide(xs + ml[..., None], dl[..., None], out=np.zeros_like(xs),
                                       where=dl[..., None] > 0)), 0, levels)
        return d, dmin, sc.astype(np.int64), m.astype(np.int64), q.astype(np.int64)
    raise AssertionError


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins."""
    b = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        b[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        b[:, 4 + j] = m[:, j] | ((m[:, j + 4] >> 4) << 6)
        b[:, 8 + j] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    return b


def q45_k(x: np.ndarray, five: bool) -> tuple[np.ndarray, np.ndarray]:
    nb = x.shape[0]
    d, dmin, sc, m, q = _sub_scales(x, 32, 31 if five else 15, True, 6)
    want = (d[:, None] * sc).astype(np.float32)[..., None] * q.astype(np.float32) - \
        (dmin[:, None] * m).astype(np.float32)[..., None]
    lo = (q & 15).astype(np.uint8)  # [nb, 8, 32]
    qs = (lo[:, 0::2] | (lo[:, 1::2] << 4)).reshape(nb, 128)
    parts = [_f16(d).view(np.uint8).reshape(nb, 2), _f16(dmin).view(np.uint8).reshape(nb, 2), _pack_k_scales(sc, m)]
    if five:
        hi = (q >> 4).astype(np.uint8)  # [nb, 8, 32]: bit j of qh[i] is sub-block j's fifth bit of element i
        qh = np.zeros((nb, 32), dtype=np.uint8)
        for j in range(8):
            qh |= hi[:, j] << j
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1), want.reshape(nb, QK)


def q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    amax = np.abs(xs).max(axis=-1)
    s = amax / 31.0  # ideal per-16 scale for codes -32..31
    d = _f16(np.abs(s).max(axis=-1) / 127.0).astype(np.float32)
    sc = np.clip(np.round(np.divide(s, d[:, None], out=np.zeros_like(s), where=d[:, None] > 0)), -128, 127)
    dl = (d[:, None] * sc).astype(np.float32)
    q = np.clip(np.round(np.divide(xs, dl[..., None], out=np.zeros_like(xs), where=dl[..., None] > 0)), -32, 31)
    want = (dl[..., None] * q).astype(np.float32).reshape(nb, QK)
    u = (q.reshape(nb, QK) + 32).astype(np.uint8)
    ql = np.zeros((nb, 128), dtype=np.uint8)
    qh = np.zeros((nb, 64), dtype=np.uint8)
    for e in range(QK):
        h, r = divmod(e, 128)
        ql[:, 64 * h + r % 64] |= (u[:, e] & 15) << (4 * (r // 64))
        qh[:, 32 * h + r % 32] |= (u[:, e] >> 4) << (2 * (r // 32))
    parts = [ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d).view(np.uint8).reshape(nb, 2)]
    return np.concatenate(parts, axis=1), want


def q3_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    s = np.abs(xs).max(axis=-1) / 4.0  # codes -4..3
    d = _f16(s.max(axis=-1) / 31.0).astype(np.float32)
    sc = np.clip(np.round(np.divide(s, d[:, None], out=np.zeros_like(s), where=d[:, None] > 0)), -32, 31)
    dl = (d[:, None] * sc).astype(np.float32)
    q = np.clip(np.round(np.divide(xs, dl[..., None], out=np.zeros_like(xs), where=dl[..., None] > 0)), -4, 3)
    want = (dl[..., None] * q).astype(np.float32).reshape(nb, QK)
    u = (q.reshape(nb, QK) + 4).astype(np.uint8)  # low two bits in qs, the third (set: q >= 0) in hmask
    qs = np.zeros((nb, 64), dtype=np.uint8)
    hmask = np.zeros((nb, 32), dtype=np.uint8)
    for e in range(QK):
        h, r = divmod(e, 128)
        qs[:, 32 * h + r % 32] |= (u[:, e] & 3) << (2 * (r // 32))
        hmask[:, e % 32] |= (u[:, e] >> 2) << (e // 32)
    s6 = (sc + 32).astype(np.uint8)
    scales = np.zeros((nb, 12), dtype=np.uint8)
    for k in range(16):
        scales[:, k % 8] |= (s6[:, k] & 15) << (4 * (k // 8))
        scales[:, 8 + k % 4] |= (s6[:, k] >> 4) << (2 * (k // 4))
    parts = [hmask, qs, scales, _f16(d).view(np.uint8).reshape(nb, 2)]
    return np.concatenate(parts, axis=1), want


def q2_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nb = x.shape[0]
    d, dmin, sc, m, q = _sub_scales(x, 16, 3, True, 4)
    want = ((d[:, None] * sc).astype(np.float32)[..., None] * q.astype(np.float32)
            - (dmin[:, None] * m).astype(np.float32)[..., None]).reshape(nb, QK)
    qf = q.reshape(nb, QK).astype(np.uint8)
    qs = np.zeros((nb, 64), dtype=np.uint8)
    for e in range(QK):
        h, r = divmod(e, 128)
        qs[:, 32 * h + r % 32] |= qf[:, e] << (2 * (r // 32))
    scales = (sc | (m << 4)).astype(np.uint8)
    parts = [scales, qs, _f16(d).view(np.uint8).reshape(nb, 2), _f16(dmin).view(np.uint8).reshape(nb, 2)]
    return np.concatenate(parts, axis=1), want


def iq1_s(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-block: a 3-bit scale L under the super-block's f16 d, a delta sign, and per 8-group the grid
    entry nearest (least squares, brute force over all 2048) to x / (d (2L + 1)) - delta."""
    gguf.quants.IQ1_S.init_grid()
    grid = gguf.quants.IQ1_S.grid.reshape(2048, 8).astype(np.float32)
    delta = float(gguf.quants.IQ1_S.delta)
    nb = x.shape[0]
    xb = x.reshape(nb, 8, 32)
    amax = np.abs(xb).max(axis=-1) / (1.0 + delta)  # the block scale that reaches the largest value
    d = _f16(amax.max(axis=-1) / 15.0).astype(np.float32)
    L = np.clip(np.round((np.divide(amax, d[:, None], out=np.zeros_like(amax), where=d[:, None] > 0) - 1) / 2), 0, 7)
    dl = (d[:, None] * (2 * L + 1)).astype(np.float32)
    best = None
    for sign in (0, 1):
        dv = -delta if sign else delta
        t = np.divide(xb, dl[..., None], out=np.zeros_like(xb), where=dl[..., None] > 0).reshape(-1, 8) - dv
        idx = np.empty(t.shape[0], dtype=np.int64)
        for c in range(0, t.shape[0], 4096):
            dist = ((t[c:c + 4096, None, :] - grid[None]) ** 2).sum(-1)
            idx[c:c + 4096] = dist.argmin(-1)
        err = ((t - grid[idx]) ** 2).sum(-1).reshape(nb, 8, 4).sum(-1)
        cand = (idx.reshape(nb, 8, 4), err)
        if best is None:
            best = (np.zeros((nb, 8), dtype=np.int64), cand[0], err)
        else:
            better = err < best[2]
            best = (np.where(better, 1, best[0]), np.where(better[..., None], cand[0], best[1]),
                    np.minimum(err, best[2]))
    sign, idx, _ = best
    dv = np.where(sign == 1, -delta, delta).astype(np.float32)
    want = (dl[..., None, None] * (grid[idx] + dv[..., None, None])).astype(np.float32).reshape(nb, QK)
    qs = (idx & 255).astype(np.uint8).reshape(nb, 32)
    qh = (L.astype(np.uint16) << 12) | (sign.astype(np.uint16) << 15)
    for g in range(4):
        qh |= ((idx[:, :, g] >> 8) & 7).astype(np.uint16) << (3 * g)
    parts = [_f16(d).view(np.uint8).reshape(nb, 2), qs, qh.astype("<u2").view(np.uint8).reshape(nb, 16)]
    return np.concatenate(parts, axis=1), want


WRITERS = {
    T.Q4_K: lambda x: q45_k(x, False),
    T.Q5_K: lambda x: q45_k(x, True),
    T.Q6_K: q6_k,
    T.Q3_K: q3_k,
    T.Q2_K: q2_k,
    T.IQ1_S: iq1_s,
}


def encode(v: np.ndarray, ty: T) -> np.ndarray:
    """`v` ([.., K], K % 256 == 0) as GGML type `ty`'s bytes ([.., K / 256 * block bytes]), checked: gguf-py
    decodes them to exactly the values the writer meant."""
    rows = v.reshape(-1, QK).astype(np.float32)
    raw, want = WRITERS[ty](rows)
    shape = (*v.shape[:-1], v.shape[-1] // QK * raw.shape[1])
    raw = np.ascontiguousarray(raw.reshape(shape))
    back = np.asarray(gguf.quants.dequantize(raw, ty), dtype=np.float32).reshape(-1, QK)
    assert np.array_equal(back, want), f"{ty.name}: gguf-py reads back other values than written"
    return raw


OUT = ds3.ROOT / "mlx-k3" / "tests" / "fixtures" / "gguf"
ARCH = "deepseek2"

TEXT = {
    **copy.deepcopy(ds3.BASE),
    "model_type": "deepseek_v3",
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}

# mlx-lm name suffix -> (llama.cpp name suffix, GGML type). Layer tensors are under model.layers.N / blk.N.
LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", T.F32),
    "post_attention_layernorm.weight": ("ffn_norm.weight", T.F32),
    "self_attn.q_a_proj.weight": ("attn_q_a.weight", T.Q4_0),
    "self_attn.q_a_layernorm.weight": ("attn_q_a_norm.weight", T.F32),
    "self_attn.q_b_proj.weight": ("attn_q_b.weight", T.Q8_0),
    "self_attn.kv_a_proj_with_mqa.weight": ("attn_kv_a_mqa.weight", T.F16),
    "self_attn.kv_a_layernorm.weight": ("attn_kv_a_norm.weight", T.F32),
    "self_attn.embed_q.weight": ("attn_k_b.weight", T.F16),
    "self_attn.unembed_out.weight": ("attn_v_b.weight", T.F32),
    "self_attn.o_proj.weight": ("attn_output.weight", T.Q4_0),
    "mlp.gate_proj.weight": ("ffn_gate.weight", T.Q8_0),
    "mlp.up_proj.weight": ("ffn_up.weight", T.Q4_0),
    "mlp.down_proj.weight": ("ffn_down.weight", T.Q8_0),
    "mlp.gate.weight": ("ffn_gate_inp.weight", T.F32),
    "mlp.gate.e_score_correction_bias": ("exp_probs_b.bias", T.F32),
    "mlp.switch_mlp.gate_proj.weight": ("ffn_gate_exps.weight", T.Q4_0),
    "mlp.switch_mlp.up_proj.weight": ("ffn_up_exps.weight", T.Q4_0),
    "mlp.switch_mlp.down_proj.weight": ("ffn_down_exps.weight", T.Q8_0),
    "mlp.shared_experts.gate_proj.weight": ("ffn_gate_shexp.weight", T.Q8_0),
    "mlp.shared_experts.up_proj.weight": ("ffn_up_shexp.weight", T.Q4_0),
    "mlp.shared_experts.down_proj.weight": ("ffn_down_shexp.weight", T.BF16),
}
TOP = {
    "model.embed_tokens.weight": ("token_embd.weight", T.Q8_0),
    "model.norm.weight": ("output_norm.weight", T.F32),
    "lm_head.weight": ("output.weight", T.Q8_0),
}


def gguf_name(name: str) -> tuple[str, T]:
    if name in TOP:
        return TOP[name]
    parts = name.split(".")
    assert parts[:2] == ["model", "layers"], name
    g, ty = LAYER[".".join(parts[3:])]
    return f"blk.{parts[2]}.{g}", ty


def write_metadata(w: gguf.GGUFWriter, t: dict, kv_b: bool = False) -> None:
    a = ARCH
    w.add_name("tiny deepseek_v3 (mlx-k3 fixture)")
    w.add_uint32(f"{a}.vocab_size", t["vocab_size"])
    w.add_uint32(f"{a}.context_length", t["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", t["hidden_size"])
    w.add_uint32(f"{a}.block_count", t["num_hidden_layers"])
    w.add_uint32(f"{a}.feed_forward_length", t["intermediate_size"])
    w.add_uint32(f"{a}.expert_feed_forward_length", t["moe_intermediate_size"])
    w.add_uint32(f"{a}.leading_dense_block_count", t["first_k_dense_replace"])
    w.add_uint32(f"{a}.attention.head_count", t["num_attention_heads"])
    w.add_uint32(f"{a}.attention.q_lora_rank", t["q_lora_rank"])
    w.add_uint32(f"{a}.attention.kv_lora_rank", t["kv_lora_rank"])
    if kv_b:  # older files: per-head sizes, as many KV heads as heads
        w.add_uint32(f"{a}.attention.head_count_kv", t["num_attention_heads"])
        w.add_uint32(f"{a}.attention.key_length", t["qk_nope_head_dim"] + t["qk_rope_head_dim"])
        w.add_uint32(f"{a}.attention.value_length", t["v_head_dim"])
    else:  # the MQA form llama.cpp writes with attn_k_b/attn_v_b
        w.add_uint32(f"{a}.attention.head_count_kv", 1)
        w.add_uint32(f"{a}.attention.key_length", t["kv_lora_rank"] + t["qk_rope_head_dim"])
        w.add_uint32(f"{a}.attention.value_length", t["kv_lora_rank"])
        w.add_uint32(f"{a}.attention.key_length_mla", t["qk_nope_head_dim"] + t["qk_rope_head_dim"])
        w.add_uint32(f"{a}.attention.value_length_mla", t["v_head_dim"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", t["rms_norm_eps"])
    w.add_uint32(f"{a}.rope.dimension_count", t["qk_rope_head_dim"])
    w.add_float32(f"{a}.rope.freq_base", t["rope_theta"])
    rs = t["rope_scaling"]
    w.add_string(f"{a}.rope.scaling.type", "yarn")
    w.add_float32(f"{a}.rope.scaling.factor", rs["factor"])
    w.add_uint32(f"{a}.rope.scaling.original_context_length", rs["original_max_position_embeddings"])
    w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * rs["mscale_all_dim"])
    w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", rs["beta_fast"])
    w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", rs["beta_slow"])
    w.add_uint32(f"{a}.expert_count", t["n_routed_experts"])
    w.add_uint32(f"{a}.expert_used_count", t["num_experts_per_tok"])
    w.add_uint32(f"{a}.expert_shared_count", t["n_shared_experts"])
    w.add_uint32(f"{a}.expert_group_count", t["n_group"])
    w.add_uint32(f"{a}.expert_group_used_count", t["topk_group"])
    w.add_float32(f"{a}.expert_weights_scale", t["routed_scaling_factor"])
    w.add_bool(f"{a}.expert_weights_norm", t["norm_topk_prob"])
    w.add_uint32(f"{a}.expert_gating_func", 2)  # llama.cpp: 1 softmax, 2 sigmoid


def kv_b_of(params: dict, layer: int, t: dict) -> np.ndarray:
    """llama.cpp's attn_kv_b ([heads * (nope + v), kv_lora], HF's kv_b_proj) from mlx-lm's split weights."""
    p = f"model.layers.{layer}.self_attn."
    wk = np.array(params[p + "embed_q.weight"].astype(mx.float32))  # [H, kv_lora, nope]
    wv = np.array(params[p + "unembed_out.weight"].astype(mx.float32))  # [H, v, kv_lora]
    return np.concatenate([wk.transpose(0, 2, 1), wv], axis=1).reshape(-1, t["kv_lora_rank"])


def split_kv_b(kv_b: np.ndarray, t: dict) -> tuple[np.ndarray, np.ndarray]:
    v = kv_b.reshape(t["num_attention_heads"], t["qk_nope_head_dim"] + t["v_head_dim"], -1)
    return v[:, : t["qk_nope_head_dim"]].transpose(0, 2, 1).copy(), v[:, t["qk_nope_head_dim"] :].copy()


def write_fixture(name: str, kv_b: bool, text: dict = TEXT, types: dict | None = None, hashes: bool = False,
                  split: str | None = None) -> dict:
    """One fixture folder. `types` overrides GGML types per mlx-lm name; `hashes` records the dequantized
    tensors as SHA-256 digests in the manifest (of their little-endian f32 bytes, -0 written as +0) instead of
    storing them in expected.safetensors, which keeps a wider model's fixture small."""
    TEXT = text
    mx.random.seed(21)
    model = ds3.build_model(TEXT)
    ds3.init_weights(model, TEXT)
    params = dict(tree_flatten(model.parameters()))
    fdir = OUT / name
    fdir.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(fdir / "model.gguf"), ARCH)
    write_metadata(w, TEXT, kv_b)
    tensors = {n: (*gguf_name(n), np.array(params[n].astype(mx.float32))) for n in params}
    for n, ty in (types or {}).items():
        tensors[n] = (tensors[n][0], ty, tensors[n][2])
    if kv_b:
        for layer in range(TEXT["num_hidden_layers"]):
            p = f"model.layers.{layer}.self_attn."
            del tensors[p + "embed_q.weight"], tensors[p + "unembed_out.weight"]
            tensors[p + "kv_b_proj.weight"] = (f"blk.{layer}.attn_kv_b.weight", T.Q8_0, kv_b_of(params, layer, TEXT))
    dequant = {}
    added = []
    for n in sorted(tensors):
        g, ty, v = tensors[n]
        if ty == T.F32:
            data, raw = v, None
        elif ty == T.F16:
            data, raw = v.astype(np.float16), None
        elif ty in WRITERS:
            data, raw = encode(v, ty), ty
        else:
            data, raw = gguf.quants.quantize(v, ty), ty
        w.add_tensor(g, data, raw_dtype=raw)
        added.append((g, data, raw))
        dequant[n] = np.asarray(gguf.quants.dequantize(data, ty), dtype=np.float32).reshape(v.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split:
        # The same model as llama.cpp's gguf-split writes it: three shards model-0000N-of-00003.gguf, the
        # metadata in the first, split.no / split.count / split.tensors.count in each.
        sdir = OUT / split
        sdir.mkdir(parents=True, exist_ok=True)
        per = -(-len(added) // 3)
        ws = gguf.GGUFWriter(str(sdir / "model.gguf"), ARCH, split_max_tensors=per)
        write_metadata(ws, TEXT, kv_b)
        for g, data, raw in added:
            ws.add_tensor(g, data, raw_dtype=raw)
        ws.write_header_to_file()
        ws.write_kv_data_to_file()
        ws.write_tensors_to_file()
        ws.close()
        assert sorted(p.name for p in sdir.iterdir()) == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]

    # The reference: mlx-lm on exactly the values the GGUF holds, as gguf-py reads them back.
    reader = gguf.GGUFReader(str(fdir / "model.gguf"))
    by_name = {t.name: t for t in reader.tensors}
    for n, v in dequant.items():
        t = by_name[tensors[n][0]]
        back = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(v.shape)
        assert np.array_equal(back, v), n
    weights = dict(dequant)
    for layer in range(TEXT["num_hidden_layers"] if kv_b else 0):
        p = f"model.layers.{layer}.self_attn."
        wk, wv = split_kv_b(weights.pop(p + "kv_b_proj.weight"), TEXT)
        weights[p + "embed_q.weight"], weights[p + "unembed_out.weight"] = wk, wv
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    exp, stats = ds3.choose_prompt_and_run(model, 31)
    entry = {"name": name, "config": TEXT, "checks": stats,
             "types": {tensors[n][0]: tensors[n][1].name for n in sorted(tensors)}}
    if hashes:
        entry["dequantized_sha256"] = {
            k: hashlib.sha256((v + np.float32(0)).astype("<f4").tobytes()).hexdigest() for k, v in sorted(dequant.items())
        }
    else:
        exp.update({f"w.{k}": v for k, v in dequant.items()})
    ds3.save_expected(fdir / "expected.safetensors", exp, stats)
    return entry


# deepseek2_kquants: hidden size 256, so that the K-quants and IQ1_S (whole 256-value super-blocks along the input
# dimension) fit every projection that reads the hidden state. Exact on import: IQ1_S (the routed experts' gate and
# up, as codebooks), Q4_K and Q5_K (as affine 4 / 5-bit, group 32). Re-quantized (MLX has no group of 16):
# Q6_K (embeddings, a shared expert's up), Q3_K (layer 1's q_a) and Q2_K (layer 0's kv_a; both MLA).
TEXT_K = {**copy.deepcopy(TEXT), "hidden_size": 256}
KQUANT_TYPES = {
    "model.embed_tokens.weight": T.Q6_K,
    "lm_head.weight": T.Q5_K,
    "model.layers.0.self_attn.q_a_proj.weight": T.Q4_K,
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": T.Q2_K,
    "model.layers.0.mlp.gate_proj.weight": T.Q4_K,
    "model.layers.0.mlp.up_proj.weight": T.Q5_K,
    "model.layers.1.self_attn.q_a_proj.weight": T.Q3_K,
    "model.layers.1.mlp.switch_mlp.gate_proj.weight": T.IQ1_S,
    "model.layers.1.mlp.switch_mlp.up_proj.weight": T.IQ1_S,
    "model.layers.1.mlp.switch_mlp.down_proj.weight": T.Q4_0,
    "model.layers.1.mlp.shared_experts.gate_proj.weight": T.Q4_K,
    "model.layers.1.mlp.shared_experts.up_proj.weight": T.Q6_K,
}


# tokenizer_kimi.gguf: k3-nano's tokenizer (tiktoken ranks, Kimi's split pattern, 258 special tokens) as
# llama.cpp's convert_hf_to_gguf writes a tiktoken tokenizer (Kimi K2's): model "gpt2", pre "kimi-k2", tokens as
# byte-level strings (GPT-2's byte-to-unicode map), merges rebuilt from the ranks (each multi-byte token is
# the BPE of its bytes with the merges of lower rank, which must leave two parts). No tensors. The reference
# token ids are tests/fixtures/tokenizer/k3_nano_ids.json and k3_nano_long_ids.json (Python tiktoken 0.14.0
# on the original tokenizer, scripts/make_tokenizer_fixtures.py).
NANO = ds3.ROOT / "models" / "k3-nano"
TOKENIZER_TEMPLATE = "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}"


def byte_level(b: bytes) -> str:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for c in range(256):
        if c in keep:
            table[c] = chr(c)
        else:
            table[c] = chr(256 + extra)
            extra += 1
    return "".join(table[c] for c in b)


def bpe_parts(ranks: dict, token: bytes, max_rank: int) -> list[bytes]:
    parts = [bytes([c]) for c in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]


def write_tokenizer_fixture() -> dict:
    import base64
    ranks = {}
    for line in (NANO / "tiktoken.model").read_text().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    cfg = json.loads((NANO / "tokenizer_config.json").read_text())
    n = len(ranks)
    assert sorted(ranks.values()) == list(range(n))
    by_id = {r: t for t, r in ranks.items()}
    tokens = [byte_level(by_id[i]) for i in range(n)]
    types = [1] * n
    for i in range(n, n + 258):
        e = cfg["added_tokens_decoder"].get(str(i))
        tokens.append(e["content"] if e else f"<|reserved_token_{i}|>")
        types.append(3)  # llama.cpp's CONTROL
    merges = []
    for i in range(n):
        t = by_id[i]
        if len(t) > 1:
            a, b = bpe_parts(ranks, t, i)
            merges.append(f"{byte_level(a)} {byte_level(b)}")
    w = gguf.GGUFWriter(str(OUT / "tokenizer_kimi.gguf"), ARCH)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(cfg["bos_token"]))
    w.add_eos_token_id(tokens.index(cfg["eos_token"]))
    w.add_add_bos_token(bool(cfg.get("add_bos_token", False)))
    w.add_chat_template(TOKENIZER_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"name": "tokenizer_kimi", "tokens": len(tokens), "merges": len(merges)}


def main() -> None:
    fixtures = [write_fixture("deepseek2_mixed", False, split="deepseek2_split"), write_fixture("deepseek2_kv_b", True),
                write_fixture("deepseek2_kquants", False, TEXT_K, KQUANT_TYPES, hashes=True)]
    manifest = {"generator": "scripts/make_gguf_fixtures.py", "fixtures": fixtures,
                "tokenizer": write_tokenizer_fixture()}
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(json.dumps([f["checks"] for f in fixtures]))

if __name__ == "__main__":
    main()
