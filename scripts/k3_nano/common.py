"""Shared settings of the k3-nano pipeline: paths, model config, tokenizer conventions, BLAS selection."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "models" / "k3-nano"

sys.path.insert(0, str(ROOT / "scripts"))
import pins  # noqa: E402

PINS = {"mlx": pins.MLX, "mlx-lm": pins.MLX_LM, "tiktoken": "0.14.0", "regex": "2026.11.19", "numpy": "2.4.6"}

# ---------------------------------------------------------------------------------------------------------
# Tokenizer (Kimi's tiktoken convention)
# ---------------------------------------------------------------------------------------------------------

# Kimi's pre-tokenization pattern, verbatim from Kimi's tokenization_kimi.py.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Base (byte-level BPE) vocabulary: 256 single bytes + merges. With Kimi's 256 + 2 special tokens on top the
# model's vocab_size is NUM_BASE_TOKENS + 258 = 2304 (a multiple of 64).
NUM_BASE_TOKENS = 2046
NUM_RESERVED_SPECIAL_TOKENS = 256
NUM_SPECIAL_TOKENS = NUM_RESERVED_SPECIAL_TOKENS + 2
VOCAB_SIZE = NUM_BASE_TOKENS + NUM_SPECIAL_TOKENS

# Named special tokens, at the same offsets from num_base_tokens as in Kimi K2's tokenizer_config.json
# (163584 + offset there); every other id in the special range is <|reserved_token_{id}|>.
SPECIAL_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}


def special_tokens(num_base: int = NUM_BASE_TOKENS) -> dict[str, int]:
    """name -> id for all 258 special tokens (Kimi's rule)."""
    return {
        SPECIAL_OFFSETS.get(i - num_base, f"<|reserved_token_{i}|>"): i
        for i in range(num_base, num_base + NUM_SPECIAL_TOKENS)
    }


# ---------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------

NUM_LAYERS = 6
KDA_LAYERS = [1, 2, 4, 5]  # 1-based, as in Kimi's config; the others (3, 6) are MLA

TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 384,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "linear_attn_config": {
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "kda_layers": KDA_LAYERS,
        "full_attn_layers": [i for i in range(1, NUM_LAYERS + 1) if i not in KDA_LAYERS],
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": False,
    },
    "hidden_act": "situ",
    "activation_situ_beta": 2.0,
    "activation_situ_linear_beta": 4.0,
    "attn_res_block_size": 2,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "routed_expert_hidden_size": 128,
    "latent_moe_use_norm": True,
    "tie_word_embeddings": True,
}


def model_config(text_config: dict | None = None) -> dict:
    """config.json: release-style nesting, as mlx-lm's kimi_k3 ModelArgs reads it."""
    return {"model_type": "kimi_k3", "text_config": dict(text_config or TEXT_CONFIG)}


# ---------------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------------

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
]


def maybe_reexec_with_openblas() -> str:
    """The Linux mlx-cpu wheel links the reference (netlib) BLAS: sgemm ran ~25x slower than OpenBLAS on
    the 2-core dev machine. If Debian's OpenBLAS is installed (`apt-get install libopenblas0-pthread`), re-run
    this process with it preloaded (single-threaded, so results are deterministic). Set K3_NANO_BLAS=reference
    to keep the wheel's BLAS. Returns a description of the BLAS in use."""
    if sys.platform != "linux" or os.environ.get("K3_NANO_BLAS") == "reference":
        return "wheel default"
    pre = os.environ.get("LD_PRELOAD", "")
    for lib in OPENBLAS_CANDIDATES:
        if lib in pre:
            return f"OpenBLAS ({lib}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')})"
    for lib in OPENBLAS_CANDIDATES:
        if os.path.exists(lib):
            env = dict(os.environ)
            env["LD_PRELOAD"] = (lib + " " + pre).strip()
            env["OPENBLAS_NUM_THREADS"] = "1"
            os.execve(sys.executable, [sys.executable] + sys.argv, env)
    return "wheel default (reference BLAS; install libopenblas0-pthread for a ~5x faster run)"


def check_pins() -> None:
    bad = pins.missing(PINS)
    if bad:
        sys.exit(
            "k3_nano needs exactly " + ", ".join(bad) + ".\nInstall: .venv/bin/pip install -r "
            "scripts/k3_nano/requirements.txt"
        )
