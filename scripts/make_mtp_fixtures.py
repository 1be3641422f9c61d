"""Build tiny DeepSeek-V3 checkpoints WITH a multi-token-prediction (MTP) layer, and the reference MTP drafts.

mlx-lm 0.32.2 has no MTP (its deepseek_v3 `sanitize` drops `model.layers.61.*`), so the reference is composed
here from mlx-lm's own `deepseek_v3` modules, per the published structure (DeepSeek-V3 technical report
section 2.2; the Hugging Face layout; the order of vLLM's `deepseek_mtp.py` and SGLang's `deepseek_nextn.py`):
the layer `model.layers.{num_hidden_layers}` is an mlx-lm `DeepseekV3DecoderLayer` of that index plus
`enorm`, `hnorm` (`nn.RMSNorm`), `eh_proj` (`nn.Linear(2 * hidden, hidden, bias=False)`) and
`shared_head.norm`; for position i, with h_i the main model's hidden state leaving its last layer (before
the final norm):

    x_i      = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))    embedding first
    o_i      = decoder_layer(x_i)           causal, its own mlx-lm KVCache over the positions
    logits_i = lm_head(shared_head.norm(o_i))                       predicts t_{i+2}

with the main model's embedding and LM head (the report shares them; the checkpoints store copies,
`embed_tokens` and `shared_head.head`, identical to the model's, which mlx-k3 does not read). A chained draft
runs the layer again at the next position on the previous draft's token and the layer's own output `o`
(vLLM's chaining).

The MTP layer starts from random weights like the model's and is then fitted for a few hundred Adam steps
to the model's own greedy continuations of random prompts, the fixture's among them (teacher-forced, position i predicting token
i + 2, as the report trains it), so that some drafts are right and the tests exercise partial acceptance and
rollback. The model itself is random: acceptance on these fixtures measures nothing (no benchmark).

Output, under `mlx-k3/tests/fixtures/mtp/`:

    <name>/config.json, model.safetensors, model.safetensors.index.json
    <name>/expected.safetensors
        prompt         [T] int32
        hidden         [T, D]   the main model's last-layer output (the drafter's tap) over the prompt
        mtp_logits     [T-1, V] teacher-forced MTP logits: row i from h_i and prompt[i+1]
        draft_tokens   [K] int32  greedy chained drafts after the whole prompt (context = prompt)
        draft_logits   [K, V]   the logits each draft is the argmax of (row 0 = mtp_logits[T-2])
        greedy_tokens  [G] int32  the main model's greedy continuation of the prompt (mlx-lm KVCache)
    manifest.json

Fixtures:
    mtp_hf   float; the model in mlx-lm's names, the MTP layer in Hugging Face names (per-expert
             experts.E.*_proj, kv_b_proj) with its embed_tokens and shared_head.head copies
    mtp_q4   the same weights quantized by mlx-lm (affine 4-bit, group 32; the MTP layer with nn.quantize
             and the same settings), all in mlx-lm's names

Checks before writing (make_k3_fixtures.py's thresholds): every MTP and draft top-1/top-2 gap >= 2e-3, every
router selection gap (model and MTP layer) >= 2e-4, the MTP positions computed in two chunks through the
cache equal the one-shot forward.

Run (CPU, seconds; byte-identical from run to run):

    .venv/bin/python scripts/make_mtp_fixtures.py
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_deepseek_v3_fixtures as dsv3  # noqa: E402
import make_k3_fixtures as k3  # noqa: E402  (checks the pins on import)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import deepseek_v3  # noqa: E402
from mlx_lm.models.base import create_attention_mask  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402
from mlx_lm.utils import quantize_model  # noqa: E402

OUT = k3.ROOT / "mlx-k3" / "tests" / "fixtures" / "mtp"
SEED = 31
PROMPT_LEN = 12
DRAFTS = 4
GREEDY = 24
TRAIN_SEQS = 48
TRAIN_STEPS = 200
TRAIN_LR = 3e-3
GENERATOR = "scripts/make_mtp_fixtures.py"

TEXT = {
    **copy.deepcopy(dsv3.BASE),
    **copy.deepcopy(dsv3.FIXTURES[0]["text"]),  # a_yarn_grouped: YaRN, 4 groups, shared expert, dense first
    "model_type": "deepseek_v3",
    "num_nextn_predict_layers": 1,
}


class MtpLayer(deepseek_v3.DeepseekV3DecoderLayer):
    """The MTP layer: a decoder layer of index num_hidden_layers plus its own norms and projection; its
    parameter paths are the checkpoint's names under `model.layers.{n}.`."""

    def __init__(self, args, n: int):
        super().__init__(args, n)
        d = args.hidden_size
        self.enorm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = nn.RMSNorm(d, eps=args.rms_norm_eps)

    def step(self, model, ids, hidden, cache):
        """(o, logits) for tokens ids [1, L] (each t_{i+1}) and hidden states [1, L, D] (each h_i)."""
        e = self.enorm(model.model.embed_tokens(ids))
        x = self.eh_proj(mx.concatenate([e, self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, return_array=True)
        o = deepseek_v3.DeepseekV3DecoderLayer.__call__(self, x, mask, cache)
        return o, model.lm_head(self.shared_head.norm(o))


def last_hidden(model, ids):
    """The main model's hidden states leaving its last layer (before the final norm), cache-less; the same
    loop as mlx-lm's DeepseekV3Model.__call__ (one process: no pipeline)."""
    h = model.model.embed_tokens(ids)
    mask = create_attention_mask(h, None, return_array=True)
    for layer in model.model.layers:
        h = layer(h, mask, cache=None)
    return h


def greedy_continuation(model, prompt: np.ndarray, n: int) -> list:
    cache = [KVCache() for _ in model.model.layers]
    out = model(mx.array(prompt[None]), cache=cache)[0, -1]
    toks = []
    for _ in range(n):
        tok = int(np.argmax(np.array(out)))
        toks.append(tok)
        out = model(mx.array([[tok]], dtype=mx.int32), cache=cache)[0, -1]
    return toks


def train_mtp(model, mtp: MtpLayer) -> float:
    """Fits the layer to the model's own greedy continuations (teacher-forced: position i predicts token
    i + 2), so that its drafts are sometimes right; returns the final training loss."""
    # The candidate fixture prompts first (choose_prompt_and_run draws them from the same seeds), then others.
    prompts = [np.random.default_rng(SEED + a).integers(0, dsv3.VOCAB, size=PROMPT_LEN) for a in range(8)]
    rng = np.random.default_rng(SEED - 1)
    prompts += [rng.integers(0, dsv3.VOCAB, size=PROMPT_LEN) for _ in range(TRAIN_SEQS - len(prompts))]
    seqs = []
    for p in prompts:
        p = p.astype(np.int32)
        seqs.append(np.concatenate([p, np.array(greedy_continuation(model, p, GREEDY), dtype=np.int32)]))
    x = mx.array(np.stack(seqs))
    h = mx.stop_gradient(last_hidden(model, x))
    mx.eval(h)
    start = PROMPT_LEN - 1  # learn the continuations, where drafting happens

    def loss_fn(m):
        _, logits = m.step(model, x[:, 1:-1], h[:, :-2], None)
        return nn.losses.cross_entropy(logits[:, start:], x[:, start + 2 :]).mean()

    opt = optim.Adam(learning_rate=TRAIN_LR)
    step = nn.value_and_grad(mtp, loss_fn)
    loss = None
    for _ in range(TRAIN_STEPS):
        loss, grads = step(mtp)
        opt.update(mtp, grads)
        mx.eval(mtp.parameters(), opt.state, loss)
    return float(loss)


def run_reference(model, mtp, prompt: np.ndarray) -> dict:
    ids = mx.array(prompt[None])
    T = len(prompt)
    h = last_hidden(model, ids)
    # The tap reproduces the model's own logits through its final norm and head.
    want = model(ids)
    got = model.lm_head(model.model.norm(h))
    assert np.array_equal(np.array(want), np.array(got)), "hidden states do not give mlx-lm's logits"
    cache = KVCache()
    o, logits = mtp.step(model, ids[:, 1:], h[:, :-1], cache)
    mx.eval(o, logits)
    # Two chunks through a fresh cache equal the one-shot forward.
    c2 = KVCache()
    _, l_a = mtp.step(model, ids[:, 1:6], h[:, :5], c2)
    _, l_b = mtp.step(model, ids[:, 6:], h[:, 5:-1], c2)
    chunked = np.concatenate([np.array(l_a[0]), np.array(l_b[0])])
    diff = float(np.abs(chunked - np.array(logits[0])).max())
    assert diff <= 1e-4 * max(1.0, float(np.abs(np.array(logits)).max())), diff
    # Chained drafts after the whole prompt: the teacher-forced cache holds positions 0..T-2.
    rows, tokens = [np.array(logits[0, -1])], []
    hid = o[:, -1:]
    for i in range(DRAFTS):
        tok = int(np.argmax(rows[-1]))
        tokens.append(tok)
        if i + 1 < DRAFTS:
            hid, lg = mtp.step(model, mx.array([[tok]], dtype=mx.int32), hid, cache)
            mx.eval(hid, lg)
            rows.append(np.array(lg[0, -1]))
    # The model's greedy continuation.
    mcache = [KVCache() for _ in model.model.layers]
    out = model(ids, cache=mcache)[0, -1]
    greedy = []
    for _ in range(GREEDY):
        tok = int(np.argmax(np.array(out)))
        greedy.append(tok)
        out = model(mx.array([[tok]], dtype=mx.int32), cache=mcache)[0, -1]
    return {
        "prompt": prompt.astype(np.int32),
        "hidden": np.array(h[0]).astype(np.float32),
        "mtp_logits": np.array(logits[0]).astype(np.float32),
        "draft_tokens": np.array(tokens, dtype=np.int32),
        "draft_logits": np.stack(rows).astype(np.float32),
        "greedy_tokens": np.array(greedy, dtype=np.int32),
        "_chunk_diff": diff,
    }


def agreement(model, mtp, prompt: np.ndarray, greedy: np.ndarray) -> float:
    """How often the MTP layer's argmax at position i is the greedy sequence's token i+2 (teacher-forced over
    prompt + greedy continuation): a sanity figure that drafts get accepted at all, nothing more."""
    seq = np.concatenate([prompt, greedy]).astype(np.int32)
    ids = mx.array(seq[None])
    h = last_hidden(model, ids)
    _, logits = mtp.step(model, ids[:, 1:], h[:, :-1], KVCache())
    pred = np.argmax(np.array(logits[0]), axis=-1)[len(prompt) - 1 : -1]
    return float((pred == seq[len(prompt) + 1 :]).mean())


def choose_prompt_and_run(model, mtp) -> tuple[dict, dict]:
    for attempt in range(k3.MAX_PROMPT_TRIES):
        rng = np.random.default_rng(SEED + attempt)
        prompt = rng.integers(0, dsv3.VOCAB, size=PROMPT_LEN).astype(np.int32)
        probe = dsv3.RouterProbe()
        with probe:
            exp = run_reference(model, mtp, prompt)
        router_gap, zeroed = probe.min_gap()
        gaps = [k3.top_gap(r) for r in exp["mtp_logits"]] + [k3.top_gap(r) for r in exp["draft_logits"]]
        if min(gaps) >= k3.MIN_GREEDY_GAP and router_gap >= k3.MIN_ROUTER_GAP:
            stats = {
                "prompt_seed": SEED + attempt,
                "min_mtp_top2_gap": round(min(gaps), 6),
                "min_router_selection_gap": round(router_gap, 6),
                "router_picks_from_zeroed_groups": zeroed,
                "max_abs_diff_chunked_vs_one_shot": float(f"{exp['_chunk_diff']:.3g}"),
                "mtp_greedy_agreement": round(agreement(model, mtp, prompt, exp["greedy_tokens"]), 3),
            }
            return exp, stats
    raise RuntimeError(f"no robust prompt in {k3.MAX_PROMPT_TRIES} tries")


def mlx_names(model, mtp, n: int) -> dict:
    out = dict(tree_flatten(model.parameters()))
    out.update({f"model.layers.{n}.{k}": v for k, v in tree_flatten(mtp.parameters())})
    # The checkpoints' copies of the shared embedding and head (mlx-k3 uses the model's own).
    out[f"model.layers.{n}.embed_tokens.weight"] = out["model.embed_tokens.weight"]
    out[f"model.layers.{n}.shared_head.head.weight"] = out["lm_head.weight"]
    for s in ("scales", "biases"):
        if f"model.embed_tokens.{s}" in out:
            out[f"model.layers.{n}.embed_tokens.{s}"] = out[f"model.embed_tokens.{s}"]
            out[f"model.layers.{n}.shared_head.head.{s}"] = out[f"lm_head.{s}"]
    return out


def write_dir(path: Path, weights: dict, config: dict) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    weights = dict(sorted(weights.items()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {k: "model.safetensors" for k in weights},
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True) + "\n")


def build_all(out: Path) -> list:
    out.mkdir(parents=True, exist_ok=True)
    n = TEXT["num_hidden_layers"]
    mx.random.seed(SEED)
    args = deepseek_v3.ModelArgs.from_dict(copy.deepcopy(TEXT))
    model = deepseek_v3.Model(args)
    dsv3.init_weights(model, TEXT)
    mtp = MtpLayer(args, n)
    dsv3.init_weights(mtp, TEXT)
    mx.eval(mtp.parameters())
    loss = train_mtp(model, mtp)
    print(f"MTP layer fitted to the model's greedy continuations: loss {loss:.3f}")
    assert isinstance(mtp.mlp, deepseek_v3.DeepseekV3MoE), "the MTP layer should be an MoE layer here"
    entries = []

    exp, stats = choose_prompt_and_run(model, mtp)
    weights = mlx_names(model, mtp, n)
    prefix = f"model.layers.{n}."
    mtp_only = {k: v for k, v in weights.items() if k.startswith(prefix)}
    hf = {k: v for k, v in weights.items() if not k.startswith(prefix)}
    hf.update(dsv3.to_hf(mtp_only, TEXT, ""))
    write_dir(out / "mtp_hf", hf, TEXT)
    k3.save_expected(out / "mtp_hf" / "expected.safetensors", exp, stats, GENERATOR)
    entries.append({"name": "mtp_hf", "dir": "mtp_hf", "quantized": False, "names": "mtp layer hf", "checks": stats})
    print(f"mtp_hf: {stats}")

    qmodel, qconfig = quantize_model(model, {**TEXT}, 32, 4, mode="affine")
    # quantize_model's own rule for the layer (it quantizes what has to_quantized and whole groups).
    nn.quantize(
        mtp,
        group_size=32,
        bits=4,
        mode="affine",
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    mx.eval(qmodel.parameters(), mtp.parameters())
    exp, stats = choose_prompt_and_run(qmodel, mtp)
    write_dir(out / "mtp_q4", mlx_names(qmodel, mtp, n), qconfig)
    k3.save_expected(out / "mtp_q4" / "expected.safetensors", exp, stats, GENERATOR)
    entries.append({"name": "mtp_q4", "dir": "mtp_q4", "quantized": True, "names": "mlx", "checks": stats})
    print(f"mtp_q4: {stats}")
    return entries


def main() -> None:
    dsv3.write_fixture_set(OUT, GENERATOR, build_all)


if __name__ == "__main__":
    main()
