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


def write_fixture(name: str, kv_b: bool) -> dict:
    mx.random.seed(21)
    model = ds3.build_model(TEXT)
    ds3.init_weights(model, TEXT)
    params = dict(tree_flatten(model.parameters()))
    fdir = OUT / name
    fdir.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(fdir / "model.gguf"), ARCH)
    write_metadata(w, TEXT, kv_b)
    tensors = {n: (*gguf_name(n), np.array(params[n].astype(mx.float32))) for n in params}
    if kv_b:
        for layer in range(TEXT["num_hidden_layers"]):
            p = f"model.layers.{layer}.self_attn."
            del tensors[p + "embed_q.weight"], tensors[p + "unembed_out.weight"]
            tensors[p + "kv_b_proj.weight"] = (f"blk.{layer}.attn_kv_b.weight", T.Q8_0, kv_b_of(params, layer, TEXT))
    dequant = {}
    for n in sorted(tensors):
        g, ty, v = tensors[n]
        if ty == T.F32:
            data, raw = v, None
        elif ty == T.F16:
            data, raw = v.astype(np.float16), None
        else:
            data, raw = gguf.quants.quantize(v, ty), ty
        w.add_tensor(g, data, raw_dtype=raw)
        dequant[n] = np.asarray(gguf.quants.dequantize(data, ty), dtype=np.float32).reshape(v.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

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
    exp.update({f"w.{k}": v for k, v in dequant.items()})
    ds3.save_expected(fdir / "expected.safetensors", exp, stats)
    return {"name": name, "config": TEXT, "checks": stats,
            "types": {tensors[n][0]: tensors[n][1].name for n in sorted(tensors)}}


def main() -> None:
    fixtures = [write_fixture("deepseek2_mixed", False), write_fixture("deepseek2_kv_b", True)]
    manifest = {"generator": "scripts/make_gguf_fixtures.py", "fixtures": fixtures}
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(json.dumps([f["checks"] for f in fixtures]))

if __name__ == "__main__":
    main()
