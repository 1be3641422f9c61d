"""Build tiny DeepSeek-V3.2 (`deepseek_v32`: MLA plus the DSA lightning indexer) reference fixtures with
mlx-lm 0.32.2's own `mlx_lm/models/deepseek_v32.py`.

Same method as make_deepseek_v3_fixtures.py (whose base config, weight scales and checks this reuses):
tiny configurations, seeded random weights, saved with mlx-lm's `save_model`, reloaded with `load_model`,
and mlx-lm's outputs for a random 12-token prompt recorded (prefill, 16 cached greedy decode steps, the
cache-less forward over all 28 tokens, 32 tokens of `generate_step`). `index_topk` is 4 or 6, far below the
prompt length, so the sparse path runs in prefill (the top-k mask) and in every decode step (the gathered
latents), and the indexer-key cache is read at every step.

Output, under `mlx-k3/tests/fixtures/deepseek_v32/` (the layout of the deepseek_v3 fixtures):

    a_yarn_topk4        YaRN rope (mscale != 1, so the indexer's partial mscale matters), indexer rope on the
                        first qk_rope_head_dim of 16-wide heads, not interleaved; grouped routing, a shared
                        expert, first layer dense; index_topk 4, 4 indexer heads
    b_plain_interleave  default rope, indexer_rope_interleave true, ungrouped, index_topk 6
    a_yarn_topk4_q4     a_yarn_topk4 quantized by mlx-lm (affine 4-bit, group 32; indexer linears too)

Checked before writing, besides make_deepseek_v3_fixtures' rules (greedy gaps >= 2e-3, router gaps
>= 2e-4, cached decode equals the cache-less forward): in every indexer call of the chosen prompt's runs,
for every query with more candidates than index_topk, the topk-th and (topk+1)-th best scores differ by at
least 1e-4 of the row's largest |score| (MIN_INDEX_GAP), so the selection does not depend on fp32 summation
order.

Run (CPU, a few seconds; byte-identical from run to run):

    .venv/bin/python scripts/make_deepseek_v32_fixtures.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_deepseek_v3_fixtures as ds3  # noqa: E402
import make_k3_fixtures as k3  # noqa: E402  (checks the pins on import)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import deepseek_v32  # noqa: E402
from mlx_lm.utils import load_model, quantize_model  # noqa: E402

ROOT = k3.ROOT
OUT = ROOT / "mlx-k3" / "tests" / "fixtures" / "deepseek_v32"
MIN_INDEX_GAP = 1e-4

FIXTURES = [
    {
        "name": "a_yarn_topk4",
        "seed": 21,
        "text": {
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "index_n_heads": 4,
            "index_head_dim": 16,
            "index_topk": 4,
            "indexer_rope_interleave": False,
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
        "name": "b_plain_interleave",
        "seed": 22,
        "text": {
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "routed_scaling_factor": 1.0,
            "index_n_heads": 4,
            "index_head_dim": 16,
            "index_topk": 6,
            "indexer_rope_interleave": True,
            "rope_scaling": None,
        },
    },
]

QUANTIZED = [{"name": "a_yarn_topk4_q4", "base": "a_yarn_topk4", "bits": 4, "predicate": ds3.q4_predicate}]


def make_config(fx: dict) -> dict:
    return {**copy.deepcopy(ds3.BASE), **copy.deepcopy(fx["text"]), "model_type": "deepseek_v32"}


def init_weights(model, t: dict) -> None:
    """make_deepseek_v3_fixtures' scales (deepseek_v32 names its parameters as deepseek_v3 does), plus the
    indexer: LayerNorm weight ~1 and bias ~0.1, projections scaled by 1/sqrt(fan-in) (wq_b by 2/sqrt, for
    well-spread scores)."""
    new = []
    for path, w in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        shape = w.shape
        if path.endswith("e_score_correction_bias"):
            v = 0.3 * mx.random.normal(shape)
        elif path.endswith("k_norm.bias"):
            v = 0.1 * mx.random.normal(shape)
        elif "norm" in path.rsplit(".", 2)[-2]:
            v = 1.0 + 0.1 * mx.random.normal(shape)
        elif path.endswith(("embed_tokens.weight", "lm_head.weight")):
            v = 0.3 * mx.random.normal(shape)
        elif path.endswith(("embed_q.weight", "unembed_out.weight")):
            v = mx.random.normal(shape) * (1.0 / np.sqrt(t["kv_lora_rank"]))
        elif path.endswith("mlp.gate.weight"):
            v = mx.random.normal(shape) * (1.5 / np.sqrt(shape[-1]))
        elif path.endswith(("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "wq_b.weight")):
            v = mx.random.normal(shape) * (2.0 / np.sqrt(shape[-1]))
        else:
            assert path.endswith(".weight") and len(shape) in (2, 3), path
            v = mx.random.normal(shape) * (1.0 / np.sqrt(shape[-1]))
        new.append((path, v.astype(mx.float32)))
    model.load_weights(new, strict=True)
    mx.eval(model.parameters())


class Probe:
    """Records the routers' choices (make_k3_fixtures.RouterProbe's gaps) and the indexers' score rows."""

    def __init__(self):
        self.records = []
        self.index_gaps = []
        self._orig_select = deepseek_v32.group_expert_select
        self._mx = deepseek_v32.mx

    def __enter__(self):
        def probe(gates, bias, top_k, n_group, topk_group, scale, renorm):
            inds, w = self._orig_select(gates, bias, top_k, n_group, topk_group, scale, renorm)
            mx.eval(inds, w)
            self.records.append(
                (np.array(gates.astype(mx.float32)), np.array(bias), top_k, n_group, topk_group, np.array(inds))
            )
            return inds, w

        outer = self

        class Mx:
            def __getattr__(self, name):
                return getattr(outer._mx, name)

            @staticmethod
            def argpartition(a, kth, axis=-1):
                if kth < 0:  # the indexer's top-k (the router partitions with kth >= 0)
                    outer.index_gaps.append(index_gap(np.array(a), -kth))
                return outer._mx.argpartition(a, kth=kth, axis=axis)

        deepseek_v32.group_expert_select = probe
        deepseek_v32.mx = Mx()
        return self

    def __exit__(self, *exc):
        deepseek_v32.group_expert_select = self._orig_select
        deepseek_v32.mx = self._mx

    min_gap = k3.RouterProbe.min_gap


def index_gap(scores: np.ndarray, topk: int) -> float:
    """The smallest relative gap between the topk-th and (topk+1)-th finite score over the rows that have more
    than topk finite scores (rows with fewer keep all their causal positions whatever the order)."""
    worst = float("inf")
    for row in scores.reshape(-1, scores.shape[-1]):
        fin = np.sort(row[np.isfinite(row)])[::-1]
        if len(fin) > topk:
            worst = min(worst, (fin[topk - 1] - fin[topk]) / max(np.abs(fin).max(), 1e-30))
    return worst


def choose_prompt_and_run(model, seed: int) -> tuple[dict, dict]:
    return k3.choose_prompt_and_run(model, seed, vocab=ds3.VOCAB, probe=Probe, min_index_gap=MIN_INDEX_GAP)


def save_expected(path: Path, exp: dict, stats: dict) -> None:
    k3.save_expected(path, exp, stats, "scripts/make_deepseek_v32_fixtures.py")


def features(t: dict) -> dict:
    f = ds3.features(t, "deepseek_v32")
    f.update({k: t[k] for k in ("index_n_heads", "index_head_dim", "index_topk", "indexer_rope_interleave")})
    return f


def build_all(out: Path) -> list:
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for fx in FIXTURES:
        config = make_config(fx)
        mx.random.seed(fx["seed"])
        model = deepseek_v32.Model(deepseek_v32.ModelArgs.from_dict(copy.deepcopy(config)))
        init_weights(model, config)
        fdir = out / fx["name"]
        k3.write_model_dir(fdir, model, config)
        del model
        ref, _ = load_model(fdir)
        exp, stats = choose_prompt_and_run(ref, fx["seed"])
        save_expected(fdir / "expected.safetensors", exp, stats)
        entries.append({"name": fx["name"], "dir": fx["name"], "derived_from": None, "quantized": False,
                        "features": features(config), "checks": stats})
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
        entries.append({"name": q["name"], "dir": q["name"], "derived_from": q["base"], "quantized": True,
                        "quantization": k3.quant_summary(loaded), "features": features(loaded), "checks": stats})
        print(f"{q['name']}: {stats}")
    return entries


def main() -> None:
    ds3.write_fixture_set(OUT, "scripts/make_deepseek_v32_fixtures.py", build_all)


if __name__ == "__main__":
    main()
