"""Train k3-nano: a small Kimi K3-architecture model (mlx-lm's own `kimi_k3` classes) on the Python standard
library's sources and docs, with a Kimi-style tiktoken tokenizer trained on the same data.

    .venv/bin/python scripts/k3_nano/train.py            # everything, ~40 min on a 2-core x86 CPU
    .venv/bin/python scripts/k3_nano/train.py --steps 20 --out /tmp/k3n   # a quick smoke run

Stages (all seeded; see models/k3-nano/README.md for the results):
  1. corpus: data.py's file selection from the running interpreter's stdlib, split by file;
  2. tokenizer: byte-level BPE (bpe.py) with Kimi's pattern and special-token layout -> tiktoken.model,
     tokenizer_config.json, generation_config.json; checked: tiktoken built from the written files encodes
     every file exactly like the independent Python encoder, and decode(encode(x)) == x on both splits;
  3. token streams: [BOS] text [EOS] per file; the held-out stream is saved to heldout.safetensors;
  4. model: mlx_lm.models.kimi_k3.Model with common.TEXT_CONFIG, trained with AdamW, warmup + cosine,
     fp32, on random windows of the training stream; router bias by an aux-loss-free update (below);
     KDA's recurrence computed chunk-parallel (kda_chunked.py, checked against mlx-lm's loop at start);
  5. checkpoint: bf16 (A_log, dt_bias, e_score_correction_bias fp32, mlx-lm's cast_predicate) via
     mlx_lm.utils.save_model / save_config; reloaded with mlx_lm.utils.load_model and compared;
  6. loss.csv, loss.png, samples.txt, train_summary.json.

Router bias (`e_score_correction_bias`): it only shifts WHICH experts are selected (the mixing weights use
the unbiased sigmoid scores), so it gets no gradient. It is frozen for the optimizer and updated after every
step by the auxiliary-loss-free rule of DeepSeek-V3: b_e += BIAS_RATE * sign(mean_load - load_e), with load_e
the number of (token, slot) picks of expert e in that layer in that batch.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.check_pins()
BLAS = common.maybe_reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map_with_path  # noqa: E402
from mlx_lm.models import kimi_k3  # noqa: E402
from mlx_lm.utils import load_model, save_config, save_model  # noqa: E402

import bpe  # noqa: E402
import data  # noqa: E402
import kda_chunked  # noqa: E402
from infer import load_encoding, sample  # noqa: E402

SEED = 20260509
SEQ_LEN = 256  # tokens per training window (the model's trained context)
BATCH = 8
STEPS = 660
PEAK_LR = 2e-3
MIN_LR = 2e-4
WARMUP = 40
WEIGHT_DECAY = 0.1  # on matrices (ndim >= 2) only
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
BIAS_RATE = 2e-3
LOG_EVERY = 10
EVAL_EVERY = 40
EVAL_WINDOWS = 32  # the first 32 non-overlapping SEQ_LEN windows of the held-out stream, during training

# No trailing spaces: Kimi's pattern splits "def " into "def" + " ", and a lone " " token is followed by a
# number in the training data (" 0" is " " + "0"), so a prompt ending in a space asks for a number.
SAMPLE_PROMPTS = [
    "import os\nimport sys\n\n\ndef",
    "def",
    "class",
    "    def __init__(self,",
    "The",
]
SAMPLE_TOKENS = 120


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ---------------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------------


def build_tokenizer(out: Path, root: Path, train_files, held_files):
    pat = bpe.compile_pattern(common.PAT_STR)
    counts = bpe.chunk_counts((data.read(root, r) for r in train_files), pat)
    log(f"bpe: {len(counts)} distinct pre-tokenized chunks, {sum(counts.values())} in all")
    vocab = bpe.train(counts, common.NUM_BASE_TOKENS, log=log)
    bpe.write_tiktoken(vocab, out / "tiktoken.model")

    specials = common.special_tokens()
    inv = {i: s for s, i in specials.items()}
    bos, eos, im_end = specials["[BOS]"], specials["[EOS]"], specials["<|im_end|>"]
    added = {
        str(i): {
            "content": inv[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i in sorted(inv)
    }
    tok_cfg = {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"],
        "add_bos_token": True,  # documents were trained as [BOS] text [EOS]
        "add_eos_token": False,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": common.TEXT_CONFIG["max_position_embeddings"],
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    gen_cfg = {"bos_token_id": bos, "eos_token_id": [eos, im_end], "pad_token_id": specials["[PAD]"]}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    # Rebuild the encoding from the files alone, as a consumer would.
    enc = load_encoding(out)
    ranks = bpe.load_tiktoken(out / "tiktoken.model")
    assert sorted(ranks.values()) == list(range(len(ranks))), "ranks must be 0..N-1"
    assert all(bytes([b]) in ranks for b in range(256)), "all single bytes must be tokens"
    mismatched = 0
    for split_name, rels in (("train", train_files), ("heldout", held_files)):
        for rel in rels:
            text = data.read(root, rel)
            ids = enc.encode_ordinary(text)
            if ids != bpe.encode_reference(text, ranks, pat):
                mismatched += 1
                log(f"tiktoken and the reference encoder disagree on {rel}")
            if enc.decode(ids) != text:
                raise SystemExit(f"decode(encode(x)) != x for {split_name} file {rel}")
    if mismatched:
        raise SystemExit(f"{mismatched} files encode differently with tiktoken and the reference encoder")
    log(f"tokenizer: {len(vocab)} base tokens + {len(specials)} special = {len(vocab) + len(specials)}; "
        "tiktoken == reference encoder and decode(encode(x)) == x on every train and held-out file")
    return enc, specials


def token_stream(enc, root, rels, bos, eos) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated [BOS] text [EOS] documents (sorted by path) and each document's start offset."""
    parts, starts, n = [], [], 0
    for rel in rels:
        ids = [bos] + enc.encode_ordinary(data.read(root, rel)) + [eos]
        starts.append(n)
        parts.append(np.asarray(ids, dtype=np.int32))
        n += len(ids)
    return np.concatenate(parts), np.asarray(starts, dtype=np.int32)


# ---------------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------------

_RECORD: list | None = None
_ORIG_SELECT = kimi_k3._group_expert_select


def _recording_select(*args):
    inds, w = _ORIG_SELECT(*args)
    if _RECORD is not None:
        _RECORD.append(inds)
    return inds, w


kimi_k3._group_expert_select = _recording_select


def moe_layers(model):
    return [l.mlp for l in model.layers if isinstance(l.mlp, kimi_k3.KimiK3SparseMoE)]


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, steps - WARMUP)
    return MIN_LR + 0.5 * (PEAK_LR - MIN_LR) * (1 + math.cos(math.pi * min(1.0, t)))


def eval_loss(model, windows: np.ndarray, batch: int = 16) -> float:
    """Mean next-token cross-entropy over windows [n, L+1]."""
    tot, cnt = 0.0, 0
    for i in range(0, len(windows), batch):
        w = mx.array(windows[i : i + batch])
        logits = model(w[:, :-1])
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), w[:, 1:], reduction="sum")
        tot += ce.item()
        cnt += w.shape[0] * (w.shape[1] - 1)
    return tot / cnt


def write_samples(model, enc, bos, stop_ids, out: Path):
    samples = []
    for i, p in enumerate(SAMPLE_PROMPTS):
        for temp in (0.0, 0.7):
            s = sample(model, enc, p, bos, stop_ids, SAMPLE_TOKENS, temp, SEED + i)
            samples.append({"prompt": p, "temperature": temp, "seed": SEED + i, "text": s})
            log(f"sample (temp {temp}) {p!r}:\n{s}\n" + "-" * 60)
    with open(out / "samples.txt", "w") as f:
        f.write("# scripts/k3_nano/train.py (or train.py --samples-only): infer.sample() with the checkpoint loaded by\n"
                f"# mlx_lm.utils.load_model, upcast to fp32; [BOS] + prompt, up to {SAMPLE_TOKENS} new tokens, stop at\n"
                "# [EOS] / <|im_end|>; temperature 0 = greedy, else mx.random.categorical(logits / T) seeded.\n\n")
        for s in samples:
            f.write(f"=== prompt {s['prompt']!r}, temperature {s['temperature']}, seed {s['seed']} ===\n{s['text']}\n\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=common.OUT)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--samples-only", action="store_true", help="only rewrite samples.txt from the saved checkpoint")
    ap.add_argument("--tokenizer-only", action="store_true", help="stop after the corpus, tokenizer and held-out stream")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    if args.samples_only:
        enc = load_encoding(out)
        gen = json.loads((out / "generation_config.json").read_text())
        loaded, _ = load_model(out)
        loaded.set_dtype(mx.float32)
        write_samples(loaded, enc, gen["bos_token_id"], set(gen["eos_token_id"]), out)
        return
    log(f"k3-nano: python {platform.python_version()}, mlx {mx.__version__}, BLAS: {BLAS}")

    # 1. corpus ------------------------------------------------------------------------------------------
    root = data.stdlib_dir()
    files = data.select_files(root)
    train_files, held_files = data.split(root, files)
    man = data.manifest(root, train_files, held_files)
    (out / "data_manifest.json").write_text(
        json.dumps({"python": platform.python_version(), "stdlib": str(root), "files": man}, indent=0, separators=(",", ":")) + "\n"
    )
    log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files from {root}")

    # 2. tokenizer ---------------------------------------------------------------------------------------
    enc, specials = build_tokenizer(out, root, train_files, held_files)
    bos, eos = specials["[BOS]"], specials["[EOS]"]
    stop_ids = {eos, specials["<|im_end|>"]}

    # 3. token streams -----------------------------------------------------------------------------------
    train_ids, _ = token_stream(enc, root, train_files, bos, eos)
    held_ids, held_starts = token_stream(enc, root, held_files, bos, eos)
    mx.save_safetensors(
        str(out / "heldout.safetensors"),
        {"tokens": mx.array(held_ids), "doc_starts": mx.array(held_starts)},
        metadata={"files": json.dumps(held_files), "format": "[BOS] text [EOS] per file, files in this order"},
    )
    log(f"tokens: train {len(train_ids)}, held-out {len(held_ids)}")
    L = SEQ_LEN
    if args.tokenizer_only:
        return
    n_eval = min(EVAL_WINDOWS, (len(held_ids) - 1) // L)
    eval_windows = np.stack([held_ids[i * L : i * L + L + 1] for i in range(n_eval)])

    # 4. model -------------------------------------------------------------------------------------------
    kda_chunked.install()
    chk = kda_chunked.self_test()
    log(f"chunked KDA vs mlx-lm loop (max abs diff): {json.dumps(chk)}")
    for v in chk.values():
        assert v["y"] < 1e-5 and v["state"] < 1e-4 and v["grad"] < 1e-3, chk

    mx.random.seed(SEED)
    rng = np.random.default_rng(SEED)
    config = common.model_config()
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(config))
    for moe in moe_layers(model):
        moe.freeze(keys=["e_score_correction_bias"], recurse=False)
    model.train()
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    n_train = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    log(f"model: {n_params} parameters ({n_train} trainable)")

    decay = optim.AdamW(learning_rate=PEAK_LR, betas=list(BETAS), weight_decay=WEIGHT_DECAY)
    no_decay = optim.AdamW(learning_rate=PEAK_LR, betas=list(BETAS), weight_decay=0.0)
    opt = optim.MultiOptimizer([decay, no_decay], [lambda path, p: p.ndim >= 2])

    E = config["text_config"]["num_experts"]

    def loss_fn(m, x, y):
        global _RECORD
        _RECORD = []
        logits = m(x)
        loss = nn.losses.cross_entropy(logits, y).mean()
        recs, _RECORD = _RECORD, None
        loads = mx.stack([(r.reshape(-1)[:, None] == mx.arange(E)).sum(axis=0) for r in recs])
        return loss, loads

    grad_fn = nn.value_and_grad(model, loss_fn)

    # parameters that get no gradient (checked once, on the first batch)
    def batch():
        starts = rng.integers(0, len(train_ids) - L - 1, size=BATCH)
        w = np.stack([train_ids[s : s + L + 1] for s in starts])
        return mx.array(w[:, :-1]), mx.array(w[:, 1:])

    rows = []
    csv_path = out / "loss.csv"
    fcsv = open(csv_path, "w", newline="")
    wr = csv.writer(fcsv)
    wr.writerow(["step", "tokens", "lr", "train_loss", "heldout_loss", "expert_load_max_over_mean", "elapsed_s"])
    t_train = time.time()
    acc_loss, acc_n = 0.0, 0
    zero_grad_params = None
    for step in range(args.steps):
        lr = lr_at(step, args.steps)
        decay.learning_rate = lr
        no_decay.learning_rate = lr
        x, y = batch()
        (loss, loads), grads = grad_fn(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, GRAD_CLIP)
        if zero_grad_params is None:
            mx.eval(grads)
            zero_grad_params = [k for k, g in tree_flatten(grads) if not bool(mx.any(g != 0).item())]
            log(f"parameters with an all-zero gradient on the first batch: {zero_grad_params or 'none'}")
        opt.update(model, grads)
        # aux-loss-free router balancing
        loads_f = loads.astype(mx.float32)
        mean = loads_f.mean(axis=1, keepdims=True)
        for i, moe in enumerate(moe_layers(model)):
            moe.e_score_correction_bias = moe.e_score_correction_bias + BIAS_RATE * mx.sign(mean[i] - loads_f[i])
        mx.eval(loss, model.parameters(), opt.state)
        acc_loss += loss.item()
        acc_n += 1
        imb = (loads_f.max(axis=1) / mean[:, 0]).mean().item()
        done = step + 1
        held = None
        if done % EVAL_EVERY == 0 or done == args.steps or done == 1:
            held = eval_loss(model, eval_windows)
        if done % LOG_EVERY == 0 or held is not None:
            tl = acc_loss / max(1, acc_n)
            row = [done, done * BATCH * L, f"{lr:.6g}", f"{tl:.5f}", "" if held is None else f"{held:.5f}",
                   f"{imb:.3f}", f"{time.time() - t_train:.1f}"]
            wr.writerow(row)
            fcsv.flush()
            rows.append(row)
            log(f"step {done}/{args.steps} lr {lr:.2e} train {tl:.4f}"
                + ("" if held is None else f" held-out {held:.4f}") + f" load max/mean {imb:.2f}"
                + f" ({time.time() - t_train:.0f}s)")
            acc_loss, acc_n = 0.0, 0
    fcsv.close()
    train_wall = time.time() - t_train
    log(f"training: {train_wall:.0f}s")

    # 5. checkpoint --------------------------------------------------------------------------------------
    kda_chunked.uninstall()
    model.eval()
    final_held_f32 = eval_loss(model, eval_windows)
    keep = model.cast_predicate
    model.update(tree_map_with_path(lambda p, v: v.astype(mx.bfloat16) if keep(p) and v.dtype == mx.float32 else v,
                                    model.parameters()))
    for l in model.layers:  # cached attention-residual projections were computed from fp32 weights
        if getattr(l, "use_attn_res", False):
            l._attn_res_w_eff = None
    model.model._output_res_w_eff = None
    save_model(out, model)
    save_config(config, out / "config.json")
    idx = out / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()  # one shard: the index only repeats the file name
    ckpt_bytes = (out / "model.safetensors").stat().st_size

    loaded, _ = load_model(out)
    dtypes = {str(v.dtype) for _, v in tree_flatten(loaded.parameters())}
    # MLX's CPU backend runs GatherMM (the routed experts) in fp32 only ("[GatherMM::eval] Currently only
    # supports float32"), so on a CPU the bf16 checkpoint is run upcast to fp32 (lossless).
    loaded.set_dtype(mx.float32)
    model.set_dtype(mx.float32)
    probe = mx.array(eval_windows[:2, :-1])
    diff = mx.abs(loaded(probe) - model(probe)).max().item()
    assert diff == 0.0, f"reloaded checkpoint differs from the in-memory model by {diff}"
    final_held_bf16 = eval_loss(loaded, eval_windows)
    log(f"checkpoint: {ckpt_bytes} bytes, dtypes {sorted(dtypes)}; load_model reproduces the logits exactly; "
        f"held-out ({n_eval} windows) fp32 weights {final_held_f32:.4f}, bf16 checkpoint {final_held_bf16:.4f}")

    # 6. samples, plot, summary --------------------------------------------------------------------------
    write_samples(loaded, enc, bos, stop_ids, out)

    plot(csv_path, out / "loss.png")
    final_train = float(rows[-1][3])
    summary = {
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs",
        "blas": BLAS,
        "versions": {d: __import__("importlib.metadata").metadata.version(d) for d in common.PINS},
        "seed": SEED,
        "steps": args.steps,
        "batch": BATCH,
        "seq_len": L,
        "tokens_seen": args.steps * BATCH * L,
        "train_tokens": int(len(train_ids)),
        "heldout_tokens": int(len(held_ids)),
        "train_files": len(train_files),
        "heldout_files": held_files,
        "params": n_params,
        "zero_grad_params_first_batch": zero_grad_params,
        "final_train_loss_last_10_steps": final_train,
        "heldout_loss_eval_windows_fp32": final_held_f32,
        "heldout_loss_eval_windows_bf16": final_held_bf16,
        "router_bias": {f"layer{i}": [round(v, 4) for v in m.e_score_correction_bias.tolist()]
                        for i, m in zip([j for j, l in enumerate(model.layers) if isinstance(l.mlp, kimi_k3.KimiK3SparseMoE)], moe_layers(loaded))},
        "last_batch_expert_load_max_over_mean": imb,
        "train_wall_s": round(train_wall, 1),
        "total_wall_s": round(time.time() - t_start, 1),
        "checkpoint_bytes": ckpt_bytes,
        "special_ids": {k: specials[k] for k in ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                                 "<|im_system|>", "<|im_middle|>", "[EOT]", "[UNK]", "[PAD]"]},
        "chunked_kda_check": chk,
        "model_safetensors_sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"done in {time.time() - t_start:.0f}s")


def plot(csv_path: Path, png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, tr, hs, hl = [], [], [], []
    with open(csv_path) as f:
        for r in csv.DictReader(f):
            steps.append(int(r["step"]))
            tr.append(float(r["train_loss"]))
            if r["heldout_loss"]:
                hs.append(int(r["step"]))
                hl.append(float(r["heldout_loss"]))
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
    ax.plot(steps, tr, label="train (mean of last 10 steps)", lw=1.2)
    ax.plot(hs, hl, "o-", label="held-out (32 x 256 tokens)", ms=3, lw=1.2)
    ax.set_xlabel("step (8 x 256 tokens)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("k3-nano training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


if __name__ == "__main__":
    main()
