"""Trains the block drafter of k3-nano on the target's own generations and writes it to
models/k3-nano/drafter/ (config.json, model.safetensors, parity.safetensors, loss.csv, train_summary.json).

The drafter (docs/architecture.md#the-block-drafter) reads the target's hidden states leaving the tap layers
(0-based [1, 3, 5]) at every position the target has run, and drafts K tokens in one forward: slot 0 holds
the embedding of the last emitted (not yet run) token x_n, slots 1..K-1 a learned mask vector; every slot
also gets its slot embedding and the projected taps of position n-1. Two pre-norm layers follow: attention
of the K slots over [projected taps of positions < n ; the K slots] (RoPE, the block sees itself
bidirectionally) and a SwiGLU MLP. A final RMSNorm and the target's frozen embedding matrix (k3-nano ties
embedding and LM head) give the logits; slot i predicts x_{n+1+i}.

Data (on-policy): prompts of P tokens drawn at random from k3-nano's training files (data_manifest.json,
split "train"; never the held-out files), continued G tokens by the target itself through mlx-lm's kimi_k3
(fp32), half greedy and half sampled at temperature 0.7, recording the tap-layer hidden states of every
position it runs. Loss: cross-entropy of each slot against the target's tokens, slot i weighted 0.85**i
(a later draft only counts when every earlier one was accepted, so the early slots matter most).
Everything is seeded; with the same BLAS, CPU and MLX build a rerun writes the same files.

Usage (from the repository root):
    .venv/bin/python scripts/speculative/train_block_drafter.py [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "k3_nano"))
import common  # noqa: E402

import importlib.metadata  # noqa: E402

for _dist, _want in (("mlx", "0.32.4"), ("mlx-lm", "0.32.2")):
    if importlib.metadata.version(_dist) != _want:
        sys.exit(f"train_block_drafter.py needs {_dist}=={_want} (found {importlib.metadata.version(_dist)})")
BLAS = common.maybe_reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.base import create_attention_mask, create_ssm_mask  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

import infer  # noqa: E402

SEED = 20261207
TAPS = [1, 3, 5]
CONFIG = {
    "model_type": "k3_block_drafter",
    "target_model_type": "kimi_k3",
    "hidden_size": 256,
    "target_hidden_size": 256,
    "vocab_size": 2304,
    "tap_layers": TAPS,
    "num_layers": 2,
    "num_heads": 4,
    "head_dim": 64,
    "intermediate_size": 384,
    "block_size": 7,
    "context_window": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


# ---------------------------------------------------------------------------------------------------------
# The target: a forward that also returns the tap-layer hidden states
# ---------------------------------------------------------------------------------------------------------


def target_forward(model, ids: mx.array, cache):
    """mlx-lm's KimiK3TextModel.__call__ (one rank), keeping h after each tap layer: logits [B,T,V] and
    taps [B, T, len(TAPS) * D] (concatenated in TAPS order)."""
    tm = model.language_model.model
    h = tm.embed_tokens(ids)
    ssm_mask = create_ssm_mask(h, cache[tm.ssm_idx]) if tm.ssm_idx is not None else None
    attn_mask = create_attention_mask(h, cache[tm.attn_idx], return_array=True) if tm.attn_idx is not None else None
    from mlx_lm.models.kimi_k3 import ResidualBlocks, _attn_res_mix

    blocks = ResidualBlocks(tm.args.rms_norm_eps) if tm.use_attn_res else None
    taps = {}
    for i, layer in enumerate(tm.layers):
        h, blocks = layer(h, mask=ssm_mask if layer.is_linear else attn_mask, cache=cache[i], blocks=blocks)
        if i in TAPS:
            taps[i] = h
    if blocks is not None:
        if tm._output_res_w_eff is None:
            tm._output_res_w_eff = tm.output_attn_res_norm.weight.astype(mx.float32) * tm.output_attn_res_proj.weight.reshape(-1)
        h = _attn_res_mix(blocks, h, tm._output_res_w_eff, tm.args.rms_norm_eps, True)
    logits = tm.embed_tokens.as_linear(tm.norm(h))
    return logits, mx.concatenate([taps[t] for t in TAPS], axis=-1)


def train_prompts(enc, n: int, p: int, rng: np.random.Generator) -> np.ndarray:
    """n prompts of p tokens: [BOS] + a window of a random training file, starting at a random token."""
    manifest = json.loads((ROOT / "models/k3-nano/data_manifest.json").read_text())
    root = Path(manifest["stdlib"])
    files = [f["path"] for f in manifest["files"] if f["split"] == "train"]
    docs = {}
    out = np.zeros((n, p), np.int32)
    bos = 2046
    for r in range(n):
        while True:
            rel = files[rng.integers(len(files))]
            if rel not in docs:
                docs[rel] = enc.encode_ordinary((root / rel).read_bytes().decode("utf-8"))
            toks = docs[rel]
            if len(toks) >= p + 1:
                break
        s = int(rng.integers(0, len(toks) - (p - 1)))
        window = toks[s : s + p - 1]
        out[r] = [bos] + window
    return out


def generate(model, prompts: np.ndarray, g: int, temp: float, key):
    """Continues a batch of prompts by g tokens; returns tokens [B, P+g] and the taps [B, P+g-1, 3D] of
    every run position (the last generated token is not run)."""
    cache = model.make_cache()
    logits, taps = target_forward(model, mx.array(prompts), cache)
    all_taps = [taps]
    toks = [mx.array(prompts)]
    for step in range(g):
        last = logits[:, -1, :]
        if temp == 0:
            t = mx.argmax(last, axis=-1)
        else:
            key, sub = mx.random.split(key)
            t = mx.random.categorical(last / temp, key=sub)
        t = t.astype(mx.int32)[:, None]
        toks.append(t)
        if step + 1 < g:
            logits, taps = target_forward(model, t, cache)
            all_taps.append(taps)
        mx.eval(toks[-1], all_taps[-1], logits)
    return mx.concatenate(toks, axis=1), mx.concatenate(all_taps, axis=1).astype(mx.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------------


def rope(x: mx.array, pos: mx.array, theta: float) -> mx.array:
    """Non-traditional RoPE (MLX's `traditional=False`: the two halves of each head form the pairs) at the
    given positions. x [B, H, T, hd], pos [B, T] (float)."""
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-mx.arange(0, half, dtype=mx.float32) * 2.0 / hd)
    ang = pos[:, None, :, None] * inv
    c, s = mx.cos(ang), mx.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, h, hd, f = cfg["hidden_size"], cfg["num_heads"], cfg["head_dim"], cfg["intermediate_size"]
        eps = cfg["rms_norm_eps"]
        self.attn_norm = nn.RMSNorm(d, eps=eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, h * hd, bias=False)
        self.v_proj = nn.Linear(d, h * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=eps)
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.h, self.hd, self.theta = h, hd, cfg["rope_theta"]

    def __call__(self, x, ctx, pos_q, pos_k, mask):
        """x [B, Q, D] block slots; ctx [B, C, D] projected context; pos_q [B, Q], pos_k [B, C+Q];
        mask [B, 1, Q, C+Q] additive."""
        B, Q, _ = x.shape
        xn = self.attn_norm(x)
        kv_in = mx.concatenate([ctx, xn], axis=1)
        heads = lambda t: t.reshape(B, t.shape[1], self.h, self.hd).transpose(0, 2, 1, 3)  # noqa: E731
        q = rope(heads(self.q_proj(xn)), pos_q, self.theta)
        k = rope(heads(self.k_proj(kv_in)), pos_k, self.theta)
        v = heads(self.v_proj(kv_in))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.hd**-0.5, mask=mask)
        x = x + self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, Q, -1))
        y = self.mlp_norm(x)
        return x + self.down_proj(nn.silu(self.gate_proj(y)) * self.up_proj(y))


class BlockDrafter(nn.Module):
    def __init__(self, cfg, final_norm_init: mx.array):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.fc = nn.Linear(cfg["target_hidden_size"] * len(cfg["tap_layers"]), d, bias=False)
        self.ctx_norm = nn.RMSNorm(d, eps=eps)
        self.mask_embed = mx.random.normal((d,)) * 0.02
        self.slot_embed = mx.random.normal((cfg["block_size"], d)) * 0.02
        self.layers = [Layer(cfg) for _ in range(cfg["num_layers"])]
        self.norm = nn.RMSNorm(d, eps=eps)
        self.norm.weight = final_norm_init
        self.K = cfg["block_size"]

    def __call__(self, taps, tok_emb, last_idx, pos_q, pos_k, mask, embed_w):
        """taps [B, C, 3D]; tok_emb [B, A, D] embeddings of x_n per anchor; last_idx [B, A] index in the
        context of position n-1; positions and mask as Layer takes them. Returns logits [B, A*K, V]."""
        B, A, D = tok_emb.shape
        ctx = self.ctx_norm(self.fc(taps))
        last = mx.take_along_axis(ctx, last_idx[:, :, None], axis=1)  # [B, A, D]
        slot_in = mx.concatenate(
            [tok_emb[:, :, None, :], mx.broadcast_to(self.mask_embed, (B, A, self.K - 1, D))], axis=2
        )
        x = (slot_in + self.slot_embed + last[:, :, None, :]).reshape(B, A * self.K, D)
        for layer in self.layers:
            x = layer(x, ctx, pos_q, pos_k, mask)
        return self.norm(x) @ embed_w.T


def batch_inputs(seq_len: int, anchors: np.ndarray, K: int):
    """Positions and mask for anchors [B, A] over a context of C = seq_len - 1 run positions."""
    B, A = anchors.shape
    C = seq_len - 1
    pos_q = (anchors[:, :, None] + np.arange(K)[None, None, :]).reshape(B, A * K).astype(np.float32)
    pos_k = np.concatenate([np.broadcast_to(np.arange(C, dtype=np.float32), (B, C)), pos_q], axis=1)
    ctx_ok = np.arange(C)[None, None, :] < anchors[:, :, None]  # [B, A, C]: position j < n
    ctx_ok = np.repeat(ctx_ok, K, axis=1)  # [B, A*K, C]
    aid = np.repeat(np.arange(A), K)
    blk_ok = np.broadcast_to(aid[:, None] == aid[None, :], (B, A * K, A * K))
    ok = np.concatenate([ctx_ok, blk_ok], axis=2)
    mask = np.where(ok, 0.0, -1e9).astype(np.float32)[:, None]
    return mx.array(pos_q), mx.array(pos_k), mx.array(mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "models/k3-nano/drafter")
    ap.add_argument("--sequences", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=450)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()
    mx.random.seed(SEED)
    rng = np.random.default_rng(SEED)
    t_start = time.time()

    target, _ = load_model(ROOT / "models/k3-nano")
    target.set_dtype(mx.float32)
    target.eval()
    enc = infer.load_encoding(ROOT / "models/k3-nano")
    embed_w = target.language_model.model.embed_tokens.weight  # frozen, [V, D]
    final_norm = target.language_model.model.norm.weight

    # 1. On-policy data.
    P, G, K = args.prompt_len, args.gen, CONFIG["block_size"]
    prompts = train_prompts(enc, args.sequences, P, rng)
    key = mx.random.key(SEED)
    toks, taps = [], []
    for b in range(0, args.sequences, args.gen_batch):
        temp = 0.0 if (b // args.gen_batch) % 2 == 0 else 0.7
        key, sub = mx.random.split(key)
        t, h = generate(target, prompts[b : b + args.gen_batch], G, temp, sub)
        toks.append(np.array(t))
        taps.append(h)
        print(f"generated {b + len(t)}/{args.sequences} (temp {temp}) {time.time() - t_start:.0f}s", flush=True)
    toks = np.concatenate(toks)
    taps = mx.concatenate(taps)
    t_data = time.time() - t_start
    L = P + G

    # 2. Training.
    drafter = BlockDrafter(CONFIG, final_norm)
    n_params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    warm = min(50, args.steps // 2)
    sched = optim.join_schedules(
        [optim.linear_schedule(1e-5, args.lr, warm), optim.cosine_decay(args.lr, args.steps - warm, args.lr * 0.1)],
        [warm],
    )
    opt = optim.AdamW(learning_rate=sched, betas=[0.9, 0.95], weight_decay=0.01)
    slot_w = mx.array([0.85**i for i in range(K)], mx.float32)
    slot_w = slot_w / slot_w.sum()
    lo, hi = P - 1, L - 1 - K  # anchors n: the unrun token x_n, labels x_{n+1..n+K} (all generated)

    def loss_fn(m, tp, temb, last_idx, pq, pk, mask, labels):
        logits = m(tp, temb, last_idx, pq, pk, mask, embed_w)
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")  # [B, A*K]
        ce = ce.reshape(ce.shape[0], -1, K)
        return (ce.mean(axis=(0, 1)) * slot_w).sum(), ce.mean(axis=(0, 1))

    grad_fn = nn.value_and_grad(drafter, loss_fn)

    def make_batch(idx, anchors):
        sel = mx.array(idx)
        tp = taps[sel].astype(mx.float32)
        xs = toks[idx]
        temb = embed_w[mx.array(xs[np.arange(len(idx))[:, None], anchors])]
        last_idx = mx.array(np.maximum(anchors - 1, 0).astype(np.int32))
        pq, pk, mask = batch_inputs(L, anchors, K)
        lab = xs[np.arange(len(idx))[:, None, None], anchors[:, :, None] + 1 + np.arange(K)[None, None, :]]
        return tp, temb, last_idx, pq, pk, mask, mx.array(lab.reshape(len(idx), -1))

    # A fixed evaluation batch of 64 sequences the training batches never contain (every (N/64)-th: greedy
    # and sampled ones alike).
    eval_idx = np.arange(0, args.sequences, args.sequences // 64)[:64]
    pool = np.setdiff1d(np.arange(args.sequences), eval_idx)
    eval_anchors = np.sort(rng.integers(lo, hi + 1, size=(64, args.anchors)), axis=1)
    eval_batch = make_batch(eval_idx, eval_anchors)

    rows = []
    t_train = time.time()
    for step in range(1, args.steps + 1):
        idx = rng.choice(pool, size=args.batch, replace=False)
        anchors = np.sort(rng.integers(lo, hi + 1, size=(args.batch, args.anchors)), axis=1)
        (loss, per_slot), grads = grad_fn(drafter, *make_batch(idx, anchors))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(drafter, grads)
        mx.eval(drafter.parameters(), opt.state, loss)
        if step % 50 == 0 or step == 1:
            _, ev = loss_fn(drafter, *eval_batch)
            logits = drafter(*eval_batch[:6], embed_w)
            acc = (mx.argmax(logits, axis=-1) == eval_batch[6]).reshape(64, -1, K).astype(mx.float32)
            # Expected tokens per cycle of a greedy K-draft cycle: 1 + the mean accepted prefix length.
            tpc = 1 + mx.cumprod(acc, axis=-1).sum(axis=-1).mean()
            row = [step, float(loss), *[float(x) for x in ev], float(tpc)]
            rows.append(row)
            print(
                f"step {step} loss {float(loss):.3f} eval slot CE "
                + " ".join(f"{float(x):.2f}" for x in ev)
                + f" greedy tokens/cycle {float(tpc):.2f} ({time.time() - t_train:.0f}s)",
                flush=True,
            )
    t_total = time.time() - t_start

    # 3. Write: weights rounded to bf16 (the reference below is computed with exactly those values).
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(drafter.parameters())}
    drafter.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()])
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    with open(out / "loss.csv", "w") as f:
        f.write("step,train_loss," + ",".join(f"eval_ce_slot{i}" for i in range(K)) + ",eval_greedy_tokens_per_cycle\n")
        for r in rows:
            f.write(",".join(f"{x:.4f}" if isinstance(x, float) else str(x) for x in r) + "\n")

    # Parity reference: the drafter's logits for one held-out context (the target's own taps of the first
    # 40 held-out tokens, the 41st as x_n), in fp32.
    held = mx.load(str(ROOT / "models/k3-nano/heldout.safetensors"))["tokens"]
    ctx_ids = np.array(held[:41]).astype(np.int32)
    _, ptaps = target_forward(target, mx.array(ctx_ids[None, :40]), target.make_cache())
    ptaps = ptaps.astype(mx.float32)
    anchor = np.array([[40]])
    pq, pk, mask = batch_inputs(41, anchor, K)
    plog = drafter(ptaps, embed_w[mx.array(ctx_ids[None, 40:41])], mx.array([[39]]), pq, pk, mask, embed_w)
    mx.eval(plog)
    mx.save_safetensors(
        str(out / "parity.safetensors"),
        {"tokens": mx.array(ctx_ids), "taps": ptaps[0], "logits": plog[0]},
        metadata={
            "what": "block drafter logits [K, V] for context taps [40, 3D] (tokens[:40] run by the target) and "
            "x_n = tokens[40]; fp32, mlx-lm 0.32.2 target, weights as stored (bf16)",
        },
    )
    summary = {
        "seed": SEED,
        "config": CONFIG,
        "parameters": n_params,
        "sequences": args.sequences,
        "prompt_len": P,
        "gen": G,
        "temperatures": "even batches greedy, odd batches 0.7",
        "steps": args.steps,
        "batch": args.batch,
        "anchors_per_sequence": args.anchors,
        "lr": args.lr,
        "slot_weights": "0.85**i, normalized",
        "final": dict(zip(["step", "train_loss", *[f"eval_ce_slot{i}" for i in range(K)], "eval_greedy_tokens_per_cycle"], rows[-1])),
        "data_seconds": round(t_data, 1),
        "total_seconds": round(t_total, 1),
        "blas": BLAS,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["final"]), f"total {t_total:.0f}s")


if __name__ == "__main__":
    main()
