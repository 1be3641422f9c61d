"""Build the tiny Kimi K3 vision fixture with mlx-vlm's own `kimi_k3` model (the `moonvit3d` tower, the
`patchmergerv2` projector and the K3 text model).

The Rust tower in `mlx-k3/src/model/vision/moonvit3d.rs` and the multimodal prompt path (tower -> projector
-> `merge_features` -> `KimiK3::forward_embeddings`) are checked against mlx-vlm 0.7.10's
`mlx_vlm/models/kimi_k3/` (`vision.py`, `kimi_k3.py`). This script builds a tiny random `kimi_k3`
checkpoint (text: vocab 256, hidden 32, one KDA and one MLA layer, a MoE layer with a shared expert,
attention residuals; vision: hidden 32, qkv width 48 in 2 heads, 2 blocks, patch 14, a learnable 8x8
position grid, 2x2 merge), saves it as mlx-vlm saves a model, reloads it through `mlx_vlm.utils.load_model`
and records what mlx-vlm computes.

Output, under `mlx-k3/tests/fixtures/vision_k3/`:

    config.json                 {model_type: kimi_k3, text_config, vision_config, media_placeholder_token_id}
    model.safetensors           float32 weights under mlx-vlm's names (`language_model.*`, `vision_tower.*`,
                                `mm_projector.*`; the patch-embedding conv in MLX's [out, kh, kw, in] layout)
    expected.safetensors        the inputs and mlx-vlm's outputs (below)
    README.md                   this summary, with the grids and the checks' margins

expected.safetensors:
    pixel_values      float32 [P, 3, 14, 14]  random inputs (as the processor hands them over: N patches, channels
                                              first) for the grids below, one after another
    grids             int32   [G, 3]          (t, h, w) in patches per image / video: (1, 2, 4) an image below the
                                              position grid, (1, 4, 10) an image crossing it (rows shrink, columns
                                              grow), (3, 2, 4) a 3-frame video (time embedding, temporal mean)
    features_image    float32 [2, 32]         projector output for the first image alone
    features_images   float32 [12, 32]        for the first two grids in one call
    features_video    float32 [2, 32]         for the video alone
    features_all      float32 [14, 32]        for all three in one call
    features_all_bf16w float32 [14, 32]       the same with the tower's and projector's weights rounded to
                                              bfloat16 (as the release stores them; float32 activations)
    tower_all         float32 [14, 4, 32]     the tower's merged patches (before the projector), all three
    prompt            int32   [T]             text tokens with each grid's placeholders expanded in place
                                              (media_placeholder_token_id, one per merged patch)
    prefill_logits    float32 [T, 256]        mlx-vlm's `Model(input_ids, pixel_values, grid_thws=...)`, fresh cache
    decode_tokens     int32   [N]             tokens fed to N one-token decode steps: [0] = argmax of the last
                                              prefill row, [i] = argmax(decode_logits[i-1])
    decode_logits     float32 [N, 256]        the language model's logits after each decode token (same cache)

(mlx-vlm's loader reads every `*.safetensors` of a folder, so to load this one with mlx-vlm again, copy
config.json and model.safetensors elsewhere first; mlx-k3 reads `model*.safetensors` as mlx-lm does.)

Checks before writing: every greedy step's top-1/top-2 gap and every routing decision's top-k gap are far
above fp32 noise, the mixed call's features equal the single calls' (each image is encoded alone), and a
copy with the patch-embedding conv in the release's PyTorch layout [out, in, kh, kw] loads through mlx-vlm's
sanitize to identical features (that copy is not kept; the Rust test makes the same one).

Run (CPU, a few seconds; byte-identical from run to run) with a virtualenv holding the pins (mlx, mlx-lm and
mlx-vlm of `mlx-k3-py/python/mlx_k3/_pins.py`), kept apart from the project's `.venv`, since mlx-vlm pulls in
transformers and an image stack:

    python3 -m venv /tmp/vlm-venv
    /tmp/vlm-venv/bin/pip install mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 mlx-vlm==0.7.10
    /tmp/vlm-venv/bin/python scripts/make_vision_k3_fixtures.py
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pins  # noqa: E402

PINS = {"mlx": pins.MLX, "mlx-lm": pins.MLX_LM, "mlx-vlm": pins.MLX_VLM}


def _check_pins() -> None:
    bad = pins.missing(PINS)
    if bad:
        sys.exit(
            "make_vision_k3_fixtures.py needs exactly " + ", ".join(bad) + ".\n"
            "Make a separate venv for it (see this script's docstring): python3 -m venv /tmp/vlm-venv && "
            "/tmp/vlm-venv/bin/pip install mlx-cpu==" + PINS["mlx"] + " "
            + " ".join(f"{d}=={v}" for d, v in PINS.items())
        )


_check_pins()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_vlm.models.kimi_k3 import language as k3_language  # noqa: E402
from mlx_vlm.models.kimi_k3 import Model, ModelConfig, TextConfig, VisionConfig  # noqa: E402
from mlx_vlm.utils import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "mlx-k3" / "tests" / "fixtures" / "vision_k3"

VOCAB = 256
PLACEHOLDER = 250
SEED = 5005
DECODE_STEPS = 8
GRIDS = [(1, 2, 4), (1, 4, 10), (3, 2, 4)]
# A correct reimplementation differs from mlx-vlm by fp32 rounding (~1e-6 relative); these gaps keep greedy
# tokens and routed experts identical regardless.
MIN_GREEDY_GAP = 2e-3
MIN_ROUTER_GAP = 2e-4
MAX_PROMPT_TRIES = 64

TEXT = {
    "model_type": "kimi_linear",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "hidden_act": "situ",
    "activation_situ_beta": 2.0,
    "activation_situ_linear_beta": 1.5,
    "attn_res_block_size": 2,
    "linear_attn_config": {
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
        "kda_layers": [1],
        "full_attn_layers": [2],
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": False,
    },
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 16,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "routed_expert_hidden_size": None,
    "latent_moe_use_norm": False,
    "tie_word_embeddings": True,
}

VISION = {
    "model_type": "moonvit3d",
    "patch_size": 14,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "pos_emb_interpolation_mode": "bilinear",
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 2,
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "qkv_hidden_size": 48,
    "norm_type": "rmsnorm",
    "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "mm_hidden_size": 32,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "text_hidden_size": 32,
}

CONFIG = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "media_placeholder_token_id": PLACEHOLDER,
    "text_config": TEXT,
    "vision_config": VISION,
    "tie_word_embeddings": True,
    "vocab_size": VOCAB,
}


def merged_tokens(grid) -> int:
    _, h, w = grid
    return (h // 2) * (w // 2)


def init_weights(model) -> None:
    """Seeded, well-scaled random weights: linear and conv weights ~N(0, 1/fan_in), norms 1 + 0.1 N(0, 1),
    the position grid 0.5 N(0, 1), embeddings 0.3 N(0, 1), KDA's A_log = log U(1, 8), dt_bias ~ U(-3, 0),
    the router bias 0.3 N(0, 1) and its weight scaled for sigmoid inputs of std ~1.5."""
    heads = TEXT["linear_attn_config"]["num_heads"]
    mx.random.seed(SEED)
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
        elif "norm" in owner:
            v = 1.0 + 0.1 * mx.random.normal(shape)
        elif path.endswith("pos_emb.weight"):
            v = 0.5 * mx.random.normal(shape)
        elif path.endswith("patch_embed.proj.weight"):  # (out, kh, kw, in)
            v = mx.random.normal(shape) * (1.0 / np.sqrt(np.prod(shape[1:])))
        elif path.endswith("conv.weight"):  # depthwise (C, K, 1)
            v = mx.random.normal(shape) * (1.0 / np.sqrt(shape[1]))
        elif path.endswith("embed_tokens.weight"):
            v = 0.3 * mx.random.normal(shape)
        elif path.endswith("res_proj.weight"):
            v = mx.random.normal(shape) * (1.5 / np.sqrt(shape[-1]))
        elif path.endswith(("embed_q.weight", "unembed_out.weight")):
            v = mx.random.normal(shape) * (1.0 / np.sqrt(TEXT["kv_lora_rank"]))
        elif path.endswith("mlp.gate.weight"):
            v = mx.random.normal(shape) * (1.5 / np.sqrt(shape[-1]))
        else:
            assert path.endswith(".weight") and len(shape) in (2, 3), path
            v = mx.random.normal(shape) * (1.0 / np.sqrt(shape[-1]))
        new.append((path, v.astype(mx.float32)))
    model.load_weights(new, strict=True)
    mx.eval(model.parameters())


def top_gap(row: np.ndarray) -> float:
    s = np.sort(row.astype(np.float64))
    return float(s[-1] - s[-2])


class RouterProbe:
    """Wraps mlx-vlm's `group_expert_select` to record the top-k selection gap of every routing decision."""

    def __init__(self):
        self.gaps = []
        self._orig = k3_language.group_expert_select

    def __enter__(self):
        def probe(gates, bias, top_k, n_group, topk_group, scale, renorm):
            assert n_group == 1
            s = np.array(mx.sigmoid(gates.astype(mx.float32)) + bias.astype(mx.float32))
            s = -np.sort(-s.reshape(-1, s.shape[-1]), axis=-1)
            self.gaps.append(float((s[:, top_k - 1] - s[:, top_k]).min()))
            return self._orig(gates, bias, top_k, n_group, topk_group, scale, renorm)

        k3_language.group_expert_select = probe
        return self

    def __exit__(self, *exc):
        k3_language.group_expert_select = self._orig


def features(model, pixels: np.ndarray, grids) -> tuple[np.ndarray, np.ndarray]:
    """(projector output, tower output) of mlx-vlm for the patches of `grids`, as `get_input_embeddings` runs
    them (pixel_values [N, 3, p, p] -> channels last -> tower -> projector)."""
    tower = model.vision_tower(mx.array(pixels).transpose(0, 2, 3, 1), grid_thws=mx.array(grids))
    proj = model.mm_projector(tower)
    mx.eval(tower, proj)
    return np.array(proj), np.array(tower)


def make_prompt(rng) -> np.ndarray:
    """Random text tokens (never the placeholder) around each grid's expanded placeholders."""
    parts = []
    for g in GRIDS:
        parts.append(rng.integers(0, PLACEHOLDER, size=int(rng.integers(2, 5))))
        parts.append(np.full(merged_tokens(g), PLACEHOLDER))
    parts.append(rng.integers(0, PLACEHOLDER, size=3))
    return np.concatenate(parts).astype(np.int32)


def run_prompt(model, prompt: np.ndarray, pixels: np.ndarray) -> dict:
    cache = model.make_cache()
    out = model(mx.array(prompt[None]), mx.array(pixels), cache=cache, grid_thws=mx.array(GRIDS))
    prefill = np.array(out.logits[0])
    tok = int(np.argmax(prefill[-1]))
    gaps = [top_gap(prefill[-1])]
    fed, dec = [], []
    for _ in range(DECODE_STEPS):
        fed.append(tok)
        row = model.language_model(mx.array([[tok]], dtype=mx.int32), cache=cache).logits[0, -1]
        row = np.array(row)
        dec.append(row)
        gaps.append(top_gap(row))
        tok = int(np.argmax(row))
    return {
        "prefill_logits": prefill.astype(np.float32),
        "decode_tokens": np.array(fed, dtype=np.int32),
        "decode_logits": np.stack(dec).astype(np.float32),
        "_greedy_gap": min(gaps),
    }


def write_checkpoint(path: Path, weights: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(sorted(weights.items())), metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")


def build(tmp: Path) -> dict:
    config = ModelConfig(
        text_config=TextConfig.from_dict(copy.deepcopy(TEXT)),
        vision_config=VisionConfig.from_dict(copy.deepcopy(VISION)),
        media_placeholder_token_id=PLACEHOLDER,
    )
    model = Model(config)
    init_weights(model)
    weights = dict(tree_flatten(model.parameters()))
    ckpt = tmp / "vision_k3"
    write_checkpoint(ckpt, weights)

    # The reference is what mlx-vlm's own loader makes of the saved folder.
    model = load_model(ckpt)
    loaded = dict(tree_flatten(model.parameters()))
    assert loaded.keys() == weights.keys()
    assert all(np.array_equal(np.array(loaded[k]), np.array(weights[k])) for k in weights)

    rng = np.random.default_rng(SEED)
    patches = sum(t * h * w for t, h, w in GRIDS)
    pixels = rng.uniform(-1.0, 1.0, size=(patches, 3, 14, 14)).astype(np.float32)
    n0 = GRIDS[0][0] * GRIDS[0][1] * GRIDS[0][2]
    n1 = n0 + GRIDS[1][0] * GRIDS[1][1] * GRIDS[1][2]
    f_all, t_all = features(model, pixels, GRIDS)
    f_image, _ = features(model, pixels[:n0], GRIDS[:1])
    f_images, _ = features(model, pixels[:n1], GRIDS[:2])
    f_video, _ = features(model, pixels[n1:], GRIDS[2:])
    # Each grid is encoded alone, so the mixed call is the single calls stacked (up to matmul blocking).
    stacked = np.concatenate([f_images, f_video])
    assert np.abs(stacked - f_all).max() <= 1e-5 * np.abs(f_all).max(), np.abs(stacked - f_all).max()
    assert np.abs(f_images[: len(f_image)] - f_image).max() <= 1e-5 * np.abs(f_image).max()

    # The release stores the tower in bfloat16: with its weights rounded so, and float32 pixels, mlx-vlm still
    # computes in float32 (MLX promotes the mixed matmuls and norms), as the Rust tower does.
    bf16 = load_model(ckpt)
    for part in (bf16.vision_tower, bf16.mm_projector):
        part.update(tree_map(lambda a: a.astype(mx.bfloat16), part.parameters()))
    f_bf16w, _ = features(bf16, pixels, GRIDS)
    assert f_bf16w.dtype == np.float32
    bf16_shift = float(np.abs(f_bf16w - f_all).max() / np.abs(f_all).max())
    assert bf16_shift > 1e-3, bf16_shift  # far above the 1e-4 parity bound: the test sees the rounding

    # The release layout of the patch embedding (PyTorch's conv [out, in, kh, kw]) loads to the same tower.
    release = dict(weights)
    release["vision_tower.patch_embed.proj.weight"] = weights["vision_tower.patch_embed.proj.weight"].transpose(
        0, 3, 1, 2
    )
    write_checkpoint(tmp / "release", release)
    r_all, _ = features(load_model(tmp / "release"), pixels, GRIDS)
    assert np.array_equal(r_all, f_all), "release conv layout loads differently"
    shutil.rmtree(tmp / "release")

    for attempt in range(MAX_PROMPT_TRIES):
        prompt = make_prompt(np.random.default_rng(SEED + 1 + attempt))
        with RouterProbe() as probe:
            exp = run_prompt(model, prompt, pixels)
        router_gap = min(probe.gaps)
        if exp["_greedy_gap"] >= MIN_GREEDY_GAP and router_gap >= MIN_ROUTER_GAP:
            break
    else:
        raise RuntimeError(f"no robust prompt in {MAX_PROMPT_TRIES} tries")
    assert len(set(exp["decode_tokens"].tolist())) >= 3, exp["decode_tokens"]

    arrays = {
        "pixel_values": pixels,
        "grids": np.array(GRIDS, dtype=np.int32),
        "features_image": f_image,
        "features_images": f_images,
        "features_video": f_video,
        "features_all": f_all,
        "features_all_bf16w": f_bf16w,
        "tower_all": t_all,
        "prompt": prompt,
    }
    arrays.update({k: v for k, v in exp.items() if not k.startswith("_")})
    meta = {
        "generator": "scripts/make_vision_k3_fixtures.py",
        "mlx": PINS["mlx"],
        "mlx_lm": PINS["mlx-lm"],
        "mlx_vlm": PINS["mlx-vlm"],
        "prompt_seed": str(SEED + 1 + attempt),
    }
    mx.save_safetensors(
        str(ckpt / "expected.safetensors"), {k: mx.array(v) for k, v in sorted(arrays.items())}, metadata=meta
    )
    return {
        "prompt_seed": SEED + 1 + attempt,
        "prompt_tokens": len(prompt),
        "min_greedy_gap": round(exp["_greedy_gap"], 5),
        "min_router_gap": round(router_gap, 5),
        "features_std": round(float(f_all.std()), 4),
        "bf16_weights_shift": round(bf16_shift, 5),
        "logits_std": round(float(exp["prefill_logits"].std()), 4),
        "decode_tokens": exp["decode_tokens"].tolist(),
    }


def readme(stats: dict) -> str:
    doc = __doc__.split("\n\nRun")[0]
    return (
        "# vision_k3: Kimi K3's vision tower against mlx-vlm " + PINS["mlx-vlm"] + "\n\n"
        "Written by `scripts/make_vision_k3_fixtures.py`; do not edit.\n\n```text\n" + doc + "\n```\n\n"
        "This build: " + json.dumps(stats, sort_keys=True) + "\n"
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        stats = build(tmp)
        (tmp / "vision_k3" / "README.md").write_text(readme(stats))
        if OUT.exists():
            shutil.rmtree(OUT)
        shutil.copytree(tmp / "vision_k3", OUT)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT.relative_to(ROOT)} ({total / 1024:.0f} KiB): {stats}")


if __name__ == "__main__":
    main()
