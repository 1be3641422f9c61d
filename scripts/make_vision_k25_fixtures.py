"""Build tiny Kimi K2.5/K2.7 vision reference fixtures with mlx-vlm's own `kimi_k25` model (MoonViT).

The Rust MoonViT tower (`mlx-k3/src/model/vision/moonvit.rs`: patch embedding, the learnable 2-D position
embedding resized bicubically to each grid plus the sin-cos temporal embedding of video chunks, 2-D RoPE,
attention within each image / video chunk, the final LayerNorm, `sd2_tpool` temporal mean pooling and 2x2
patch merging, then the `mm_projector`) is checked against mlx-vlm 0.7.10's `mlx_vlm/models/kimi_k25/`
(`vision.py`, `kimi_k25.py`). The checkpoint is a tiny random `kimi_k25` configuration: the DeepSeek-V3
text model of `make_deepseek_v3_fixtures.py`'s `c_kimi_k25` (vocab 128, hidden 32, 2 layers, 8 experts,
Kimi K2's YaRN) and a tiny vision config (width 16, 2 heads of 8, 2 blocks, patch 14, an 8x8 position
table, 2x2 merge). Weights are seeded well-scaled random f32, saved with mlx-vlm's names and reloaded with
mlx-vlm's `load_model`.

Output, under `mlx-k3/tests/fixtures/vision_k25/`:

    model/config.json, model.safetensors   the checkpoint (mlx-vlm's sanitized names)
    release/config.json, model.safetensors the vision tower and projector only, under the release names
                                           (`vision_tower.encoder.*`, `blocks.N.wqkv` / `wo` without `attn.`,
                                           the patch embedding's conv weight in PyTorch's [out, in, kh, kw]
                                           layout), which mlx-vlm's sanitize maps to the same tensors (checked)
    q8/config.json, model.safetensors      a width-32 tower and projector whose Linears mlx-vlm quantized to
                                           affine 8-bit (group 32), tower tensors only
    expected.safetensors                   per case (image, two_images, video):
        <case>.pixel_values  float32 [N, 3, 14, 14]  random patches in [-1, 1]
        <case>.grids         int32   [G, 2] image grids (h, w), or [G, 3] video chunks (t, h, w)
        <case>.features      float32 [tokens, 32]   mm_projector(vision_tower(pixels)), concatenated
        <case>.prompt        int32   [T]     token ids, the placeholders (id 127) expanded to the features
        <case>.prefill_logits float32 [T, 128] mlx-vlm's Model(prompt, pixels) with a fresh cache
        <case>.decode_tokens int32   [N]     tokens fed to N greedy decode steps ([0] = argmax of the last
                                             prefill row, [i] = argmax(decode_logits[i-1]))
        <case>.decode_logits float32 [N, 128] logits after each decode step (language model + cache)
        q8.<case>.features   float32 [tokens, 32]   the same pixels through the q8 tower (mlx-vlm's load_model)
    manifest.json                          the cases, their grids, token counts and robustness checks

Cases: `image` one image, grid 4x6 (the position table resized down in both axes); `two_images` that image
and a 2x10 one (resized down and up) in one call (attention stays within each image); `video` one chunk of
3 frames at 2x4 (temporal embedding, 3-frame mean pooling).

Before writing, the script checks: mlx-vlm reloads the checkpoint to the same weights, the release-named
tower sanitizes to bit-identical tensors, mlx-vlm's language model matches mlx-lm's `kimi_k25` on a text
prompt (the Rust text model is checked against mlx-lm), the cached decode matches a cache-less forward, and
every greedy top-1/top-2 gap is >= 2e-3 and every router selection gap >= 2e-4 (far above fp32 noise).

Run (CPU, a few seconds; byte-identical from run to run) with a venv holding the pinned mlx, mlx-lm and
mlx-vlm (the project .venv has them too, from mlx-k3-py/requirements-dev.txt; mlx-vlm keeps its pins):

    python3 -m venv /tmp/vlm-venv
    /tmp/vlm-venv/bin/pip install mlx==0.32.4 mlx-lm==0.32.2 mlx-vlm==0.7.10  # mlx[cpu] on Linux
    /tmp/vlm-venv/bin/python scripts/make_vision_k25_fixtures.py
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

PINS = {"mlx": pins.MLX, "mlx-lm": pins.MLX_LM, "mlx-vlm": pins.MLX_VLM}


def _check_pins() -> None:
    bad = pins.missing(PINS)
    if bad:
        sys.exit("make_vision_k25_fixtures.py needs exactly " + ", ".join(bad) + " (see the docstring).")


_check_pins()

import make_deepseek_v3_fixtures as dsv3  # noqa: E402
import make_k3_fixtures as k3  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import kimi_k25 as lm_kimi_k25  # noqa: E402
from mlx_vlm.models import kimi_k25  # noqa: E402
from mlx_vlm.models.cache import KVCache  # noqa: E402
from mlx_vlm.models.deepseek_v3 import language as vlm_dsv3  # noqa: E402
from mlx_vlm.quant_utils import quantize_model  # noqa: E402
from mlx_vlm.utils import load_model  # noqa: E402

ROOT = k3.ROOT
OUT = ROOT / "mlx-k3" / "tests" / "fixtures" / "vision_k25"
SEED = 25
VOCAB = dsv3.VOCAB
PLACEHOLDER = VOCAB - 1
PATCH = 14
DECODE_STEPS = 8
MIN_GREEDY_GAP = k3.MIN_GREEDY_GAP
MIN_ROUTER_GAP = k3.MIN_ROUTER_GAP
MAX_TRIES = 64

VISION = {
    "model_type": "moonvit",
    "depth": 2,
    "embed_dim": 16,
    "hidden_size": 16,
    "num_heads": 2,
    "patch_size": PATCH,
    "intermediate_size": 32,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "merge_kernel_size": [2, 2],
}

# (name, grids as mlx-vlm takes them: (h, w) per image or (t, h, w) per video chunk, grid key)
CASES = [
    ("image", [[4, 6]], "image_grid_hws"),
    ("two_images", [[4, 6], [2, 10]], "image_grid_hws"),
    ("video", [[3, 2, 4]], "video_grid_hws"),
]


# The 8-bit fixture's tower: MLX's affine groups (32) must divide every Linear's inputs.
VISION_Q8 = {**VISION, "embed_dim": 32, "hidden_size": 32, "intermediate_size": 64}
Q8_SEED = 26


def make_config(vision: dict = VISION) -> dict:
    c = next(f for f in dsv3.FIXTURES if f["name"] == "c_kimi_k25")
    text = {**copy.deepcopy(dsv3.BASE), **copy.deepcopy(c["text"]), "model_type": "deepseek_v3"}
    return {
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": copy.deepcopy(vision),
        "media_placeholder_token_id": PLACEHOLDER,
        "tie_word_embeddings": False,
    }


def build_model(config: dict):
    mc = kimi_k25.ModelConfig.from_dict(copy.deepcopy(config))
    mc.text_config = kimi_k25.TextConfig.from_dict(config["text_config"])
    mc.vision_config = kimi_k25.VisionConfig.from_dict(config["vision_config"])
    mc.__post_init__()
    return kimi_k25.Model(mc)


def init_weights(model, t: dict) -> None:
    """Text weights as make_deepseek_v3_fixtures.py draws them; vision weights 1/sqrt(fan_in) normal,
    LayerNorm scales 1 + 0.1 N, biases 0.1 N, the position table 0.5 N (so its resizing shows)."""
    new = []
    for path, w in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        shape = w.shape
        if path.startswith("language_model."):
            continue
        if path.endswith("pos_emb.weight"):
            v = 0.5 * mx.random.normal(shape)
        elif path.endswith(".bias"):
            v = 0.1 * mx.random.normal(shape)
        elif "norm" in path:
            v = 1.0 + 0.1 * mx.random.normal(shape)
        elif path.endswith("patch_embed.proj.weight"):  # [out, kh, kw, in]
            v = mx.random.normal(shape) * (1.0 / np.sqrt(np.prod(shape[1:])))
        else:
            assert path.endswith(".weight") and len(shape) == 2, path
            v = mx.random.normal(shape) * (1.0 / np.sqrt(shape[-1]))
        new.append((path, v.astype(mx.float32)))
    model.load_weights(new, strict=False)
    dsv3.init_weights(model.language_model, t)
    mx.eval(model.parameters())


def write_checkpoint(d: Path, model, config: dict) -> None:
    d.mkdir(parents=True)
    weights = dict(sorted(tree_flatten(model.parameters())))
    mx.save_safetensors(str(d / "model.safetensors"), weights, metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def to_release(weights: dict) -> dict:
    """Inverse of mlx-vlm's kimi_k25 sanitize for the tower and projector: `vision_tower.encoder.` for the
    blocks and final LayerNorm, `wqkv` / `wo` on the block itself, and the conv weight as [out, in, kh, kw]."""
    out = {}
    for k, v in weights.items():
        if k.startswith("mm_projector."):
            out[k] = v
        elif not k.startswith("vision_tower."):
            continue
        elif k.endswith("patch_embed.proj.weight"):
            out[k] = mx.contiguous(v.transpose(0, 3, 1, 2))
        elif k.startswith(("vision_tower.blocks.", "vision_tower.final_layernorm.")):
            out[k.replace("vision_tower.", "vision_tower.encoder.", 1).replace(".attn.", ".")] = v
        else:
            out[k] = v
    return out


def check_release(weights: dict, release: dict, config: dict) -> None:
    mc = build_model(config).config
    got = kimi_k25.Model.sanitize(None, dict(release))
    got = kimi_k25.VisionModel(mc.vision_config).sanitize(got)
    want = {k: v for k, v in weights.items() if k.startswith(("vision_tower.", "mm_projector."))}
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for k in want:
        assert np.array_equal(np.array(got[k]), np.array(want[k])), k


class RouterProbe(k3.RouterProbe):
    """make_k3_fixtures' probe around mlx-vlm's deepseek_v3 group_expert_select (same selection rule)."""

    def __init__(self):
        self.records = []
        self._orig = vlm_dsv3.group_expert_select

    def __enter__(self):
        def probe(gates, bias, top_k, n_group, topk_group, scale, renorm):
            inds, w = self._orig(gates, bias, top_k, n_group, topk_group, scale, renorm)
            mx.eval(inds, w)
            self.records.append(
                (np.array(gates.astype(mx.float32)), np.array(bias), top_k, n_group, topk_group, np.array(inds))
            )
            return inds, w

        vlm_dsv3.group_expert_select = probe
        return self

    def __exit__(self, *exc):
        vlm_dsv3.group_expert_select = self._orig


def check_text_against_mlx_lm(model, d: Path) -> float:
    """mlx-vlm's kimi_k25 language model and mlx-lm's on the same weights give the same text logits."""
    lm = lm_kimi_k25.Model(lm_kimi_k25.ModelArgs.from_dict(json.loads((d / "config.json").read_text())))
    w = mx.load(str(d / "model.safetensors"))
    w = {k: v for k, v in w.items() if k.startswith("language_model.")}
    lm.load_weights(list(lm.sanitize(w).items()), strict=True)
    prompt = mx.array(np.random.default_rng(7).integers(0, PLACEHOLDER, size=12).astype(np.int32))[None]
    a = np.array(model.language_model(prompt).logits)
    b = np.array(lm(prompt))
    err = float(np.abs(a - b).max() / np.abs(b).max())
    assert err <= 1e-5, f"mlx-vlm's and mlx-lm's kimi_k25 text logits differ: {err}"
    return err


def vision_only(weights: dict) -> dict:
    return {k: v for k, v in sorted(weights.items()) if k.startswith(("vision_tower.", "mm_projector."))}


def build_q8(out: Path, inputs: dict) -> tuple[dict, dict]:
    """`q8/`: a width-32 tower whose Linears (blocks and projector) mlx-vlm quantized to affine 8-bit, group
    32; the text model stays float. Its features for every case, from mlx-vlm's load_model of the
    quantized checkpoint. Only the tower's tensors are kept in the folder (the text model is the float one's
    shape and not what this fixture checks)."""
    config = make_config(VISION_Q8)
    mx.random.seed(Q8_SEED)
    model = build_model(config)
    init_weights(model, config["text_config"])
    is_tower = lambda path, module: path.startswith(("vision_tower.", "mm_projector."))  # noqa: E731
    model, qconfig = quantize_model(model, config, 32, 8, mode="affine", quant_predicate=is_tower)
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "q8"
        write_checkpoint(full, model, qconfig)
        ref = load_model(full)
        kinds = sorted({type(m).__name__ for p, m in ref.named_modules() if is_tower(p, m)})
        assert "QuantizedLinear" in kinds, kinds
        n_quant = sum(1 for p, m in ref.named_modules() if is_tower(p, m) and type(m).__name__ == "QuantizedLinear")
        feats = {}
        for name, grids, _ in CASES:
            g = mx.array(grids, dtype=mx.int32)
            f = ref.mm_projector(ref.vision_tower(mx.array(inputs[name]).transpose(0, 2, 3, 1), grid_thw=g))
            feats[f"q8.{name}.features"] = np.array(mx.concatenate(f, axis=0)).astype(np.float32)
        qdir = out / "q8"
        qdir.mkdir()
        shutil.copyfile(full / "config.json", qdir / "config.json")
        tower = vision_only(mx.load(str(full / "model.safetensors")))
        mx.save_safetensors(str(qdir / "model.safetensors"), tower, metadata={"format": "mlx"})
    return feats, {"quantized_linears": n_quant, "quantization": qconfig["quantization"]}


def pixels(rng, n: int) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, size=(n, 3, PATCH, PATCH)).astype(np.float32)


def tokens_of(grid: list) -> int:
    t, h, w = grid if len(grid) == 3 else (1, *grid)
    return (h // 2) * (w // 2)


def run_case(model, pv: np.ndarray, grids: list, key: str, prompt: np.ndarray) -> dict:
    g = mx.array(grids, dtype=mx.int32)
    cache = [KVCache() for _ in model.language_model.layers]
    kw = {key: g}
    prefill = model(mx.array(prompt[None]), mx.array(pv), cache=cache, **kw).logits[0]
    mx.eval(prefill)
    prefill = np.array(prefill)
    gaps = [k3.top_gap(prefill[-1])]
    tok = int(np.argmax(prefill[-1]))
    fed, dec = [], []
    for _ in range(DECODE_STEPS):
        fed.append(tok)
        out = model.language_model(mx.array([[tok]], dtype=mx.int32), cache=cache).logits[0, -1]
        mx.eval(out)
        out = np.array(out)
        dec.append(out)
        gaps.append(k3.top_gap(out))
        tok = int(np.argmax(out))
    # The cache-less forward of prompt + decode tokens agrees with the cached steps.
    seq = np.concatenate([prompt, np.array(fed, dtype=np.int32)])
    full = np.array(model(mx.array(seq[None]), mx.array(pv), **kw).logits[0])
    dec = np.stack(dec)
    scale = np.abs(full).max()
    d = max(np.abs(full[: len(prompt)] - prefill).max(), np.abs(full[len(prompt):] - dec).max())
    assert d <= 1e-4 * max(1.0, scale), ("cached vs full", d, scale)
    return {
        "prompt": prompt.astype(np.int32),
        "prefill_logits": prefill.astype(np.float32),
        "decode_tokens": np.array(fed, dtype=np.int32),
        "decode_logits": dec.astype(np.float32),
        "_gap": min(gaps),
        "_cached_vs_full": float(d),
    }


def build(out: Path) -> dict:
    config = make_config()
    mx.random.seed(SEED)
    model = build_model(config)
    init_weights(model, config["text_config"])
    mdir = out / "model"
    write_checkpoint(mdir, model, config)
    weights = mx.load(str(mdir / "model.safetensors"))

    ref = load_model(mdir)
    a, b = dict(tree_flatten(model.parameters())), dict(tree_flatten(ref.parameters()))
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert np.array_equal(np.array(a[k]), np.array(b[k])), k
    del model
    text_err = check_text_against_mlx_lm(ref, mdir)

    release = to_release(weights)
    check_release(weights, release, config)
    rdir = out / "release"
    rdir.mkdir()
    mx.save_safetensors(str(rdir / "model.safetensors"), dict(sorted(release.items())), metadata={"format": "pt"})
    shutil.copyfile(mdir / "config.json", rdir / "config.json")

    rng = np.random.default_rng(SEED)
    pv_a, pv_b, pv_v = pixels(rng, 24), pixels(rng, 20), pixels(rng, 24)
    inputs = {"image": pv_a, "two_images": np.concatenate([pv_a, pv_b]), "video": pv_v}
    expected, cases = {}, []
    for name, grids, key in CASES:
        pv = inputs[name]
        g = mx.array(grids, dtype=mx.int32)
        feats = ref.mm_projector(ref.vision_tower(mx.array(pv).transpose(0, 2, 3, 1), grid_thw=g))
        feats = np.array(mx.concatenate(feats, axis=0))
        n_feat = sum(tokens_of(x) for x in grids)
        assert feats.shape == (n_feat, config["text_config"]["hidden_size"]), feats.shape
        for attempt in range(MAX_TRIES):
            prng = np.random.default_rng(SEED * 100 + attempt + len(cases) * 1000)
            pieces = []
            for x in grids:
                pieces.append(prng.integers(0, PLACEHOLDER, size=3))
                pieces.append(np.full(tokens_of(x), PLACEHOLDER))
            pieces.append(prng.integers(0, PLACEHOLDER, size=3))
            prompt = np.concatenate(pieces).astype(np.int32)
            with RouterProbe() as probe:
                exp = run_case(ref, pv, grids, key, prompt)
            router_gap, zeroed = probe.min_gap()
            distinct = len(set(exp["decode_tokens"].tolist()))
            if exp["_gap"] >= MIN_GREEDY_GAP and router_gap >= MIN_ROUTER_GAP and distinct >= 3:
                break
        else:
            raise RuntimeError(f"{name}: no robust prompt in {MAX_TRIES} tries")
        expected[f"{name}.pixel_values"] = pv
        expected[f"{name}.grids"] = np.array(grids, dtype=np.int32)
        expected[f"{name}.features"] = feats.astype(np.float32)
        for k, v in exp.items():
            if not k.startswith("_"):
                expected[f"{name}.{k}"] = v
        stats = {
            "name": name,
            "grids": grids,
            "grid_kind": "video (t, h, w)" if key == "video_grid_hws" else "image (h, w)",
            "patches": int(pv.shape[0]),
            "media_tokens": n_feat,
            "prompt_len": int(len(prompt)),
            "prompt_attempt": attempt,
            "min_greedy_top2_gap": round(exp["_gap"], 6),
            "min_router_selection_gap": round(float(router_gap), 6),
            "distinct_decode_tokens": distinct,
            "max_abs_diff_cached_vs_full": float(f"{exp['_cached_vs_full']:.3g}"),
            "features_absmax": round(float(np.abs(feats).max()), 4),
        }
        cases.append(stats)
        print(stats)
    q8_feats, q8_stats = build_q8(out, inputs)
    expected.update(q8_feats)
    meta = {"generator": "scripts/make_vision_k25_fixtures.py", **{k: v for k, v in PINS.items()}}
    mx.save_safetensors(
        str(out / "expected.safetensors"), {k: mx.array(v) for k, v in sorted(expected.items())}, metadata=meta
    )
    return {
        "generator": "scripts/make_vision_k25_fixtures.py",
        "pins": PINS,
        "placeholder_token_id": PLACEHOLDER,
        "decode_steps": DECODE_STEPS,
        "text_vs_mlx_lm_rel_err": float(f"{text_err:.3g}"),
        "cases": cases,
        "q8": q8_stats,
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        manifest = build(tmp)
        manifest["files"] = {
            str(p.relative_to(tmp)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if OUT.exists():
            shutil.rmtree(OUT)
        shutil.copytree(tmp, OUT)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT.relative_to(ROOT)} ({total / 1024:.0f} KiB in all)")


if __name__ == "__main__":
    main()
