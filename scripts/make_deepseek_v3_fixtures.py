"""Build tiny DeepSeek-V3 family reference fixtures with mlx-lm's own `deepseek_v3` and `kimi_k25` models.

The Rust graph's DeepSeek-V3 variant (MLA with decoupled RoPE and YaRN, SwiGLU, `noaux_tc` grouped routing,
shared experts, dense first layers) is checked against mlx-lm 0.32.2's `mlx_lm/models/deepseek_v3.py` and
`kimi_k25.py` (Kimi K2.5/K2.7: a `deepseek_v3` text model under `text_config`, weights under
`language_model.`). Like `make_k3_fixtures.py` (whose checks this reuses): tiny configurations (vocab 128,
hidden 32, 2 layers, 8 experts), seeded well-scaled random weights, saved with mlx-lm's `save_model`,
reloaded with mlx-lm's `load_model`, and mlx-lm's outputs for a random prompt recorded.

Output, under `mlx-k3/tests/fixtures/deepseek_v3/`:

    <name>/config.json, model.safetensors, model.safetensors.index.json   as mlx-lm writes them
    <name>/expected.safetensors   prompt, prefill_logits, decode_tokens, decode_logits, full_logits,
                                  generate_tokens (and prefill_logits_bf16 for the quantized ones), with
                                  the meanings make_k3_fixtures.py documents
    manifest.json                 every fixture, its features and the checks below

Fixtures:
    a_yarn_grouped       deepseek_v3, q_lora_rank set, YaRN (mscale 0.707 / mscale_all_dim 0.5: both the
                         input mscale and the softmax-scale correction differ from 1), 4 expert groups of which
                         2 are kept, 1 shared expert, first layer dense, routed_scaling_factor 2.5
    b_direct_q_plain_rope deepseek_v3, q_lora_rank null (q_proj), default RoPE, ungrouped, no shared experts,
                         MoE every second layer (moe_layer_freq 2: layer 0 MoE, layer 1 dense),
                         norm_topk_prob false
    c_kimi_k25           kimi_k25: text_config nested, Kimi K2's YaRN (factor 32, beta 1/1, mscale 1/1)
    a_yarn_grouped_q4    a_yarn_grouped quantized by mlx-lm: affine 4-bit, group 32, the shared experts and
                         dense MLP 8-bit. (The router cannot be quantized: deepseek_v3's MoEGate is not an
                         nn.Linear, so mlx-lm's quantize_model leaves it float.)
    a_yarn_grouped_mixed per-layer bits: down_proj 6-bit in layer 0 and 3-bit in layer 1 (K2.7 varies
                         down_proj bits per layer), other routed expert projections 2-bit, embedding/head
                         8-bit, 4-bit elsewhere
    a_yarn_grouped_mxfp4 routed experts MXFP4 (group 32), everything else affine 8-bit
    c_kimi_k25_hf        c_kimi_k25 under Hugging Face names (experts.E.*_proj, kv_b_proj, a vision-tower
                         tensor), checked to sanitize in mlx-lm to bit-identical weights and logits; then a
                         multi-token-prediction layer model.layers.2.* is added (see mtp_layer) and
                         expected.safetensors is c_kimi_k25's

Every fixture is checked before it is written (make_k3_fixtures.py's rules): at least 6 distinct greedy
tokens, every greedy top-1/top-2 gap >= 2e-3 and every router selection gap (top-k and group) >= 2e-4, far
above fp32 noise, and cached decode equals the cache-less forward.

Run (CPU, a few seconds; byte-identical from run to run):

    .venv/bin/python scripts/make_deepseek_v3_fixtures.py
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
import make_k3_fixtures as k3  # noqa: E402  (checks the pins on import)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import deepseek_v3, kimi_k25  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402
from mlx_lm.utils import load_model, quantize_model  # noqa: E402

ROOT = k3.ROOT
OUT = ROOT / "mlx-k3" / "tests" / "fixtures" / "deepseek_v3"
# Smaller than the K3 fixtures (vocab 256, hidden 64) to keep the six folders under a megabyte: 32 is the
# smallest width whose every projection MXFP4 (group 32) can quantize.
VOCAB = 128
HIDDEN = 32

BASE = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

FIXTURES = [
    {
        "name": "a_yarn_grouped",
        "model_type": "deepseek_v3",
        "seed": 11,
        "text": {
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
                "mscale": 0.707,
                "mscale_all_dim": 0.5,
            },
        },
    },
    {
        "name": "b_direct_q_plain_rope",
        "model_type": "deepseek_v3",
        "seed": 12,
        "text": {
            "q_lora_rank": None,
            "moe_intermediate_size": 16,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 0,
            "moe_layer_freq": 2,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": False,
            "rope_scaling": None,
        },
    },
    {
        "name": "c_kimi_k25",
        "model_type": "kimi_k25",
        "seed": 13,
        "text": {
            "n_shared_experts": 1,
            "moe_intermediate_size": 16,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.827,
            "norm_topk_prob": True,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        },
    },
]


def q4_predicate(path: str, module) -> bool | dict:
    if ".shared_experts." in path or (".mlp." in path and "layers.0." in path):
        return {"group_size": 32, "bits": 8, "mode": "affine"}
    return True


def mixed_predicate(path: str, module) -> bool | dict:
    if path.endswith("down_proj") and "layers.0." in path:
        return {"group_size": 32, "bits": 6, "mode": "affine"}
    if path.endswith("down_proj") and "layers.1." in path:
        return {"group_size": 32, "bits": 3, "mode": "affine"}
    if ".switch_mlp." in path:
        return {"group_size": 32, "bits": 2, "mode": "affine"}
    if path.endswith(("embed_tokens", "lm_head")):
        return {"group_size": 32, "bits": 8, "mode": "affine"}
    return True


def mxfp4_predicate(path: str, module) -> bool | dict:
    if ".switch_mlp." in path:
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return {"group_size": 32, "bits": 8, "mode": "affine"}


QUANTIZED = [
    {"name": "a_yarn_grouped_q4", "base": "a_yarn_grouped", "bits": 4, "predicate": q4_predicate},
    {"name": "a_yarn_grouped_mixed", "base": "a_yarn_grouped", "bits": 4, "predicate": mixed_predicate},
    {"name": "a_yarn_grouped_mxfp4", "base": "a_yarn_grouped", "bits": 4, "predicate": mxfp4_predicate},
]


def make_config(fx: dict) -> dict:
    text = {**copy.deepcopy(BASE), **copy.deepcopy(fx["text"]), "model_type": "deepseek_v3"}
    if fx["model_type"] == "kimi_k25":
        return {"model_type": "kimi_k25", "text_config": text, "tie_word_embeddings": False}
    return text


def text_of(config: dict) -> dict:
    return config.get("text_config", config)


def build_model(config: dict):
    if config["model_type"] == "kimi_k25":
        return kimi_k25.Model(kimi_k25.ModelArgs.from_dict(copy.deepcopy(config)))
    return deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(copy.deepcopy(config)))


def init_weights(model, t: dict) -> None:
    new = []
    for path, w in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        shape = w.shape
        owner = path.rsplit(".", 2)[-2] if path.endswith(".weight") else path.rsplit(".", 1)[-1]
        if path.endswith("e_score_correction_bias"):
            v = 0.3 * mx.random.normal(shape)
        elif "norm" in owner:
            v = 1.0 + 0.1 * mx.random.normal(shape)
        elif path.endswith(("embed_tokens.weight", "lm_head.weight")):
            v = 0.3 * mx.random.normal(shape)
        elif path.endswith(("embed_q.weight", "unembed_out.weight")):
            v = mx.random.normal(shape) * (1.0 / np.sqrt(t["kv_lora_rank"]))
        elif path.endswith("mlp.gate.weight"):  # router: sigmoid inputs with std ~1.5
            v = mx.random.normal(shape) * (1.5 / np.sqrt(shape[-1]))
        elif path.endswith(("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight")):
            # Larger rope-slot scores so that positions (and YaRN) visibly move the logits.
            v = mx.random.normal(shape) * (2.0 / np.sqrt(shape[-1]))
        else:
            assert path.endswith(".weight") and len(shape) in (2, 3), path
            v = mx.random.normal(shape) * (1.0 / np.sqrt(shape[-1]))
        new.append((path, v.astype(mx.float32)))
    model.load_weights(new, strict=True)
    mx.eval(model.parameters())


class RouterProbe(k3.RouterProbe):
    """make_k3_fixtures' probe, around deepseek_v3.group_expert_select (same selection rule)."""

    def __init__(self):
        self.records = []
        self._orig = deepseek_v3.group_expert_select

    def __enter__(self):
        def probe(gates, bias, top_k, n_group, topk_group, scale, renorm):
            inds, w = self._orig(gates, bias, top_k, n_group, topk_group, scale, renorm)
            mx.eval(inds, w)
            self.records.append(
                (np.array(gates.astype(mx.float32)), np.array(bias), top_k, n_group, topk_group, np.array(inds))
            )
            return inds, w

        deepseek_v3.group_expert_select = probe
        return self

    def __exit__(self, *exc):
        deepseek_v3.group_expert_select = self._orig


def choose_prompt_and_run(model, seed: int) -> tuple[dict, dict]:
    # make_k3_fixtures.run_reference calls model.make_cache(); deepseek_v3 models use mlx-lm's default
    # caches (one KVCache per layer, what make_prompt_cache gives a model without make_cache).
    if not hasattr(model, "make_cache"):
        object.__setattr__(model, "make_cache", lambda: [KVCache() for _ in model.layers])
    return k3.choose_prompt_and_run(model, seed, vocab=VOCAB, probe=RouterProbe, need_router=True)


def save_expected(path: Path, exp: dict, stats: dict) -> None:
    k3.save_expected(path, exp, stats, "scripts/make_deepseek_v3_fixtures.py")


def features(t: dict, model_type: str) -> dict:
    rs = t.get("rope_scaling") or {}
    return {
        "model_type": model_type,
        "q_lora_rank": t.get("q_lora_rank"),
        "rope": rs.get("type", "default"),
        "n_group": t.get("n_group", 1),
        "topk_group": t.get("topk_group", 1),
        "n_shared_experts": t.get("n_shared_experts"),
        "first_k_dense_replace": t.get("first_k_dense_replace", 0),
        "moe_layer_freq": t.get("moe_layer_freq", 1),
        "norm_topk_prob": t.get("norm_topk_prob", True),
        "routed_scaling_factor": t.get("routed_scaling_factor", 1.0),
    }


def to_hf(sanitized: dict, t: dict, prefix: str) -> dict:
    """Inverse of mlx-lm's deepseek_v3 `sanitize`: per-expert `mlp.experts.E.{gate,up,down}_proj` and one
    `kv_b_proj` per layer (rows per head: the nope key projection, then the value projection), as the
    Hugging Face checkpoints of DeepSeek-V3 and Kimi K2 name them (float, no fp8)."""
    out = {}
    dn = t["qk_nope_head_dim"]
    for k, v in sanitized.items():
        name = k[len(prefix):] if k.startswith(prefix) else k
        if ".mlp.switch_mlp." in name:
            stem, rest = name.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{prefix}{stem}.experts.{e}.{rest}"] = v[e]
        elif name.endswith("self_attn.embed_q.weight"):
            wk = v.swapaxes(-1, -2)  # (H, dn, r)
            wv = sanitized[k.replace("embed_q", "unembed_out")]  # (H, dv, r)
            heads = wk.shape[0]
            assert wk.shape[1] == dn
            kv_b = mx.concatenate([wk, wv], axis=1).reshape(heads * (dn + wv.shape[1]), -1)
            out[k.replace("embed_q.weight", "kv_b_proj.weight")] = mx.contiguous(kv_b)
        elif name.endswith("self_attn.unembed_out.weight"):
            continue
        else:
            out[k] = v
    return out


def mtp_layer(hf: dict, t: dict, prefix: str) -> dict:
    """A multi-token-prediction layer as the releases store it: `model.layers.{num_hidden_layers}` (a copy of
    the last layer's tensors plus enorm/hnorm/eh_proj/shared_head). mlx-lm's sanitize drops
    `model.layers.61.*` (DeepSeek-V3's and Kimi K2's layer count hard-coded), so mlx-lm cannot load this
    tiny copy with it; mlx-k3 drops every layer at or past num_hidden_layers, the same tensors on those
    checkpoints."""
    n = t["num_hidden_layers"]
    last = f"{prefix}model.layers.{n - 1}."
    extra = {k.replace(last, f"{prefix}model.layers.{n}."): v for k, v in hf.items() if k.startswith(last)}
    d = t["hidden_size"]
    for name, shape in [("enorm.weight", (d,)), ("hnorm.weight", (d,)), ("eh_proj.weight", (d, 2 * d)),
                        ("shared_head.norm.weight", (d,)), ("shared_head.head.weight", (t["vocab_size"], d))]:
        extra[f"{prefix}model.layers.{n}.{name}"] = mx.ones(shape, dtype=mx.float32)
    return extra


def build_hf_copy(out: Path, base: str) -> dict:
    """`{base}_hf`: the base fixture under Hugging Face names; mlx-lm must sanitize it back to the same
    weights and logits. An MTP layer and a vision-tower tensor are added after that check."""
    bdir = out / base
    rdir = out / f"{base}_hf"
    if rdir.exists():
        shutil.rmtree(rdir)
    rdir.mkdir()
    shutil.copyfile(bdir / "config.json", rdir / "config.json")
    config = json.loads((bdir / "config.json").read_text())
    t = text_of(config)
    prefix = "language_model." if config["model_type"] == "kimi_k25" else ""
    hf = to_hf(mx.load(str(bdir / "model.safetensors")), t, prefix)
    if prefix:
        hf["vision_tower.patch_embed.weight"] = mx.zeros((4, 4), dtype=mx.float32)
    mx.save_safetensors(str(rdir / "model.safetensors"), hf, metadata={"format": "pt"})
    ref, _ = load_model(bdir)
    got, _ = load_model(rdir)
    a = dict(tree_flatten(ref.parameters()))
    b = dict(tree_flatten(got.parameters()))
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert np.array_equal(np.array(a[k]), np.array(b[k])), k
    exp = mx.load(str(bdir / "expected.safetensors"))
    logits = got(exp["prompt"][None])[0]
    assert np.array_equal(np.array(logits), np.array(exp["prefill_logits"])), "HF copy's logits differ"
    hf.update(mtp_layer(hf, t, prefix))
    mx.save_safetensors(str(rdir / "model.safetensors"), hf, metadata={"format": "pt"})
    shutil.copyfile(bdir / "expected.safetensors", rdir / "expected.safetensors")
    print(f"{rdir.name}: mlx-lm sanitizes the HF names to {base}'s weights and logits (bit-identical)")
    return {"name": rdir.name, "dir": rdir.name, "derived_from": base, "quantized": False, "names": "hf",
            "features": features(t, config["model_type"]), "checks": None}


def build_all(out: Path) -> list:
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for fx in FIXTURES:
        config = make_config(fx)
        t = text_of(config)
        mx.random.seed(fx["seed"])
        model = build_model(config)
        init_weights(model, t)
        fdir = out / fx["name"]
        k3.write_model_dir(fdir, model, config)
        del model
        ref, _ = load_model(fdir)
        exp, stats = choose_prompt_and_run(ref, fx["seed"])
        save_expected(fdir / "expected.safetensors", exp, stats)
        entries.append({"name": fx["name"], "dir": fx["name"], "derived_from": None, "quantized": False,
                        "features": features(t, fx["model_type"]), "checks": stats})
        print(f"{fx['name']}: {stats}")

    for q in QUANTIZED:
        bdir = out / q["base"]
        model, config = load_model(bdir)
        model, qconfig = quantize_model(model, config, 32, q["bits"], mode="affine", quant_predicate=q["predicate"])
        qdir = out / q["name"]
        k3.write_model_dir(qdir, model, qconfig)
        del model
        ref, loaded = load_model(qdir)
        seed = next(f["seed"] for f in FIXTURES if f["name"] == q["base"])
        exp, stats = choose_prompt_and_run(ref, seed)
        exp["prefill_logits_bf16"] = k3.bf16_prefill(load_model(qdir)[0], exp["prompt"])
        save_expected(qdir / "expected.safetensors", exp, stats)
        base_fx = next(f for f in FIXTURES if f["name"] == q["base"])
        entries.append({"name": q["name"], "dir": q["name"], "derived_from": q["base"], "quantized": True,
                        "quantization": k3.quant_summary(loaded),
                        "features": features(text_of(loaded), base_fx["model_type"]), "checks": stats})
        print(f"{q['name']}: {stats}")
    hf = build_hf_copy(out, "c_kimi_k25")
    hf["checks"] = next(e["checks"] for e in entries if e["name"] == "c_kimi_k25")
    entries.append(hf)
    return entries


def write_fixture_set(out: Path, generator: str, build_all) -> None:
    """Build every fixture into a scratch folder with `build_all(tmp) -> entries`, then replace `out` with them
    and a manifest.json (each fixture's files with their SHA-256, the pins and the prompt/decode lengths)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        entries = build_all(tmp)
        for e in entries:
            files = sorted((tmp / e["dir"]).iterdir())
            e["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
        manifest = {
            "generator": generator,
            "mlx": k3.PINS["mlx"],
            "mlx_lm": k3.PINS["mlx-lm"],
            "prompt_len": k3.PROMPT_LEN,
            "decode_steps": k3.DECODE_STEPS,
            "fixtures": entries,
        }
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for e in entries:
            shutil.copytree(tmp / e["dir"], out / e["dir"])
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(entries)} fixtures to {out.relative_to(ROOT)} ({total / 1024:.0f} KiB in all)")


def main() -> None:
    write_fixture_set(OUT, "scripts/make_deepseek_v3_fixtures.py", build_all)


if __name__ == "__main__":
    main()
