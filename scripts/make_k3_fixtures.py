"""Build tiny Kimi K3 reference fixtures with mlx-lm's own `kimi_k3` model.

The Rust model graph in `mlx-k3` is checked against the implementation the ecosystem trusts:
mlx-lm's `mlx_lm/models/kimi_k3.py`. This script builds a handful of tiny K3 configurations (vocab 256,
hidden 64, 3-4 layers, 8-16 experts) that together switch every K3 feature on and off, gives them seeded,
well-scaled random weights, saves them exactly as mlx-lm saves a checkpoint, reloads them through mlx-lm's
own loader and records what mlx-lm computes for a random prompt.

Output, under `mlx-k3/tests/fixtures/k3/` (see the README.md written there for every fixture):

    <name>/config.json               as `mlx_lm.utils.save_config` writes it (nested `text_config` or flat)
    <name>/model.safetensors         float32 weights (or mlx-lm-quantized ones), mlx-lm's sanitized names,
                                     written by `mlx_lm.utils.save_model`
    <name>/model.safetensors.index.json   written by `save_model` alongside
    <name>/expected.safetensors      prompt, prefill_logits, decode_tokens, decode_logits, full_logits
    <name>_release/                  the same model under the original release (Hugging Face) tensor names
                                     (mlx-lm's `sanitize` inverted), same config.json and expected.safetensors
    <name>_mxfp4_release/            a quantized checkpoint in the release's formats (compressed-tensors MXFP4
                                     routed experts, affine-quantized kv_b_proj), its own config.json and
                                     expected.safetensors (mlx-lm's load_model of that folder)
    <name>_bf16_mxfp4_release/       the real release's layout: compressed-tensors MXFP4 routed experts,
                                     everything else bfloat16 (expected: mlx-lm's load_model, cast to f32)
    manifest.json                    every fixture with its feature flags, for Rust tests to iterate
    README.md                        what each fixture covers and what expected.safetensors holds

expected.safetensors (T = 12 prompt tokens, N = 16 decode steps, V = 256):
    prompt          int32   [T]      random token ids
    prefill_logits  float32 [T, V]   one forward of the prompt with a fresh cache (`model.make_cache()`)
    decode_tokens   int32   [N]      the tokens FED to the N one-token decode steps: decode_tokens[0] =
                                     argmax(prefill_logits[T-1]), decode_tokens[i] = argmax(decode_logits[i-1])
    decode_logits   float32 [N, V]   decode_logits[i] = logits after feeding decode_tokens[i] (cache holds
                                     the prompt and decode_tokens[:i])
    full_logits     float32 [T+N, V] one cache-less forward of concat(prompt, decode_tokens)

Every fixture is checked here before it is written: greedy tokens vary, the top-1/top-2 logit gap of each
greedy step and the router's top-k (and group) selection gaps are far above fp32 noise (so a correct
reimplementation picks the same tokens and experts), cached decode agrees with the cache-less forward, and
the release-named copy loads through mlx-lm's sanitize to bit-identical weights and logits (the quantized
release checkpoint: to the weights it was built from, except the `embed_q`/`unembed_out` that sanitize
re-quantizes from `kv_b_proj`).

Run (CPU is fine, a few seconds; the output is byte-identical from run to run):

    .venv/bin/python scripts/make_k3_fixtures.py

Pinned in `mlx-k3-py/python/mlx_k3/_pins.py` (read through `scripts/pins.py`): mlx and mlx-lm (install the
latter with `.venv/bin/pip install -r mlx-k3-py/requirements-dev.txt`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pins  # noqa: E402

PINS = {"mlx": pins.MLX, "mlx-lm": pins.MLX_LM}


def _check_pins() -> None:
    bad = pins.missing(PINS)
    if bad:
        sys.exit(
            "make_k3_fixtures.py needs exactly " + ", ".join(bad) + ".\n"
            "Install the pins into the project venv: .venv/bin/pip install "
            + " ".join(f"{d}=={v}" for d, v in PINS.items())
        )


_check_pins()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map_with_path  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import kimi_k3  # noqa: E402
from mlx_lm.utils import load_model, quantize_model, save_config, save_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "mlx-k3" / "tests" / "fixtures" / "k3"

VOCAB = 256
HIDDEN = 64
PROMPT_LEN = 12
DECODE_STEPS = 16
# A correct reimplementation differs from mlx-lm by fp32 rounding (~1e-6); these gaps keep greedy tokens and
# routed experts identical regardless.
MIN_GREEDY_GAP = 2e-3
MIN_ROUTER_GAP = 2e-4
MIN_DISTINCT_DECODE_TOKENS = 6
MAX_PROMPT_TRIES = 64

# ---------------------------------------------------------------------------------------------------------
# Configurations. `text` holds the text-model fields (mlx-lm `TextArgs`); `form` says how config.json holds
# them: "nested" = release-style wrapper {model_type: kimi_k3, text_config: {...}}, written with every field
# spelled out; "flat" = the text fields at top level (mlx-lm's ModelArgs.from_dict accepts this too),
# written minimally so that mlx-lm's defaults apply to everything omitted.
# ---------------------------------------------------------------------------------------------------------

FIXTURES = [
    {
        "name": "a_latent_norm_attnres",
        "form": "nested",
        "seed": 1001,
        "release": False,
        "summary": "3 layers (KDA, KDA, MLA); dense layer 0 then latent MoE with routed_expert_norm; attention "
        "residuals (block 2); q_lora; MLA output gate; low-rank KDA gate with gate_lower_bound; 8 experts "
        "top-3 in 4 groups (topk_group 2) + 1 shared; SiTU beta 2 / linear_beta 1.5; routed_scaling_factor "
        "2.5; tied embeddings. Every quantizable input dim is a multiple of 32: the base of both quantized "
        "fixtures",
        "text": {
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "linear_attn_config": {
                "num_heads": 1,
                "head_dim": 32,
                "short_conv_kernel_size": 4,
                "kda_layers": [1, 2],
                "full_attn_layers": [3],
                "gate_lower_bound": -5.0,
                "use_full_rank_gate": False,
            },
            "activation_situ_beta": 2.0,
            "activation_situ_linear_beta": 1.5,
            "attn_res_block_size": 2,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "mla_use_output_gate": True,
            "num_experts": 8,
            "num_experts_per_token": 3,
            "num_shared_experts": 1,
            "moe_intermediate_size": 32,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "num_expert_group": 4,
            "topk_group": 2,
            "routed_expert_hidden_size": 32,
            "latent_moe_use_norm": True,
            "tie_word_embeddings": True,
        },
    },
    {
        "name": "b_latent_fullrank_every2",
        "form": "flat",
        "seed": 2002,
        "release": False,
        "summary": "3 layers (KDA, MLA, KDA); MoE on layers 0 and 2 (moe_layer_freq 2, first_k_dense_replace 0); "
        "latent MoE without norm; no attention residuals; plain q_proj (no q_lora); no MLA output gate; "
        "full-rank KDA gate, no gate_lower_bound; 8 experts top-2, ungrouped, no shared experts; default "
        "SiTU (beta 1, no linear_beta); untied head; minimal flat config (mlx-lm defaults for the rest)",
        "text": {
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "linear_attn_config": {
                "num_heads": 2,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
                "kda_layers": [1, 3],
                "use_full_rank_gate": True,
            },
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "num_experts": 8,
            "num_experts_per_token": 2,
            "moe_intermediate_size": 16,
            "moe_layer_freq": 2,
            "routed_expert_hidden_size": 16,
        },
    },
    {
        "name": "c_hidden_experts_grouped",
        "form": "flat",
        "seed": 3003,
        "release": False,
        "summary": "3 layers (KDA, MLA, KDA); layers 0-1 dense (first_k_dense_replace 2), MoE on layer 2; "
        "routed experts on the hidden size (no latent); no attention residuals; plain q_proj; MLA output "
        "gate; full-rank KDA gate with gate_lower_bound; 8 experts top-2 in 2 groups (topk_group 1) + 2 "
        "shared; SiTU linear_beta 2.0; tied embeddings",
        "text": {
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "linear_attn_config": {
                "num_heads": 2,
                "head_dim": 16,
                "short_conv_kernel_size": 3,
                "kda_layers": [1, 3],
                "gate_lower_bound": -3.0,
                "use_full_rank_gate": True,
            },
            "activation_situ_linear_beta": 2.0,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "mla_use_output_gate": True,
            "num_experts": 8,
            "num_experts_per_token": 2,
            "num_shared_experts": 2,
            "moe_intermediate_size": 8,
            "routed_scaling_factor": 1.5,
            "first_k_dense_replace": 2,
            "num_expert_group": 2,
            "topk_group": 1,
            "tie_word_embeddings": True,
        },
    },
    {
        "name": "d_latent_norm_attnres_untied",
        "form": "nested",
        "seed": 4004,
        "release": True,
        "summary": "4 layers (MLA, KDA, KDA, MLA); MoE on layers 2-3 (first_k_dense_replace 2); latent MoE with "
        "routed_expert_norm; attention residuals (block 3); q_lora; no MLA output gate; low-rank KDA gate, "
        "no gate_lower_bound; 16 experts top-4 in 4 groups (topk_group 3) + 1 shared; moe_renormalize "
        "false; SiTU beta 4 / linear_beta 3; untied head",
        "text": {
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "linear_attn_config": {
                "num_heads": 2,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
                "kda_layers": [2, 3],
                "full_attn_layers": [1, 4],
                "use_full_rank_gate": False,
            },
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 3.0,
            "attn_res_block_size": 3,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "num_experts": 16,
            "num_experts_per_token": 4,
            "num_shared_experts": 1,
            "moe_intermediate_size": 16,
            "moe_renormalize": False,
            "first_k_dense_replace": 2,
            "num_expert_group": 4,
            "topk_group": 3,
            "routed_expert_hidden_size": 16,
            "latent_moe_use_norm": True,
            "tie_word_embeddings": False,
        },
    },
]

# Quantized variants, made by mlx-lm itself the way `mlx_lm.convert` does it: load the float fixture with
# `load_model`, `quantize_model(model, config, group_size, bits, mode, quant_predicate=...)`, then
# `save_model` + `save_config`.
QUANTIZED = [
    {
        "name": "a_latent_norm_attnres_q4",
        "base": "a_latent_norm_attnres",
        "recipe": "q4",
        "summary": "fixture a quantized as `mlx_lm.convert -q --q-bits 4 --q-group-size 32` does it: affine 4-bit "
        "group 32, with kimi_k3's own quant_predicate (router `mlp.gate` 8-bit group 64, attention-residual "
        "projections left float); the quantized tied embedding is also the head",
        "group_size": 32,
        "bits": 4,
    },
    {
        "name": "a_latent_norm_attnres_mixed_2_8",
        "base": "a_latent_norm_attnres",
        "recipe": "mixed",
        "summary": "fixture a with a mixed recipe: routed experts (switch_mlp) affine 2-bit group 32, router "
        "`mlp.gate` 8-bit group 64, embed_tokens (tied head) 4-bit group 32, attention-residual projections "
        "float, everything else 6-bit group 32 (the top-level default)",
        "group_size": 32,
        "bits": 6,
    },
]


# Quantized checkpoints in the release's own formats, the two that mlx-lm's `LanguageModel.sanitize` converts
# on load: (a) routed experts in compressed-tensors MXFP4 (per expert `w{1,2,3}.weight_packed` uint8 E2M1
# code pairs + `weight_scale` uint8 E8M0 per 32 inputs), (b) an affine-quantized `kv_b_proj`
# (`weight`/`scales`/`biases`), which sanitize dequantizes, splits into `embed_q`/`unembed_out` and
# re-quantizes with the same bits and group size (first checkpoint only). In the first, the other layers are affine-quantized the way
# `mlx_lm.convert -q` does it with kimi_k3's own predicate; the second ("rest": "bf16") is the real release's
# layout, with only the routed experts quantized and everything else bfloat16 (as its `ignore` list says). Only
# the release folder `<name>_release` is written; its expected outputs are what mlx-lm's `load_model` makes
# of it. (What `mlx_lm.convert` would write from it is checked to round-trip, but not kept: no room.)
RELEASE_QUANTIZED = [
    {
        "name": "a_latent_norm_attnres_mxfp4",
        "base": "a_latent_norm_attnres",
        "summary": "fixture a as a quantized release checkpoint: routed experts MXFP4 in the compressed-tensors "
        "release layout (per-expert `weight_packed`/`weight_scale`), `kv_b_proj` affine 4-bit group 32 "
        "(sanitize re-quantizes its `embed_q`/`unembed_out` halves), router `gate` affine 8-bit group 64, "
        "attention-residual projections float, every other linear and the tied embedding affine 4-bit group 32; "
        "config.json carries only the release's compressed-tensors `quantization_config` (in `text_config`)",
        "group_size": 32,
        "bits": 4,
        "rest": "affine",
    },
    {
        "name": "a_latent_norm_attnres_bf16_mxfp4",
        "base": "a_latent_norm_attnres",
        "summary": "fixture a laid out like the real release: routed experts MXFP4 in the compressed-tensors "
        "release layout (per-expert `weight_packed`/`weight_scale`), every other weight bfloat16 (`A_log`, "
        "`dt_bias` and the router's `e_score_correction_bias` float32, as mlx-lm's cast_predicate keeps them), "
        "`kv_b_proj` bfloat16 and unquantized; config.json carries only the release's compressed-tensors "
        "`quantization_config` (in `text_config`), whose `ignore` list names exactly the modules left bfloat16. "
        "Its expected logits are mlx-lm's with the loaded model cast to float32 (`set_dtype`; the MXFP4 "
        "experts keep their packing)",
        "group_size": 32,
        "bits": 4,
        "rest": "bf16",
    },
]

# What a compressed-tensors MXFP4 release records (llm-compressor's MXFP4 scheme). mlx-lm reads only
# `quant_method` and `format` (-> default {group_size 32, bits 4, mode mxfp4}) and infers every quantized
# module's own parameters from its tensors (`infer_quant_config`), which is how it also finds the affine ones.
MXFP4_WEIGHTS = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": 32,
    "num_bits": 4,
    "observer": "minmax",
    "observer_kwargs": {},
    "scale_dtype": "torch.uint8",
    "strategy": "group",
    "symmetric": True,
    "type": "float",
    "zp_dtype": None,
}
COMPRESSED_TENSORS_MXFP4 = {
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": MXFP4_WEIGHTS,
        }
    },
    "format": "mxfp4-pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*routed_expert_(up|down)_proj.*",
        "re:.*block_sparse_moe\\.gate$",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def mxfp4_release_predicate(path: str, module) -> bool | dict:
    """MXFP4 routed experts; embed_q/unembed_out float (to_release quantizes the kv_b_proj made from them);
    otherwise kimi_k3's own predicate (8-bit router, float res projections, affine default elsewhere)."""
    if ".switch_mlp." in path:
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    if path.endswith(("self_attn.embed_q", "self_attn.unembed_out", "res_proj")):
        return False
    if path.endswith("mlp.gate"):
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    return True


def experts_only_mxfp4_predicate(path: str, module) -> bool | dict:
    """MXFP4 routed experts, everything else left float (what the release's `ignore` list says)."""
    if ".switch_mlp." in path:
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return False


def to_bf16(params: dict, cast) -> dict:
    """Floating tensors cast to bfloat16 where `cast` (mlx-lm's kimi_k3 cast_predicate) says so: it keeps
    `A_log`, `dt_bias` and `e_score_correction_bias` float32, and matches them by the same name endings under
    mlx-lm's and the release's naming."""
    return {
        k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) and cast(k) else v
        for k, v in params.items()
    }


def mixed_predicate(path: str, module) -> bool | dict:
    """2-bit routed experts, 8-bit router, 4-bit embeddings/head, float res projections, default elsewhere."""
    if path.endswith("res_proj"):
        return False
    if path.endswith("mlp.gate"):
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    if ".switch_mlp." in path:
        return {"group_size": 32, "bits": 2, "mode": "affine"}
    if path.endswith(("embed_tokens", "lm_head")):
        return {"group_size": 32, "bits": 4, "mode": "affine"}
    return True


# ---------------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------------


def full_text_config(text: dict) -> dict:
    """Every TextArgs field spelled out, release-style (the text model calls itself kimi_linear)."""
    t = {
        "model_type": "kimi_linear",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_key_value_heads": text["num_attention_heads"],
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "hidden_act": "situ",
        "activation_situ_beta": 1.0,
        "activation_situ_linear_beta": None,
        "attn_res_block_size": None,
        "q_lora_rank": None,
        "mla_use_nope": True,
        "mla_use_output_gate": False,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_shared_experts": 0,
        "routed_expert_hidden_size": None,
        "latent_moe_use_norm": False,
        "tie_word_embeddings": False,
    }
    t.update(copy.deepcopy(text))
    return dict(sorted(t.items()))


def make_config(fx: dict) -> dict:
    text = copy.deepcopy(fx["text"])
    if fx["form"] == "nested":
        tc = full_text_config(text)
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "text_config": tc,
            "tie_word_embeddings": tc["tie_word_embeddings"],
        }
    cfg = {"model_type": "kimi_k3", "vocab_size": VOCAB, "hidden_size": HIDDEN}
    cfg.update(text)
    return cfg


def text_of(config: dict) -> dict:
    """The text fields exactly as mlx-lm resolves them (defaults filled in)."""
    args = kimi_k3.ModelArgs.from_dict(copy.deepcopy(config)).text_config
    return {k: getattr(args, k) for k in args.__dataclass_fields__}


def layer_plan(t: dict) -> dict:
    kda = [i for i in range(t["num_hidden_layers"]) if i + 1 in t["linear_attn_config"]["kda_layers"]]
    moe = [
        i
        for i in range(t["num_hidden_layers"])
        if (t["num_experts"] or 0) > 0 and i >= t["first_k_dense_replace"] and i % t["moe_layer_freq"] == 0
    ]
    n = t["num_hidden_layers"]
    return {
        "kda": kda,
        "mla": [i for i in range(n) if i not in kda],
        "moe": moe,
        "dense_mlp": [i for i in range(n) if i not in moe],
    }


def check_layer_plan(model, t: dict) -> None:
    """The layer plan recorded in the manifest is the one mlx-lm built."""
    plan = layer_plan(t)
    built_kda = [i for i, layer in enumerate(model.layers) if layer.is_linear]
    built_moe = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, kimi_k3.KimiK3SparseMoE)]
    assert (built_kda, built_moe) == (plan["kda"], plan["moe"]), (built_kda, built_moe, plan)
    assert plan["kda"] and plan["mla"] and plan["moe"], plan


def feature_flags(t: dict) -> dict:
    lac = t["linear_attn_config"]
    plan = layer_plan(t)
    return {
        "latent_moe": t["routed_expert_hidden_size"] is not None,
        "latent_moe_use_norm": bool(t["routed_expert_hidden_size"] is not None and t["latent_moe_use_norm"]),
        "attn_res": t["attn_res_block_size"] is not None,
        "attn_res_block_size": t["attn_res_block_size"],
        "q_lora": t["q_lora_rank"] is not None,
        "mla_output_gate": bool(t["mla_use_output_gate"]),
        "kda_full_rank_gate": bool(lac.get("use_full_rank_gate", False)),
        "kda_gate_lower_bound": lac.get("gate_lower_bound"),
        "grouped_topk": t["num_expert_group"] > 1,
        "num_expert_group": t["num_expert_group"],
        "topk_group": t["topk_group"],
        "num_experts": t["num_experts"],
        "num_experts_per_token": t["num_experts_per_token"],
        "shared_experts": t["num_shared_experts"],
        "tie_word_embeddings": bool(t["tie_word_embeddings"]),
        "first_k_dense_replace": t["first_k_dense_replace"],
        "moe_layer_freq": t["moe_layer_freq"],
        "moe_renormalize": bool(t["moe_renormalize"]),
        "routed_scaling_factor": t["routed_scaling_factor"],
        "activation_situ_beta": t["activation_situ_beta"] or 1.0,  # mlx-lm: `beta or 1.0`
        "activation_situ_linear_beta": t["activation_situ_linear_beta"],
        "short_conv_kernel_size": lac["short_conv_kernel_size"],
        "kda_layers_0based": plan["kda"],
        "mla_layers_0based": plan["mla"],
        "moe_layers_0based": plan["moe"],
        "dense_mlp_layers_0based": plan["dense_mlp"],
    }


# ---------------------------------------------------------------------------------------------------------
# Weights: seeded, scaled so activations stay O(1) and logits have a spread of a few units.
# ---------------------------------------------------------------------------------------------------------


def init_weights(model, t: dict) -> None:
    lac = t["linear_attn_config"]
    heads = lac["num_heads"]
    new = []
    for path, w in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        shape = w.shape
        leaf = path.rsplit(".", 2)
        owner = leaf[-2] if path.endswith(".weight") else leaf[-1]
        if path.endswith("A_log"):
            v = mx.log(mx.random.uniform(1.0, 8.0, (heads,)))
        elif path.endswith("dt_bias"):
            v = mx.random.uniform(-3.0, 0.0, shape)
        elif path.endswith("e_score_correction_bias"):
            v = 0.3 * mx.random.normal(shape)
        elif "norm" in owner:  # every RMSNorm weight: near one, but not one
            v = 1.0 + 0.1 * mx.random.normal(shape)
        elif path.endswith("conv.weight"):  # depthwise (C, K, 1)
            v = mx.random.normal(shape) * (1.0 / np.sqrt(shape[1]))
        elif path.endswith(("embed_tokens.weight", "lm_head.weight")):
            v = 0.3 * mx.random.normal(shape)
        elif path.endswith("res_proj.weight"):  # (1, D): softmax logits over blocks of std ~1.5
            v = mx.random.normal(shape) * (1.5 / np.sqrt(shape[-1]))
        elif path.endswith(("embed_q.weight", "unembed_out.weight")):  # (H, r, d_n) / (H, d_v, r)
            v = mx.random.normal(shape) * (1.0 / np.sqrt(t["kv_lora_rank"]))
        elif path.endswith("mlp.gate.weight"):  # router: sigmoid inputs with std ~1.5
            v = mx.random.normal(shape) * (1.5 / np.sqrt(shape[-1]))
        else:  # Linear (out, in) and expert stacks (E, out, in)
            assert path.endswith(".weight") and len(shape) in (2, 3), path
            v = mx.random.normal(shape) * (1.0 / np.sqrt(shape[-1]))
        new.append((path, v.astype(mx.float32)))
    model.load_weights(new, strict=True)
    mx.eval(model.parameters())


# ---------------------------------------------------------------------------------------------------------
# Running the reference
# ---------------------------------------------------------------------------------------------------------


class RouterProbe:
    """Wraps kimi_k3._group_expert_select to record each routing decision's selection gaps."""

    def __init__(self):
        self.records = []
        self._orig = kimi_k3._group_expert_select

    def __enter__(self):
        def probe(gates, bias, top_k, n_group, topk_group, scale, renorm):
            inds, w = self._orig(gates, bias, top_k, n_group, topk_group, scale, renorm)
            mx.eval(inds, w)
            self.records.append(
                (np.array(gates.astype(mx.float32)), np.array(bias), top_k, n_group, topk_group, np.array(inds))
            )
            return inds, w

        kimi_k3._group_expert_select = probe
        return self

    def __exit__(self, *exc):
        kimi_k3._group_expert_select = self._orig

    def min_gap(self) -> tuple[float, int]:
        """Smallest gap at any selection boundary, and how many routed picks came from a zeroed group."""
        gap, zeroed_picks = np.inf, 0
        for gates, bias, k, g, tg, inds in self.records:
            s = 1.0 / (1.0 + np.exp(-gates.reshape(-1, gates.shape[-1]).astype(np.float64)))
            s = s + bias.astype(np.float64)
            inds = inds.reshape(-1, k)
            for row, picked in zip(s, inds):
                row = row.copy()
                if g > 1:
                    grp = row.reshape(g, -1)
                    gscore = np.sort(grp, axis=-1)[:, -2:].sum(-1)
                    order = np.argsort(-gscore, kind="stable")
                    gs = gscore[order]
                    gap = min(gap, gs[tg - 1] - gs[tg])
                    dropped = order[tg:]
                    grp[dropped] = 0.0  # mlx-lm zeroes dropped groups (not -inf)
                    row = grp.reshape(-1)
                    per = grp.shape[1]
                    zeroed_picks += sum(int(e) // per in set(dropped.tolist()) for e in picked)
                srt = np.sort(row)[::-1]
                gap = min(gap, srt[k - 1] - srt[k])
                if srt[k - 1] - srt[k] > 0:  # unambiguous: mlx-lm must have picked exactly these
                    assert set(np.argsort(-row, kind="stable")[:k].tolist()) == set(picked.tolist())
        return float(gap), zeroed_picks


def top_gap(logits: np.ndarray) -> float:
    s = np.sort(logits.astype(np.float64))
    return float(s[-1] - s[-2])


GENERATE_TOKENS = 32


def run_reference(model, prompt: np.ndarray) -> dict:
    cache = model.make_cache()
    prefill = model(mx.array(prompt[None]), cache=cache)[0]
    mx.eval(prefill)
    prefill = np.array(prefill)
    tok = int(np.argmax(prefill[-1]))
    gaps = [top_gap(prefill[-1])]
    fed, dec = [], []
    for _ in range(DECODE_STEPS):
        fed.append(tok)
        out = model(mx.array([[tok]], dtype=mx.int32), cache=cache)[0, -1]
        mx.eval(out)
        out = np.array(out)
        dec.append(out)
        gaps.append(top_gap(out))
        tok = int(np.argmax(out))
    seq = np.concatenate([prompt, np.array(fed, dtype=np.int32)])
    full = model(mx.array(seq[None]))[0]
    mx.eval(full)
    # mlx-lm's own generation loop (greedy, fresh cache, default prefill chunking) for 32 tokens.
    generated, gen_gaps = [], []
    for tok_i, logprobs in generate_step(mx.array(prompt), model, max_tokens=GENERATE_TOKENS):
        generated.append(int(tok_i))
        gen_gaps.append(top_gap(np.array(logprobs)))
    return {
        "prompt": prompt.astype(np.int32),
        "prefill_logits": prefill.astype(np.float32),
        "decode_tokens": np.array(fed, dtype=np.int32),
        "decode_logits": np.stack(dec).astype(np.float32),
        "full_logits": np.array(full).astype(np.float32),
        "generate_tokens": np.array(generated, dtype=np.int32),
        "_greedy_gap": min(gaps + gen_gaps),
        "_next_token": tok,
    }


def bf16_prefill(model, prompt: np.ndarray) -> np.ndarray:
    """Prompt logits with the model cast to bf16 as mlx-lm casts it (its cast_predicate keeps A_log, dt_bias
    and the router bias in f32), stored as f32. Only for quantized fixtures: MLX's CPU gather_mm (dense
    expert stacks) supports f32 only, so mlx-lm cannot run the float fixtures in bf16 on a CPU."""
    pred = model.cast_predicate
    model.update(
        tree_map_with_path(
            lambda p, x: x.astype(mx.bfloat16) if mx.issubdtype(x.dtype, mx.floating) and pred(p) else x,
            model.parameters(),
        )
    )
    out = model(mx.array(prompt[None]))[0]
    mx.eval(out)
    return np.array(out.astype(mx.float32))


def check_consistency(exp: dict) -> float:
    """Cached prefill/decode must agree with the cache-less forward; returns the max abs difference."""
    T = PROMPT_LEN
    full = exp["full_logits"]
    d1 = np.abs(full[:T] - exp["prefill_logits"]).max()
    d2 = np.abs(full[T:] - exp["decode_logits"]).max()
    scale = np.abs(full).max()
    assert max(d1, d2) <= 1e-4 * max(1.0, scale), (d1, d2, scale)
    return float(max(d1, d2))


def choose_prompt_and_run(
    model, seed: int, vocab: int = VOCAB, probe=None, need_router: bool = False, min_index_gap=None
) -> tuple[dict, dict]:
    """First prompt (seeds seed, seed+1, ...) whose greedy and routing decisions are robust.

    ``probe`` makes the context manager that records the router's (and, with ``min_index_gap``, the sparse
    indexer's) selection gaps (``RouterProbe`` by default); ``need_router`` asserts the router ran. The
    DeepSeek-V3 family, V3.2 and K3.1 scripts call this with their own vocabulary and probes."""
    probe = probe or RouterProbe
    for attempt in range(MAX_PROMPT_TRIES):
        rng = np.random.default_rng(seed + attempt)
        prompt = rng.integers(0, vocab, size=PROMPT_LEN).astype(np.int32)
        exp = run_reference(model, prompt)
        p = probe()
        with p:
            again = run_reference(model, prompt)
        for k in ("prefill_logits", "decode_logits", "full_logits"):
            assert np.array_equal(exp[k], again[k]), f"probing changed {k}"
        if min_index_gap is not None:
            assert p.records and p.index_gaps, "the router or the sparse indexer never ran"
        elif need_router:
            assert p.records, "the router never ran"
        router_gap, zeroed = p.min_gap() if p.records else (float("inf"), 0)
        index_gap_min = min(p.index_gaps) if min_index_gap is not None else None
        distinct = len(set(exp["decode_tokens"].tolist()))
        if (
            exp["_greedy_gap"] >= MIN_GREEDY_GAP
            and router_gap >= MIN_ROUTER_GAP
            and (index_gap_min is None or index_gap_min >= min_index_gap)
            and distinct >= MIN_DISTINCT_DECODE_TOKENS
        ):
            stats = {
                "prompt_seed": seed + attempt,
                "min_greedy_top2_gap": round(exp["_greedy_gap"], 6),
                "min_router_selection_gap": round(router_gap, 6),
            }
            if index_gap_min is not None:
                stats["min_indexer_topk_gap"] = round(float(index_gap_min), 6)
                stats["sparse_indexer_calls"] = len(p.index_gaps)
            stats.update(
                {
                    "router_picks_from_zeroed_groups": zeroed,
                    "distinct_decode_tokens": distinct,
                    "next_token_after_decode": exp["_next_token"],
                    "max_abs_diff_cached_vs_full": float(f"{check_consistency(exp):.3g}"),
                    "logits_std": round(float(exp["full_logits"].std()), 4),
                }
            )
            return exp, stats
    raise RuntimeError(f"no robust prompt found in {MAX_PROMPT_TRIES} tries (seed {seed})")


def save_expected(path: Path, exp: dict, stats: dict, generator: str = "scripts/make_k3_fixtures.py") -> None:
    """Writes a fixture's expected arrays (keys without a leading ``_``) with the generator, pins and seed."""
    arrays = {k: mx.array(v) for k, v in exp.items() if not k.startswith("_")}
    meta = {
        "generator": generator,
        "mlx": PINS["mlx"],
        "mlx_lm": PINS["mlx-lm"],
        "prompt_seed": str(stats["prompt_seed"]),
    }
    if generator == "scripts/make_k3_fixtures.py":
        meta["decode_tokens"] = (
            "tokens fed to decode steps 0..N-1; [0]=argmax(prefill_logits[-1]), [i]=argmax(decode_logits[i-1])"
        )
        meta["full_logits"] = "cache-less forward of concat(prompt, decode_tokens)"
    mx.save_safetensors(str(path), dict(sorted(arrays.items())), metadata=meta)


# ---------------------------------------------------------------------------------------------------------
# Release (Hugging Face) names: mlx-lm's sanitize, inverted
# ---------------------------------------------------------------------------------------------------------

RES_SITES = ("self_attention_res", "mlp_res", "output_attn_res")
EXPERT_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def to_release(sanitized: dict, t: dict, kv_b_quant: dict | None = None) -> dict:
    """Inverse of mlx-lm's `Model.sanitize`: the names and layouts of the Kimi K3 release.

    Text tensors under `language_model.`; per-expert `block_sparse_moe.experts.E.w{1,2,3}`; the router and
    its `gate.e_score_correction_bias` under `block_sparse_moe`; separate KDA `{q,k,v}_proj` and depthwise
    `{q,k,v}_conv1d` in torch Conv1d layout (C, 1, K); `A_log` 1-D zero-padded past num_heads to head_dim
    entries (sanitize keeps the first num_heads); MLA `kv_b_proj` (H*(d_nope+d_v), kv_lora_rank) instead of
    `embed_q`/`unembed_out`; attention-residual `*_res.proj_weight` / `*_res.norm_weight`. Plus tensors the
    loader must drop: a vision tower, a projector, and a layer past num_hidden_layers.

    Quantized input (mlx-lm `.weight`/`.scales`/`.biases` triples) keeps its suffixes, except MXFP4 routed
    experts (uint8 E8M0 scales), which take the compressed-tensors layout of the release: per expert
    `w{1,2,3}.weight_packed` (the uint32 code words' bytes, uint8 [out, in/2]) and `w{1,2,3}.weight_scale`
    (uint8 [out, in/32]); mlx-lm's sanitize stacks them and views the codes as uint32. `embed_q`/
    `unembed_out` must be float; `kv_b_quant` ({"group_size", "bits"}) affine-quantizes the `kv_b_proj`
    built from them (sanitize dequantizes it, splits it and re-quantizes both halves).
    """
    lac = t["linear_attn_config"]
    H_kda, d = lac["num_heads"], lac["head_dim"]
    moe_layers = set(layer_plan(t)["moe"])
    H, d_n = t["num_attention_heads"], t["qk_nope_head_dim"]
    out = {}
    for key, v in sanitized.items():
        assert key.startswith("language_model."), key
        k = key[len("language_model.") :]
        for site in RES_SITES:
            if k.endswith(f"{site}_proj.weight"):
                k = k[: -len(f"{site}_proj.weight")] + f"{site}.proj_weight"
            elif k.endswith(f"{site}_norm.weight"):
                k = k[: -len(f"{site}_norm.weight")] + f"{site}.norm_weight"
        parts = k.split(".")
        if parts[:2] == ["model", "layers"]:
            li, rest = int(parts[2]), ".".join(parts[3:])
            lp = f"model.layers.{li}"
            if rest.startswith("self_attn.qkv_proj."):  # weight, or a quantized triple: rows split alike
                suffix = rest.rsplit(".", 1)[1]
                for name, part in zip("qkv", mx.split(v, 3, axis=0)):
                    out[f"{lp}.self_attn.{name}_proj.{suffix}"] = part
                continue
            if rest == "self_attn.qkv_conv.conv.weight":  # MLX (C, K, 1) -> torch Conv1d (C, 1, K)
                for name, part in zip("qkv", mx.split(v, 3, axis=0)):
                    out[f"{lp}.self_attn.{name}_conv1d.weight"] = mx.contiguous(part.moveaxis(1, 2))
                continue
            if rest == "self_attn.A_log":
                assert d > H_kda
                out[f"{lp}.self_attn.A_log"] = mx.concatenate([v, mx.zeros((d - H_kda,), v.dtype)])
                continue
            if rest.startswith(("self_attn.embed_q.", "self_attn.unembed_out.")):
                assert rest.endswith(".weight"), f"{key}: to_release needs float embed_q/unembed_out"
            if rest == "self_attn.embed_q.weight":
                wk = v.swapaxes(-1, -2)  # (H, d_n, r)
                wv = sanitized[f"language_model.{lp}.self_attn.unembed_out.weight"]  # (H, d_v, r)
                kv_b = mx.concatenate([wk, wv], axis=1)
                kv_b = mx.contiguous(kv_b.reshape(-1, kv_b.shape[-1]))
                assert kv_b.shape[0] == H * (d_n + t["v_head_dim"])
                if kv_b_quant is None:
                    out[f"{lp}.self_attn.kv_b_proj.weight"] = kv_b
                else:  # affine along kv_lora_rank, as mlx_lm.convert would quantize a kv_b_proj Linear
                    qw, qs, qb = mx.quantize(kv_b, group_size=kv_b_quant["group_size"], bits=kv_b_quant["bits"])
                    out[f"{lp}.self_attn.kv_b_proj.weight"] = qw
                    out[f"{lp}.self_attn.kv_b_proj.scales"] = qs
                    out[f"{lp}.self_attn.kv_b_proj.biases"] = qb
                continue
            if rest == "self_attn.unembed_out.weight":
                continue
            if li in moe_layers and rest.startswith("mlp."):
                sub = rest[len("mlp.") :]
                if sub.startswith("switch_mlp."):
                    _, proj, leaf = sub.split(".")
                    scales = sanitized.get(f"{key.rsplit('.', 1)[0]}.scales")
                    mxfp4 = scales is not None and scales.dtype == mx.uint8
                    if mxfp4:  # compressed-tensors MXFP4 (no biases in this mode)
                        codes = sanitized[f"{key.rsplit('.', 1)[0]}.weight"]  # uint32 words, 8 codes each
                        assert codes.shape[-1] * 8 == scales.shape[-1] * 32 and leaf in ("weight", "scales")
                        leaf = {"weight": "weight_packed", "scales": "weight_scale"}[leaf]
                    for e in range(v.shape[0]):
                        ve = v[e].view(mx.uint8) if leaf == "weight_packed" else v[e]
                        out[f"{lp}.block_sparse_moe.experts.{e}.{EXPERT_NAMES[proj]}.{leaf}"] = ve
                elif sub == "e_score_correction_bias":
                    out[f"{lp}.block_sparse_moe.gate.e_score_correction_bias"] = v
                else:
                    out[f"{lp}.block_sparse_moe.{sub}"] = v
                continue
        out[k] = v
    out[f"model.layers.{t['num_hidden_layers']}.input_layernorm.weight"] = mx.ones((HIDDEN,))
    out = {"language_model." + k: v for k, v in out.items()}
    out["vision_tower.patch_embed.proj.weight"] = mx.zeros((8, 3, 2, 2))
    out["mm_projector.proj.0.weight"] = mx.zeros((HIDDEN, 8))
    return dict(sorted((k, mx.contiguous(v)) for k, v in out.items()))


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------


def release_kept(release: dict, t: dict) -> list:
    """Release names mlx-lm's sanitize keeps (the rest are the extras `to_release` adds to be dropped)."""
    n = t["num_hidden_layers"]
    return [
        k
        for k in release
        if k.startswith("language_model.") and not k.startswith(f"language_model.model.layers.{n}.")
    ]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def params_of(model) -> dict:
    return dict(tree_flatten(model.parameters()))


def write_model_dir(path: Path, model, config: dict) -> None:
    if path.exists():
        shutil.rmtree(path)
    save_model(path, model)
    save_config(copy.deepcopy(config), config_path=path / "config.json")


def quant_summary(config: dict) -> dict | None:
    q = config.get("quantization")
    if q is None:
        return None
    overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
    kinds = sorted({json.dumps(v, sort_keys=True) for v in overrides.values()})
    return {
        "default": {k: v for k, v in q.items() if not isinstance(v, dict)},
        "override_paths": len(overrides),
        "override_kinds": [json.loads(s) for s in kinds],
    }


def build_all(out: Path) -> list:
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for fx in FIXTURES:
        config = make_config(fx)
        t = text_of(config)
        mx.random.seed(fx["seed"])
        model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(copy.deepcopy(config)))
        check_layer_plan(model, t)
        init_weights(model, t)
        fdir = out / fx["name"]
        write_model_dir(fdir, model, config)
        del model

        ref, _ = load_model(fdir)
        exp, stats = choose_prompt_and_run(ref, fx["seed"])
        save_expected(fdir / "expected.safetensors", exp, stats)
        entries.append(entry(fx["name"], fx["summary"], fx["form"], "mlx", t, config, stats, None))
        print(f"{fx['name']}: {stats}")

        if fx["release"]:
            rdir = out / f"{fx['name']}_release"
            if rdir.exists():
                shutil.rmtree(rdir)
            rdir.mkdir()
            shutil.copyfile(fdir / "config.json", rdir / "config.json")
            release = to_release(mx.load(str(fdir / "model.safetensors")), t)
            mx.save_safetensors(str(rdir / "model.safetensors"), release, metadata={"format": "pt"})
            # The release copy must sanitize back to exactly the same weights and outputs.
            rel_model, _ = load_model(rdir)
            a, b = params_of(ref), params_of(rel_model)
            assert a.keys() == b.keys(), set(a) ^ set(b)
            for k in a:
                assert a[k].dtype == b[k].dtype and np.array_equal(np.array(a[k]), np.array(b[k])), k
            rexp = run_reference(rel_model, exp["prompt"])
            for k in ("prefill_logits", "decode_tokens", "decode_logits", "full_logits", "generate_tokens"):
                assert np.array_equal(exp[k], rexp[k]), f"release copy differs in {k}"
            shutil.copyfile(fdir / "expected.safetensors", rdir / "expected.safetensors")
            e = entry(rdir.name, "release-named copy of " + fx["name"], fx["form"], "release", t, config, stats,
                      fx["name"])
            e["release_tensors"] = len(release)
            e["release_dropped_tensors"] = sorted(set(release) - set(release_kept(release, t)))
            entries.append(e)
            print(f"{rdir.name}: sanitize(release) == {fx['name']} (weights and logits bit-identical)")

    for q in QUANTIZED:
        bdir = out / q["base"]
        model, config = load_model(bdir)
        predicate = mixed_predicate if q["recipe"] == "mixed" else None
        model, qconfig = quantize_model(
            model, config, q["group_size"], q["bits"], mode="affine", quant_predicate=predicate
        )
        qdir = out / q["name"]
        write_model_dir(qdir, model, qconfig)
        del model
        ref, loaded_cfg = load_model(qdir)
        base_seed = next(f["seed"] for f in FIXTURES if f["name"] == q["base"])
        exp, stats = choose_prompt_and_run(ref, base_seed)
        # A fresh load: mlx-lm caches the attention-residual weights at the first forward, so a model that
        # already ran in f32 would keep f32-derived mixing weights after the cast.
        exp["prefill_logits_bf16"] = bf16_prefill(load_model(qdir)[0], exp["prompt"])
        save_expected(qdir / "expected.safetensors", exp, stats)
        t = text_of(loaded_cfg)
        base_form = next(f["form"] for f in FIXTURES if f["name"] == q["base"])
        entries.append(entry(q["name"], q["summary"], base_form, "mlx", t, loaded_cfg, stats, q["base"]))
        print(f"{q['name']}: {stats}")

    for q in RELEASE_QUANTIZED:
        entries.extend(build_release_quantized(out, q))
    return entries


def module_quant_kinds(model) -> list:
    """How mlx-lm built each quantized module: distinct {group_size, bits, mode} with module counts."""
    kinds = {}
    for path, m in model.named_modules():
        if hasattr(m, "group_size") and hasattr(m, "bits") and hasattr(m, "mode") and "scales" in m:
            key = json.dumps({"group_size": m.group_size, "bits": m.bits, "mode": m.mode}, sort_keys=True)
            kinds.setdefault(key, []).append(path)
    return [dict(json.loads(k), modules=len(v)) for k, v in sorted(kinds.items())]


def build_release_quantized(out: Path, q: dict) -> list:
    bdir = out / q["base"]
    fx = next(f for f in FIXTURES if f["name"] == q["base"])
    model, config = load_model(bdir)
    t = text_of(config)
    bf16 = q["rest"] == "bf16"
    predicate = experts_only_mxfp4_predicate if bf16 else mxfp4_release_predicate
    model, _ = quantize_model(model, config, q["group_size"], q["bits"], mode="affine", quant_predicate=predicate)
    cast = model.cast_predicate
    built = params_of(model)
    if bf16:
        built = to_bf16(built, cast)
    del model

    # The release folder: release names and layouts, the release's config (the base config plus the
    # compressed-tensors quantization_config inside text_config, where mlx-lm's load_model also looks).
    rdir = out / f"{q['name']}_release"
    if rdir.exists():
        shutil.rmtree(rdir)
    rdir.mkdir()
    rconfig = make_config(fx)
    assert "text_config" in rconfig
    rconfig["text_config"]["quantization_config"] = copy.deepcopy(COMPRESSED_TENSORS_MXFP4)
    save_config(copy.deepcopy(rconfig), config_path=rdir / "config.json")
    kv_b_quant = None if bf16 else {"group_size": q["group_size"], "bits": q["bits"]}
    release = to_release(built, t, kv_b_quant=kv_b_quant)
    if bf16:  # also the extras to_release adds for the loader to drop (vision tower, projector, extra layer)
        release = to_bf16(release, cast)
        assert {str(v.dtype) for v in release.values()} == {"mlx.core.bfloat16", "mlx.core.float32", "mlx.core.uint8"}
    mx.save_safetensors(str(rdir / "model.safetensors"), release, metadata={"format": "pt"})

    # The reference: mlx-lm's own loader on the release folder.
    ref, loaded_cfg = load_model(rdir)
    assert loaded_cfg["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}, loaded_cfg["quantization"]
    got = params_of(ref)
    assert got.keys() == built.keys() | {
        f"{k[: -len('.weight')]}.{s}" for k in built if k.endswith(("embed_q.weight", "unembed_out.weight"))
        for s in ("scales", "biases") if not bf16
    }, set(got) ^ set(built)
    for k, v in built.items():  # everything but the re-quantized kv_b_proj halves is what was built
        if not bf16 and ("embed_q." in k or "unembed_out." in k):
            continue
        assert got[k].dtype == v.dtype and mx.array_equal(got[k], v).item(), k
    modes = {k["mode"] for k in module_quant_kinds(ref)}
    assert modes == ({"mxfp4"} if bf16 else {"affine", "mxfp4"}), modes
    for li, layer in enumerate(ref.language_model.model.layers):
        if li in layer_plan(t)["moe"]:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert getattr(layer.mlp.switch_mlp, proj).mode == "mxfp4", (li, proj)
        if not layer.is_linear and not bf16:
            for name in ("embed_q", "unembed_out"):
                mod = getattr(layer.self_attn, name)
                assert (mod.mode, mod.bits, mod.group_size) == ("affine", q["bits"], q["group_size"]), (li, name)
                w = mx.dequantize(mod.weight, mod.scales, mod.biases, group_size=mod.group_size, bits=mod.bits)
                f = built[f"language_model.model.layers.{li}.self_attn.{name}.weight"]
                assert float(mx.abs(w - f).max()) < 0.5 * float(mx.abs(f).max()), (li, name)  # same matrix

    if bf16:  # the reference runs in float32, like mlx-k3's CPU default (quantized experts keep their packing)
        ref.set_dtype(mx.float32)
    exp, stats = choose_prompt_and_run(ref, fx["seed"])
    exp["prefill_logits_bf16"] = bf16_prefill(load_model(rdir)[0], exp["prompt"])
    save_expected(rdir / "expected.safetensors", exp, stats)
    print(f"{rdir.name}: {stats}")

    # What `mlx_lm.convert` (no -q) would write from the release (load_model + save_model + save_config):
    # checked to load back bit-identical, but not kept (another ~210 KB; the size budget has no room for it).
    with tempfile.TemporaryDirectory() as tmp:
        mdir = Path(tmp) / q["name"]
        write_model_dir(mdir, ref, loaded_cfg)
        mref, _ = load_model(mdir)
        a, b = params_of(ref), params_of(mref)
        assert a.keys() == b.keys(), set(a) ^ set(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(np.array(a[k]), np.array(b[k])), k
        mexp = run_reference(mref, exp["prompt"])
        for k in ("prefill_logits", "decode_tokens", "decode_logits", "full_logits"):
            assert np.array_equal(exp[k], mexp[k]), f"the mlx-lm conversion of {rdir.name} differs in {k}"
        saved_quantization = json.loads((mdir / "config.json").read_text())["quantization"]
        assert saved_quantization == loaded_cfg["quantization"], saved_quantization
    print(f"{rdir.name}: load_model + save_model + load_model round trip bit-identical")

    e = entry(rdir.name, q["summary"], fx["form"], "release", t, loaded_cfg, stats, q["base"],
              "bfloat16" if bf16 else "float32")
    e["quantization"]["module_kinds"] = module_quant_kinds(ref)
    e["quantization"]["recorded_as"] = (
        "text_config.quantization_config (compressed-tensors, format mxfp4-pack-quantized), no `quantization` "
        "key: `default` is what mlx-lm's load_model derives from it, `module_kinds` what it infers per module"
    )
    e["release_tensors"] = len(release)
    e["release_dropped_tensors"] = sorted(set(release) - set(release_kept(release, t)))
    return [e]


def entry(name, summary, form, names, t, config, stats, derived_from, float_dtype="float32") -> dict:
    qs = quant_summary(config)
    return {
        "name": name,
        "dir": name,
        "summary": summary,
        "config_form": form,
        "names": names,
        "derived_from": derived_from,
        "quantized": qs is not None,
        "quantization": qs,
        "float_dtype": float_dtype,
        "features": feature_flags(t),
        "prompt_len": PROMPT_LEN,
        "decode_steps": DECODE_STEPS,
        "vocab_size": VOCAB,
        "checks": stats,
    }


# ---------------------------------------------------------------------------------------------------------
# README.md (generated, so it always matches the fixtures)
# ---------------------------------------------------------------------------------------------------------

COVERAGE_ROWS = [
    ("KDA and MLA layers in one model", lambda f: bool(f["kda_layers_0based"] and f["mla_layers_0based"])),
    ("latent MoE with `latent_moe_use_norm`", lambda f: f["latent_moe_use_norm"]),
    ("latent MoE without norm", lambda f: f["latent_moe"] and not f["latent_moe_use_norm"]),
    ("routed experts on the hidden size (no latent)", lambda f: not f["latent_moe"]),
    ("attention residuals (`attn_res_block_size`)", lambda f: f["attn_res"]),
    ("no attention residuals", lambda f: not f["attn_res"]),
    ("`q_lora_rank` set", lambda f: f["q_lora"]),
    ("`q_lora_rank` unset (plain `q_proj`)", lambda f: not f["q_lora"]),
    ("MLA output gate (`mla_use_output_gate`)", lambda f: f["mla_output_gate"]),
    ("no MLA output gate", lambda f: not f["mla_output_gate"]),
    ("KDA full-rank gate (`use_full_rank_gate`)", lambda f: f["kda_full_rank_gate"]),
    ("KDA low-rank gate (`g_a_proj`/`g_b_proj`)", lambda f: not f["kda_full_rank_gate"]),
    ("KDA `gate_lower_bound`", lambda f: f["kda_gate_lower_bound"] is not None),
    ("grouped top-k (`num_expert_group` > 1)", lambda f: f["grouped_topk"]),
    ("shared experts", lambda f: f["shared_experts"] > 0),
    ("tied embeddings", lambda f: f["tie_word_embeddings"]),
    ("`first_k_dense_replace` > 0", lambda f: f["first_k_dense_replace"] > 0),
    ("`moe_layer_freq` > 1", lambda f: f["moe_layer_freq"] > 1),
    ("`activation_situ_linear_beta`", lambda f: f["activation_situ_linear_beta"] is not None),
    ("`moe_renormalize` false", lambda f: not f["moe_renormalize"]),
]


def readme(entries: list, root: Path) -> str:
    q4 = json.loads((root / QUANTIZED[0]["name"] / "config.json").read_text())["quantization"]
    mixed = json.loads((root / QUANTIZED[1]["name"] / "config.json").read_text())["quantization"]
    mixed_head = dict(list(mixed.items())[:6])
    L = []
    w = L.append
    w("# Kimi K3 reference fixtures (mlx-lm `kimi_k3`)\n")
    w(
        f"Generated by `scripts/make_k3_fixtures.py` with mlx {PINS['mlx']} (CPU) and mlx-lm {PINS['mlx-lm']}, "
        "whose `mlx_lm/models/kimi_k3.py` is the reference implementation. Do not edit by hand; regenerate "
        "with\n\n    .venv/bin/python scripts/make_k3_fixtures.py\n\nThe run is deterministic: files are "
        "byte-identical from run to run (`manifest.json` records each file's sha256). This README and "
        "`manifest.json` are written by the same script.\n"
    )
    w("## Files in each fixture folder\n")
    w("| file | what |\n|---|---|")
    w("| `config.json` | written by `mlx_lm.utils.save_config` (keys sorted at top level; nested dicts as built) |")
    w(
        "| `model.safetensors` | weights written by `mlx_lm.utils.save_model` (`mx.save_safetensors`, metadata "
        "`{\"format\": \"mlx\"}`), mlx-lm's sanitized names; float32, or mlx-lm-quantized (uint32 packed "
        "`weight` + float32 `scales`/`biases`) |"
    )
    w("| `model.safetensors.index.json` | written by `save_model` alongside (weight map, total size) |")
    w("| `expected.safetensors` | the reference outputs, below |")
    w(
        "\n`*_release` folders hold a model under the original release (Hugging Face) tensor names, "
        "written with `mx.save_safetensors` (metadata `{\"format\": \"pt\"}`, no index file). "
        f"`{FIXTURES[3]['name']}_release` is fixture d renamed: its `config.json` and `expected.safetensors` "
        "are byte copies of d's. "
        + " and ".join(f"`{q['name']}_release`" for q in RELEASE_QUANTIZED)
        + " are quantized release checkpoints with no mlx-named twin: their `config.json` is the release's "
        "(compressed-tensors `quantization_config`, no `quantization`) and their `expected.safetensors` is "
        "what mlx-lm's `load_model` computes from that folder (the bfloat16 one: cast to float32 first).\n"
    )
    w("## expected.safetensors\n")
    w(f"T = {PROMPT_LEN} prompt tokens, N = {DECODE_STEPS} decode steps, V = {VOCAB}. Batch size 1 everywhere.\n")
    w("| key | dtype | shape | contents |\n|---|---|---|---|")
    w(f"| `prompt` | int32 | [{PROMPT_LEN}] | random token ids (numpy `default_rng(checks.prompt_seed)`) |")
    w(
        f"| `prefill_logits` | float32 | [{PROMPT_LEN}, {VOCAB}] | logits of one forward of `prompt` with a "
        "fresh cache (`model.make_cache()`), every position |"
    )
    w(
        f"| `decode_tokens` | int32 | [{DECODE_STEPS}] | the tokens **fed** to the N one-token decode steps: "
        "`decode_tokens[0] = argmax(prefill_logits[T-1])`, `decode_tokens[i] = argmax(decode_logits[i-1])` |"
    )
    w(
        f"| `decode_logits` | float32 | [{DECODE_STEPS}, {VOCAB}] | `decode_logits[i]` = logits returned when "
        "`decode_tokens[i]` is fed, the cache holding the prompt and `decode_tokens[:i]` |"
    )
    w(
        f"| `full_logits` | float32 | [{PROMPT_LEN + DECODE_STEPS}, {VOCAB}] | one cache-less forward of "
        "`concat(prompt, decode_tokens)` |"
    )
    w(
        f"| `generate_tokens` | int32 | [{GENERATE_TOKENS}] | the tokens `mlx_lm.generate.generate_step` yields for "
        "`prompt` with its default (greedy) sampler and a fresh cache |"
    )
    w(
        f"| `prefill_logits_bf16` | float32 | [{PROMPT_LEN}, {VOCAB}] | quantized fixtures only: `prefill_logits` "
        "with the model cast to bf16 (mlx-lm's cast_predicate), values stored as f32. Float fixtures have none: "
        "MLX's CPU gather_mm runs f32 only, so mlx-lm cannot run their dense expert stacks in bf16 on a CPU |"
    )
    w(
        "\nThe token produced by the last step, `argmax(decode_logits[N-1])`, is not in the file; it is "
        "`checks.next_token_after_decode` in `manifest.json`. `full_logits[:T]` matches `prefill_logits` and "
        "`full_logits[T+i]` matches `decode_logits[i]` to mlx-lm's own cached-vs-cache-less difference "
        "(`checks.max_abs_diff_cached_vs_full`, at most 1e-4 of the largest logit). Note that the full forward "
        "has T+N tokens, so its MoE layers take SwitchGLU's sorted-experts path (tokens x top_k >= 64) while "
        "the 12-token prefill does not.\n"
    )
    w("## config.json forms\n")
    w(
        "- **nested** (the shape `mlx_lm.convert` keeps from the release's config): `{\"model_type\": \"kimi_k3\", "
        "\"architectures\": [\"KimiK3ForConditionalGeneration\"], \"text_config\": {...every text field, "
        "\"model_type\": \"kimi_linear\"}, \"tie_word_embeddings\": ...}`. mlx-lm reads only "
        "`text_config` (the wrapper's `tie_word_embeddings` is written equal to it but ignored).\n"
        "- **flat**: the text fields at top level with `\"model_type\": \"kimi_k3\"` "
        "(`ModelArgs.from_dict` wraps a dict without `text_config` as the text config). These are written "
        "minimally: every omitted field takes mlx-lm's `TextArgs` default (e.g. `rms_norm_eps` 1e-5, "
        "`activation_situ_beta` 1.0, `moe_renormalize` true, `tie_word_embeddings` false, `num_expert_group` 1).\n"
        "- KDA layers are chosen by `linear_attn_config.kda_layers` (1-based); every other layer is MLA. "
        "`full_attn_layers` appears in the nested configs, as in the release, but mlx-lm does not read it.\n"
    )
    w("## Quantization in config.json\n")
    w(
        "Exactly as `mlx_lm.convert` records it (`quantize_model` + `save_config`): a top-level "
        "`quantization` dict holding the default `group_size`, `bits`, `mode`, plus one entry per module path "
        "whose predicate returned a dict of its own parameters; `quantization_config` is a copy. A module the "
        "predicate quantizes with the defaults has no entry; a module left float has no entry and no "
        "`.scales` tensor. The loader rebuilds per module: its path's entry if any, else the defaults if "
        "`<path>.scales` exists, else float. Note kimi_k3's own predicate gives the router "
        "`{\"group_size\": 64, \"bits\": 8}` **without `mode`** (affine is meant).\n"
    )
    w("`a_latent_norm_attnres_q4` (`quantize_model(model, config, 32, 4)`, model's own predicate):\n")
    w("```json\n\"quantization\": " + json.dumps(q4, indent=4) + "\n```\n")
    w("`a_latent_norm_attnres_mixed_2_8` (custom predicate; first entries of " + str(len(mixed)) + "):\n")
    w("```json\n\"quantization\": " + json.dumps(mixed_head, indent=4)[:-2] + ",\n    ...\n}\n```\n")
    w("### The quantized release checkpoints\n")
    rq, rb = RELEASE_QUANTIZED
    rcfg = json.loads((root / f"{rq['name']}_release" / "config.json").read_text())
    bcfg = json.loads((root / f"{rb['name']}_release" / "config.json").read_text())
    assert rcfg["text_config"]["quantization_config"] == bcfg["text_config"]["quantization_config"]
    w(
        f"`{rq['name']}_release` and `{rb['name']}_release` record their quantization the way a "
        "compressed-tensors MXFP4 release checkpoint does: a compressed-tensors `quantization_config` (here "
        "inside `text_config`; mlx-lm's `load_model` looks at the top level first, then `text_config`), and no "
        "`quantization` key. Both carry the same one:\n"
    )
    w("```json\n\"quantization_config\": " + json.dumps(rcfg["text_config"]["quantization_config"], indent=4)
      + "\n```\n")
    w(
        "mlx-lm 0.32.2 reads only `quant_method` (`compressed-tensors`) and `format` (`mxfp4-pack-quantized` -> "
        "`{\"group_size\": 32, \"bits\": 4, \"mode\": \"mxfp4\"}`, which it stores as both `quantization` and "
        "`quantization_config` in the config it returns); `config_groups` and `ignore` are not read. It then "
        "quantizes exactly the modules whose sanitized weights include `<path>.scales`, each with "
        "`infer_quant_config`: group size = in_dims / scales' last dim, bits = 32 x packed last dim / in_dims, "
        "mode affine when the scales are not uint8 (float32 here), else mxfp4 for (4 bits, group 32). No "
        "per-path entries are needed, so the affine layers (4-bit group 32, the router 8-bit group 64) load "
        "alongside the MXFP4 experts. Without any quantization config, `load_model` would not quantize and "
        "would reject the `.scales` tensors.\n"
    )
    w(
        f"`{rb['name']}_release` is what that `ignore` list describes, the layout of the real release: only the "
        "routed experts are quantized (MXFP4), every other weight is bfloat16 (float32 `A_log`, `dt_bias`, "
        f"`e_score_correction_bias`). `{rq['name']}_release` packs the modules the list ignores as affine "
        "(mlx-lm does not read the list), to test that the loader infers their parameters. Release tensors:\n"
    )
    w(
        "- routed experts, per expert E and `w1` (gate) / `w2` (down) / `w3` (up): "
        "`...block_sparse_moe.experts.E.wN.weight_packed` uint8 [out, in/2] (two E2M1 codes a byte, low "
        "nibble first: the bytes of MLX's uint32 code words) and `...weight_scale` uint8 [out, in/32] (E8M0). "
        "Sanitize stacks them over E and views the codes as uint32 [E, out, in/8]; the scales stay uint8 "
        "[E, out, in/32].\n"
        "- `...self_attn.kv_b_proj.weight` (bfloat16) in the bfloat16 checkpoint; in the other, "
        "`...self_attn.kv_b_proj.{weight,scales,biases}`: affine 4-bit group 32 of the [H*(qk_nope+v_head), "
        "kv_lora_rank] matrix, grouped along kv_lora_rank. Sanitize infers bits = 32 x packed last dim / "
        "kv_lora_rank and group = kv_lora_rank / scales' last dim, dequantizes, splits per head into `embed_q` "
        "[H, kv_lora_rank, qk_nope] (transposed, so now grouped along qk_nope) and `unembed_out` [H, v_head, "
        "kv_lora_rank], and quantizes both again with the same bits and group size. The second quantization is "
        "not an identity for either half (`embed_q`'s groups run along another axis, and even `unembed_out`, "
        "grouped as before, lands on a different affine grid: its values move by up to ~6% of the largest "
        "here), so a loader must repeat it exactly.\n"
        "- every other module: bfloat16 `weight` in the bfloat16 checkpoint; in the other, affine `weight`/"
        "`scales`/`biases` under its release name (KDA `q/k/v_proj` triples are concatenated like the float "
        "ones).\n"
    )
    w("## Fixtures\n")
    for e in entries:
        f = e["features"]
        w(f"### `{e['name']}`\n")
        w(e["summary"] + ".\n")
        w(f"- config form: {e['config_form']}; names: {e['names']}"
          + (f"; derived from `{e['derived_from']}`" if e["derived_from"] else ""))
        w(f"- layers (0-based): KDA {f['kda_layers_0based']}, MLA {f['mla_layers_0based']}, MoE "
          f"{f['moe_layers_0based']}, dense MLP {f['dense_mlp_layers_0based']}")
        if e["quantization"]:
            qs = e["quantization"]
            kinds = "; ".join(json.dumps(k, sort_keys=True) for k in qs["override_kinds"])
            if qs["override_paths"]:
                w(f"- quantization: default {json.dumps(qs['default'])}, {qs['override_paths']} per-path "
                  f"overrides of kinds {kinds}")
            else:
                w(f"- quantization: default {json.dumps(qs['default'])}, no per-path overrides")
            if "module_kinds" in qs:
                w(f"- quantization as mlx-lm infers it per module (no config entries): "
                  + "; ".join(json.dumps(k) for k in qs["module_kinds"]))
        else:
            w(f"- quantization: none ({e['float_dtype']})")
        if e["names"] == "release":
            w(f"- {e['release_tensors']} release tensors; sanitize drops "
              + ", ".join(f"`{k}`" for k in e["release_dropped_tensors"]))
        c = e["checks"]
        w(f"- checks: prompt seed {c['prompt_seed']}, greedy top-2 gap >= {c['min_greedy_top2_gap']}, router "
          f"selection gap >= {c['min_router_selection_gap']}, {c['distinct_decode_tokens']} distinct decode "
          f"tokens\n")
    w("## Coverage\n")
    names = [e["name"] for e in entries if e["names"] == "mlx"]
    short = {n: n.split("_")[0] + ("-q4" if n.endswith("_q4") else "-mix" if "mixed" in n else "") for n in names}
    w("| feature | " + " | ".join(f"`{short[n]}`" for n in names) + " |")
    w("|---|" + "---|" * len(names))
    by = {e["name"]: e["features"] for e in entries}
    for label, fn in COVERAGE_ROWS:
        w(f"| {label} | " + " | ".join("x" if fn(by[n]) else "" for n in names) + " |")
    w(
        "\n(`d`'s release copy has `d`'s features, the quantized release checkpoints "
        + " and ".join(f"`{q['name']}_release`" for q in RELEASE_QUANTIZED)
        + " have `a`'s.) Every float fixture uses float32 weights; `a-q4` and `a-mix` are mlx-lm-quantized "
        f"copies of `a`; `{RELEASE_QUANTIZED[1]['name']}_release` holds `a`'s weights rounded to bfloat16.\n"
    )
    w("## What the generator checks\n")
    w(
        f"- Weights are seeded and scaled (linear weights ~N(0, 1/fan_in), norms 1 + 0.1 N(0,1), router bias "
        f"0.3 N(0,1), `A_log` = log U(1, 8), `dt_bias` ~ U(-3, 0), logits std ~2.5), so nothing explodes or "
        f"vanishes and greedy decoding moves (>= {MIN_DISTINCT_DECODE_TOKENS} distinct tokens in 16 steps).\n"
        f"- The prompt is the first seed whose every greedy step has a top-1/top-2 logit gap >= "
        f"{MIN_GREEDY_GAP} and whose every routing decision (top-k boundary, and group boundary when "
        f"grouped) has a score gap >= {MIN_ROUTER_GAP} (scores = sigmoid(gate) + e_score_correction_bias), so "
        "a correct reimplementation with fp32 rounding differences picks the same tokens and experts.\n"
        "- mlx-lm's cached prefill/decode agree with its cache-less forward.\n"
        "- The release copy, loaded through `mlx_lm.utils.load_model` (which runs `Model.sanitize`), gives "
        "bit-identical weights and logits.\n"
        f"- `{RELEASE_QUANTIZED[0]['name']}_release` loads through `load_model` to exactly the weights it was built from "
        "(MXFP4 experts, affine layers), except `embed_q`/`unembed_out`, which are sanitize's re-quantization of "
        "`kv_b_proj` (checked to be affine with the same bits and group size); every routed expert is mxfp4. "
        "What `mlx_lm.convert` would save from it (mlx names, `quantization` {group_size 32, bits 4, mode "
        "mxfp4} and no per-path entries) reloads to bit-identical weights and logits; that copy is not kept.\n"
        f"- `{RELEASE_QUANTIZED[1]['name']}_release` loads through `load_model` to exactly the weights it was "
        "built from (bfloat16, the float32 exceptions, MXFP4 experts); every quantized module is an mxfp4 "
        "routed expert stack. The same `mlx_lm.convert` round trip holds.\n"
    )
    w("## mlx-lm behaviour to match\n")
    w(
        "- Grouped top-k: the `n_group - topk_group` lowest groups (group score = sum of its top-2 biased "
        "scores) get score **0**, not -inf, so an expert of a dropped group can still win against negative "
        "biased scores; when that happens the pick among the tied zeros is implementation-defined, so these "
        "fixtures avoid it (`checks.router_picks_from_zeroed_groups` = 0 everywhere). Selection uses the "
        "biased scores, weights are the unbiased sigmoids (renormalized when `moe_renormalize` and k > 1), "
        "times `routed_scaling_factor`.\n"
        "- `quantize_model` quietly leaves float any layer whose input dim is not a multiple of the "
        "**top-level** group size, and records nothing for it (all quantizable dims here are multiples of 32, "
        "so it does not happen in these fixtures). A custom predicate replaces kimi_k3's own, which is why "
        "the mixed recipe excludes `*_res_proj` itself.\n"
        "- `embed_q` (H, kv_lora_rank, qk_nope) is quantized along qk_nope and used with `transpose=True` in "
        "decode and `transpose=False` in prefill; `unembed_out` is (H, v_head, kv_lora_rank).\n"
        "- The quantized tied embedding is also the head (`QuantizedEmbedding.as_linear`).\n"
        "- The fixtures were made on CPU: MLX's CPU quantizer rounds half-to-even where Metal rounds half "
        "away from zero, and KDA's compiled single-token decode and Metal kernels only run on Metal, so "
        "regenerating on a Mac can change bytes (not meaning).\n"
    )
    return "\n".join(L)


def main() -> None:
    # Build into a scratch folder first, then replace the fixture folders, manifest and README.
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        entries = build_all(tmp)
        manifest = {
            "generator": "scripts/make_k3_fixtures.py",
            "mlx": PINS["mlx"],
            "mlx_lm": PINS["mlx-lm"],
            "expected_keys": {
                "prompt": ["int32", [PROMPT_LEN]],
                "prefill_logits": ["float32", [PROMPT_LEN, VOCAB]],
                "decode_tokens": ["int32", [DECODE_STEPS]],
                "decode_logits": ["float32", [DECODE_STEPS, VOCAB]],
                "full_logits": ["float32", [PROMPT_LEN + DECODE_STEPS, VOCAB]],
                "prefill_logits_bf16": ["float32", [PROMPT_LEN, VOCAB]],
                "generate_tokens": ["int32", [GENERATE_TOKENS]],
            },
            "names_forms": {
                "mlx": "mlx-lm's sanitized names (language_model.model.layers.N.mlp.switch_mlp.gate_proj, "
                "self_attn.qkv_proj, self_attn.embed_q, ...), exactly what mlx_lm.utils.save_model writes",
                "release": "the original release names (block_sparse_moe.experts.E.w1, q/k/v_proj, "
                "q/k/v_conv1d, kv_b_proj, *_res.proj_weight, padded A_log, extra tensors to drop); "
                "mlx-lm's Model.sanitize maps them to the 'mlx' form. Quantized: routed experts as "
                "compressed-tensors MXFP4 (experts.E.wN.weight_packed uint8 / weight_scale uint8), kv_b_proj, "
                "where quantized, as an affine weight/scales/biases triple (sanitize re-quantizes "
                "embed_q/unembed_out)",
            },
            "fixtures": entries,
        }
        for e in entries:
            d = tmp / e["dir"]
            e["files"] = {p.name: sha256(p) for p in sorted(d.iterdir())}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "README.md").write_text(readme(entries, tmp))

        OUT.mkdir(parents=True, exist_ok=True)
        current = {e["dir"] for e in entries}
        for old in sorted(OUT.iterdir()):  # fixture folders from an earlier, different fixture list
            if old.is_dir() and old.name not in current and (old / "expected.safetensors").exists():
                shutil.rmtree(old)
        for e in entries:
            dst = OUT / e["dir"]
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(tmp / e["dir"], dst)
        shutil.copyfile(tmp / "manifest.json", OUT / "manifest.json")
        shutil.copyfile(tmp / "README.md", OUT / "README.md")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {len(entries)} fixtures to {OUT.relative_to(ROOT)} ({total / 1024:.0f} KiB in all)")


if __name__ == "__main__":
    main()
