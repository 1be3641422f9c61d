"""Build tiny Kimi K3.1 reference fixtures: Kimi K3 (`kimi_k3`) with the DSA lightning indexer on every MLA
layer, as this project reads K3.1's model card (indexer queries from the query latent, one key through a
LayerNorm with bias, no rotation, each query keeps its `index_topk` best positions).

No public reference implements K3.1's exact variant (mlx-lm 0.32.2's `kimi_k3.py` has no indexer, and its
`load_model` cannot load a kimi_k3 checkpoint with indexer tensors), so the reference is assembled here from
mlx-lm 0.32.2's own classes, without copying their math:

- everything but the indexer is mlx-lm's `kimi_k3.Model` (KDA, NoPE MLA with output gate, latent MoE,
  attention residuals, SiTU);
- each MLA layer's attention is `K31Attention`, a subclass of mlx-lm's `kimi_k3.KimiK3MLAAttention` that owns
  mlx-lm's `deepseek_v32.Indexer` with its rotation replaced by the identity, and that applies the indexer's
  choice exactly as mlx-lm's `deepseek_v32` attention does (prefill: a boolean top-k mask and'ed with the
  causal mask; decode: the kept latent and bias-key rows gathered);
- the MLA cache is mlx-lm's `KVCache` carrying a second `KVCache` for the indexer keys.

The weights of the K3 part are seeded exactly as make_k3_fixtures.py seeds them; the indexer's are drawn after
(LayerNorm weight ~1, bias ~0.1, projections 1/sqrt(fan-in), wq_b 2/sqrt(fan-in)). The config carries
DeepSeek-V3.2's field names `index_n_heads`, `index_head_dim`, `index_topk` (an assumption until a K3.1 config
is public). The recorded outputs are make_k3_fixtures.run_reference's (prefill, 16 cached greedy decode steps,
the cache-less forward over all 28 tokens, 32 tokens of mlx-lm's `generate_step`), on the in-memory model.

Output, under `mlx-k3/tests/fixtures/k31/`:

    a_k31_topk4   make_k3_fixtures' a_latent_norm_attnres as 3 layers (KDA, MLA, MLA) with 4 experts top-2
                  in 2 groups, vocabulary 128, hidden 32, 2 KDA heads of 16: q_lora, output gate, latent MoE,
                  attention residuals; indexer 4 heads x 16, index_topk 4 under a 12-token prompt, so the
                  sparse path runs in prefill and at every decode step of both MLA layers

Checked before writing (make_k3_fixtures' rules plus one): greedy top-2 gaps >= 2e-3, router gaps >= 2e-4,
cached decode equals the cache-less forward, and in every indexer call, for every query with more candidates
than index_topk, the topk-th and (topk+1)-th scores differ by >= 1e-4 of the row's largest |score|.

Run (CPU, a few seconds):

    .venv/bin/python scripts/make_k31_fixtures.py
"""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_deepseek_v32_fixtures as ds32  # noqa: E402
import make_k3_fixtures as k3  # noqa: E402  (checks the pins on import)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import deepseek_v32, kimi_k3  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: E402
from mlx_lm.models.cache import ArraysCache, KVCache  # noqa: E402

ROOT = k3.ROOT
OUT = ROOT / "mlx-k3" / "tests" / "fixtures" / "k31"


VOCAB = 128


def k31_fixture() -> dict:
    base = copy.deepcopy(next(f for f in k3.FIXTURES if f["name"] == "a_latent_norm_attnres"))
    t = base["text"]
    # Fewer and narrower experts than the K3 fixture: the whole fixture stays under 300 KB.
    t["num_hidden_layers"] = 3
    t["linear_attn_config"]["kda_layers"] = [1]
    t["linear_attn_config"]["full_attn_layers"] = [2, 3]
    # Two KDA heads (the K3 fixture has one), so that tensor parallelism over 2 ranks can split every layer.
    t["linear_attn_config"].update({"num_heads": 2, "head_dim": 16})
    t.update({"vocab_size": VOCAB, "hidden_size": 32, "routed_expert_hidden_size": 16, "num_experts": 4,
              "num_experts_per_token": 2, "num_expert_group": 2, "topk_group": 1, "moe_intermediate_size": 16})
    t.update({"index_n_heads": 4, "index_head_dim": 16, "index_topk": 4})
    return {**base, "name": "a_k31_topk4", "seed": 3101, "release": False}


FIXTURES = [k31_fixture()]


class NoRope(nn.Module):
    """K3.1's indexer has no rotation."""

    def __call__(self, x, offset=0):
        return x


class K31Cache(KVCache):
    """mlx-lm's KVCache for the latents, plus a second one for the indexer keys (deepseek_v32's CacheList)."""

    def __init__(self):
        super().__init__()
        self.index = KVCache()

    def trim(self, n):
        self.index.trim(n)
        return super().trim(n)


class K31Attention(kimi_k3.KimiK3MLAAttention):
    def __init__(self, args, t: dict):
        super().__init__(args)
        ix_args = types.SimpleNamespace(
            hidden_size=args.hidden_size,
            index_n_heads=t["index_n_heads"],
            index_head_dim=t["index_head_dim"],
            index_topk=t["index_topk"],
            q_lora_rank=args.q_lora_rank,
            qk_rope_head_dim=args.qk_rope_head_dim,
            rope_theta=10000.0,
            indexer_rope_interleave=False,
            max_position_embeddings=args.max_position_embeddings,
            rope_scaling=None,
        )
        self.indexer = deepseek_v32.Indexer(ix_args)
        self.indexer.rope = NoRope()

    def __call__(self, x, mask=None, cache=None):
        # kimi_k3.KimiK3MLAAttention.__call__ with deepseek_v32's indexer step inserted after the cache update.
        B, L, _ = x.shape
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr)
        q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
        compressed_kv = self.kv_a_proj_with_mqa(x)
        compressed_kv, k_pe = mx.split(compressed_kv, [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        kv_latent = mx.expand_dims(self.kv_a_layernorm(compressed_kv), axis=1)
        if cache is not None:
            kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)
        topk = self.indexer(x, qr, mask, cache=cache.index if cache is not None else None)
        if topk is not None:
            if L == 1:
                idx = topk[:, :, 0, :, None]
                kv_latent = mx.take_along_axis(
                    kv_latent, mx.broadcast_to(idx, idx.shape[:-1] + (kv_latent.shape[-1],)), axis=2
                )
                k_pe = mx.take_along_axis(k_pe, mx.broadcast_to(idx, idx.shape[:-1] + (k_pe.shape[-1],)), axis=2)
                assert mask is None
            else:
                shape = list(topk.shape)
                shape[-1] = kv_latent.shape[2]
                sparse = mx.put_along_axis(mx.zeros(shape, dtype=mx.bool_), topk, mx.array(True), axis=-1)
                mask = sparse & mask if mask is not None else sparse
        if cache is not None:
            cache.keys = mx.depends(cache.keys, (cache.index.keys, cache.index.values))
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if mask is not None:
            pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        if L == 1:
            q_nope = self.embed_q(q_nope)
            k = v = kv_latent
        else:
            k = self.embed_q(kv_latent, transpose=False)
            v = self.unembed_out(kv_latent)
        output = scaled_dot_product_attention(q_nope, k, v, cache=cache, scale=self.scale, mask=pe_scores)
        if L == 1:
            output = self.unembed_out(output)
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        if self.use_gate:
            output = output * mx.sigmoid(self.g_proj(x))
        return self.o_proj(output)


def make_cache(lm):
    return [ArraysCache(size=2) if layer.is_linear else K31Cache() for layer in lm.layers]


def build_model(config: dict, t: dict, seed: int):
    """mlx-lm's kimi_k3 model seeded as make_k3_fixtures seeds it, then the indexers attached and drawn."""
    mx.random.seed(seed)
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(copy.deepcopy(config)))
    k3.check_layer_plan(model, t)
    k3.init_weights(model, t)
    args = model.language_model.args
    mla = 0
    for layer in model.language_model.model.layers:
        if layer.is_linear:
            continue
        old = layer.self_attn
        layer.self_attn = K31Attention(args, config.get("text_config", config))
        layer.self_attn.update(old.parameters())
        mla += 1
    assert mla >= 2, "the fixture needs several MLA layers"
    new = []
    for path, w in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        if ".indexer." not in path:
            new.append((path, w))
            continue
        if path.endswith("k_norm.bias"):
            v = 0.1 * mx.random.normal(w.shape)
        elif path.endswith("k_norm.weight"):
            v = 1.0 + 0.1 * mx.random.normal(w.shape)
        elif path.endswith("wq_b.weight"):
            v = mx.random.normal(w.shape) * (2.0 / np.sqrt(w.shape[-1]))
        else:
            assert path.endswith(("wk.weight", "weights_proj.weight")), path
            v = mx.random.normal(w.shape) * (1.0 / np.sqrt(w.shape[-1]))
        new.append((path, v.astype(mx.float32)))
    model.load_weights(new, strict=True)
    mx.eval(model.parameters())
    model.language_model.make_cache = types.MethodType(make_cache, model.language_model)
    return model


class Probe(ds32.Probe):
    """ds32.Probe's indexer top-k gaps (it wraps deepseek_v32's mx) with kimi_k3's router gaps."""

    def __enter__(self):
        super().__enter__()
        self._router = k3.RouterProbe().__enter__()
        return self

    def __exit__(self, *exc):
        self._router.__exit__(*exc)
        self.records = self._router.records
        super().__exit__(*exc)


def choose_prompt_and_run(model, seed: int) -> tuple[dict, dict]:
    return k3.choose_prompt_and_run(model, seed, vocab=VOCAB, probe=Probe, min_index_gap=ds32.MIN_INDEX_GAP)


def save_expected(path: Path, exp: dict, stats: dict) -> None:
    k3.save_expected(path, exp, stats, "scripts/make_k31_fixtures.py")


def build_all(out: Path) -> list:
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for fx in FIXTURES:
        config = k3.make_config(fx)
        t = k3.text_of(config)
        model = build_model(config, t, fx["seed"])
        fdir = out / fx["name"]
        k3.write_model_dir(fdir, model, config)
        exp, stats = choose_prompt_and_run(model, fx["seed"])
        save_expected(fdir / "expected.safetensors", exp, stats)
        text = config.get("text_config", config)
        feats = {k: text[k] for k in ("index_n_heads", "index_head_dim", "index_topk")}
        feats["mla_layers"] = [i for i in range(1, t["num_hidden_layers"] + 1)
                               if i not in t["linear_attn_config"]["kda_layers"]]
        entries.append({"name": fx["name"], "dir": fx["name"], "quantized": False, "features": feats,
                        "checks": stats})
        print(f"{fx['name']}: {stats}")
    return entries


def main() -> None:
    ds32.ds3.write_fixture_set(OUT, "scripts/make_k31_fixtures.py", build_all)


if __name__ == "__main__":
    main()
