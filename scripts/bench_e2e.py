"""End-to-end decode/prefill benchmark: mlx-k3 against mlx-lm on the same mid-size Kimi K3 checkpoint, on the
same machine, in one run.

1. Builds (once, seeded, with mlx-lm's own classes and `quantize_model`) a mid-size K3 configuration with
   random weights: hidden 2048, 12 layers (9 KDA, 3 MLA: layers 4, 8, 12), dense layer 0, then latent MoE
   with 128 experts top-8 through a 1024 latent, moe_intermediate 512, 2 shared experts, vocab 32000,
   attention residuals in blocks of 4. Quantization: routed experts affine 2-bit (group 64); router 8-bit
   (group 64, kimi_k3's own rule); embeddings 6-bit; every other linear 8-bit (group 64); attention-
   residual projections float (kimi_k3's rule). f32 weights and scales (the CPU activation dtype of both
   engines). Written under target/ (about 1 GB; never committed).
2. Measures memory read bandwidth with `mlx-k3 bench --bandwidth` (a streaming read over 1 GiB, all threads),
   before and after the mlx-k3 run; the bandwidth limit uses the higher of the two.
3. mlx-lm: `load_model`, a warm-up generation, then `generate_step` (greedy) on a 512-token random prompt:
   time to first token (= the whole prefill), prefill tok/s, decode tok/s over the generated tokens,
   MLX peak memory.
4. mlx-k3: `mlx-k3 bench --model DIR --json` (the same measurements through mlx-k3's generation loop, plus
   bytes of weights read per decoded token).
5. Prints a table and the ratios; writes them to DIR/results.json.

6. With --codebook-experts: the same checkpoint with its routed experts in the ternary codebook
   (`build_codebook`, OUT-codebook), mlx-k3 only, once per codebook layout in memory (compact, ternary).

Run: .venv/bin/python scripts/bench_e2e.py [--gen-tokens 32] [--prompt-tokens 512] [--out target/bench-k3-mid]
[--codebook-experts]
(builds mlx-k3 in release mode first; --no-build uses $MLX_K3_EXE or $CARGO_TARGET_DIR/release/mlx-k3;
--model DIR benchmarks an existing checkpoint, e.g. models/k3-nano, instead of the mid-size one).
"""

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
SEED = 20260

TEXT = {
    "model_type": "kimi_k3",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
    "rms_norm_eps": 1e-5,
    "linear_attn_config": {
        "num_heads": 16,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
        "full_attn_layers": [4, 8, 12],
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": False,
    },
    "activation_situ_beta": 1.0,
    "activation_situ_linear_beta": 8.0,
    "attn_res_block_size": 4,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_output_gate": True,
    "num_experts": 128,
    "num_experts_per_token": 8,
    "num_shared_experts": 2,
    "moe_intermediate_size": 512,
    "routed_scaling_factor": 2.827,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "routed_expert_hidden_size": 1024,
    "latent_moe_use_norm": True,
    "tie_word_embeddings": False,
}


def predicate(path: str, module):
    """Experts 2-bit, router 8-bit (kimi_k3's rule), embeddings 6-bit, res projections float, the rest 8-bit."""
    if path.endswith("res_proj"):
        return False
    if ".switch_mlp." in path:
        return {"group_size": 64, "bits": 2, "mode": "affine"}
    if path.endswith("embed_tokens"):
        return {"group_size": 64, "bits": 6, "mode": "affine"}
    return {"group_size": 64, "bits": 8, "mode": "affine"}


def init_value(path: str, shape, heads: int, kv_lora: int):
    if path.endswith("A_log"):
        return mx.log(mx.random.uniform(1.0, 8.0, (heads,)))
    if path.endswith("dt_bias"):
        return mx.random.uniform(-3.0, 0.0, shape)
    if path.endswith("e_score_correction_bias"):
        return 0.05 * mx.random.normal(shape)
    owner = path.rsplit(".", 2)[-2] if path.endswith(".weight") else path.rsplit(".", 1)[-1]
    if "norm" in owner:
        return 1.0 + 0.05 * mx.random.normal(shape)
    if path.endswith("conv.weight"):
        return mx.random.normal(shape) * (1.0 / np.sqrt(shape[1]))
    if path.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0.3 * mx.random.normal(shape)
    if path.endswith("res_proj.weight"):
        return mx.random.normal(shape) * (1.5 / np.sqrt(shape[-1]))
    if path.endswith(("embed_q.weight", "unembed_out.weight")):
        return mx.random.normal(shape) * (1.0 / np.sqrt(kv_lora))
    if path.endswith("mlp.gate.weight"):
        return mx.random.normal(shape) * (1.5 / np.sqrt(shape[-1]))
    return mx.random.normal(shape) * (1.0 / np.sqrt(shape[-1]))


def build(out: Path) -> None:
    from mlx_lm.models import kimi_k3
    from mlx_lm.utils import quantize_model, save_config, save_model

    mx.random.seed(SEED)
    config = copy.deepcopy(TEXT)
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(copy.deepcopy(config)))
    heads = TEXT["linear_attn_config"]["num_heads"]
    new = [
        (p, init_value(p, w.shape, heads, TEXT["kv_lora_rank"]).astype(mx.float32))
        for p, w in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    ]
    model.load_weights(new, strict=True)
    del new
    model, qconfig = quantize_model(model, config, 64, 8, mode="affine", quant_predicate=predicate)
    # Materialize one layer at a time so the f32 sources of at most one layer are alive.
    for i, layer in enumerate(model.layers):
        mx.eval(layer.parameters())
        print(f"  layer {i} quantized", flush=True)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(copy.deepcopy(qconfig), config_path=out / "config.json")
    (out / "BUILT").write_text(json.dumps({"seed": SEED, "text": TEXT}, indent=1))


def build_codebook(src: Path, out: Path) -> None:
    """The mid-size checkpoint with every routed expert stack in the ternary codebook format (IQ1_S bits in
    mlx-k3's planes, docs/formats.md): random bits, as the affine checkpoint's weights are random; scales
    drawn so a weight's magnitude is about 1/sqrt(K), as `init_value` draws the float weights. Everything
    else is the affine checkpoint's, tensor for tensor. mlx-lm cannot load this format, so only mlx-k3 runs
    it (once per codebook layout in memory)."""
    rng = np.random.default_rng(SEED + 1)
    cfg = json.loads((src / "config.json").read_text())
    q = cfg["quantization"]
    out.mkdir(parents=True, exist_ok=True)
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        w = mx.load(str(f))
        new = {}
        for k in sorted(w):
            path, field = k.rsplit(".", 1)
            if ".switch_mlp." not in path:
                new[k] = w[k]
                continue
            if field != "weight":
                continue  # the affine scales and biases go with the affine weight
            e, n = w[k].shape[:2]
            assert path + ".scales" in w, f"{path}: its scales are in another shard"
            kdim = w[path + ".scales"].shape[-1] * q[path]["group_size"]
            assert kdim % 32 == 0, (path, kdim)
            # d * (2L + 1) with L uniform in 0..7 averages 8 d; a grid value is -1, 0 or +1.
            d = (1.0 / (8.0 * np.sqrt(kdim))) * (1.0 + 0.1 * rng.standard_normal((e, n, -(-kdim // 256))))
            new[path + ".codes"] = mx.array(rng.integers(0, 256, (e, n, kdim // 8), dtype=np.uint8))
            new[path + ".qh"] = mx.array(rng.integers(0, 1 << 16, (e, n, kdim // 32), dtype=np.uint16))
            new[path + ".scales"] = mx.array(d.astype(np.float16))
            q[path] = {"mode": "k3_codebook"}
        mx.save_safetensors(str(out / f.name), new, metadata={"format": "mlx"})
        weight_map.update({k: f.name for k in new})
        del w, new
    if index is not None:
        index["weight_map"] = dict(sorted(weight_map.items()))
        index.pop("metadata", None)
        (out / index_path.name).write_text(json.dumps(index, indent=1))
    if "quantization_config" in cfg:  # mlx-lm writes both keys
        cfg["quantization_config"] = q
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "BUILT").write_text(json.dumps({"from": str(src), "seed": SEED + 1, "experts": "k3_codebook"}))


def bench_mlx_lm(model_dir: Path, prompt_tokens: int, gen_tokens: int) -> dict:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    # MLX's CPU GatherMM takes float32 only, so half-precision checkpoints (e.g. k3-nano, bf16) run in f32
    # under mlx-lm on the CPU (mlx-k3 casts just the expert matmuls; noted in the result).
    cast = any(v.dtype in (mx.bfloat16, mx.float16) for _, v in tree_flatten(model.parameters()))
    if cast:
        model.set_dtype(mx.float32)
    rng = np.random.default_rng(7)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or TEXT["vocab_size"]
    # Warm-up: a short prompt and a few steps (graph compilation, allocator).
    warm = mx.array(rng.integers(0, vocab, 16), dtype=mx.int32)
    for _, _ in zip(range(4), generate_step(warm, model, max_tokens=4)):
        pass
    prompt = mx.array(rng.integers(0, vocab, prompt_tokens), dtype=mx.int32)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    t_first = None
    n = 0
    for token, _ in generate_step(prompt, model, max_tokens=gen_tokens):
        int(token)  # the host reads each token, as a detokenizer would
        if t_first is None:
            t_first = time.perf_counter()
        n += 1
    t_end = time.perf_counter()
    ttft = t_first - tic
    return {
        "engine": "mlx-lm",
        "cast_to_float32": cast,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": n,
        "time_to_first_token_s": ttft,
        "prefill_tok_s": prompt_tokens / ttft,
        "decode_tok_s": (n - 1) / (t_end - t_first),
        "peak_memory_bytes": mx.get_peak_memory(),
    }


def run_k3(args: list, layout: str | None = None) -> dict:
    exe = Path(os.environ.get("MLX_K3_EXE") or Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mlx-k3")
    env = dict(os.environ)
    if layout:
        env["K3_CODEBOOK_LAYOUT"] = layout
    out = subprocess.run([str(exe), "bench", *args, "--json"], check=True, capture_output=True, text=True, env=env)
    sys.stderr.write(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "target" / "bench-k3-mid"))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--model", help="benchmark this existing checkpoint instead of building the mid-size one")
    ap.add_argument("--codebook-experts", action="store_true",
                    help="also build the mid-size checkpoint with its routed experts in the ternary codebook "
                         "(OUT-codebook) and run mlx-k3 on it with each codebook layout in memory")
    ap.add_argument("--no-build", action="store_true",
                    help="use the mlx-k3 binary already built ($MLX_K3_EXE, else $CARGO_TARGET_DIR/release/mlx-k3)")
    args = ap.parse_args()
    out = Path(args.model or args.out)
    if not args.model and not (out / "BUILT").exists():
        print(f"building the mid-size checkpoint in {out} ...", flush=True)
        t = time.time()
        build(out)
        print(f"built in {time.time() - t:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"checkpoint: {out} ({size / 1e9:.2f} GB)", flush=True)

    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "-j2", "-p", "mlx-k3", "--bin", "mlx-k3"], cwd=ROOT, check=True)
    bw = run_k3(["--bandwidth"])
    print(f"memory read bandwidth: {bw['read_bandwidth_gb_s']:.2f} GB/s ({bw['threads']} threads)", flush=True)
    k3 = run_k3(["--model", str(out), "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)])
    print(f"mlx-k3: {json.dumps(k3)}", flush=True)
    # The bandwidth drifts on shared machines: the limit uses the better of the measurements around the run.
    bw_after = run_k3(["--bandwidth"])
    print(f"memory read bandwidth after: {bw_after['read_bandwidth_gb_s']:.2f} GB/s", flush=True)
    if bw_after["read_bandwidth_gb_s"] > bw["read_bandwidth_gb_s"]:
        bw = bw_after
    lm = None if args.skip_mlx_lm else bench_mlx_lm(out, args.prompt_tokens, args.gen_tokens)
    if lm:
        print(f"mlx-lm: {json.dumps(lm)}", flush=True)

    bytes_tok = k3["bytes_read_per_token"]
    limit = bw["read_bandwidth_gb_s"] * 1e9 / bytes_tok
    rows = [("decode tok/s", "decode_tok_s"), (f"prefill tok/s ({args.prompt_tokens})", "prefill_tok_s"),
            ("time to first token (s)", "time_to_first_token_s"), ("peak memory (GB)", "peak_memory_bytes")]
    print()
    print(f"machine: {platform.machine()} {os.cpu_count()} threads; {platform.platform()}")
    print(f"{'':28} {'mlx-k3':>12} {'mlx-lm':>12} {'ratio':>8}")
    for name, key in rows:
        a = k3[key] / (1e9 if key == "peak_memory_bytes" else 1)
        b = lm[key] / (1e9 if key == "peak_memory_bytes" else 1) if lm else float("nan")
        print(f"{name:28} {a:12.3f} {b:12.3f} {a / b if lm else float('nan'):8.2f}")
    print(f"bytes read per decoded token: {bytes_tok / 1e6:.1f} MB; bandwidth limit {limit:.1f} tok/s; "
          f"mlx-k3 reaches {100 * k3['decode_tok_s'] / limit:.0f}% of it")
    result = {"bandwidth": bw, "mlx_k3": k3, "mlx_lm": lm, "bandwidth_limit_tok_s": limit,
              "machine": {"machine": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform()}}
    if args.codebook_experts and not args.model:
        cb = Path(str(out) + "-codebook")
        if not (cb / "BUILT").exists():
            print(f"building the codebook-experts variant in {cb} ...", flush=True)
            build_codebook(out, cb)
        size = sum(f.stat().st_size for f in cb.glob("*.safetensors"))
        print(f"codebook-experts checkpoint: {cb} ({size / 1e9:.2f} GB)", flush=True)
        result["codebook_experts"] = {}
        for layout in ("compact", "ternary"):
            r = run_k3(["--model", str(cb), "--prompt-tokens", str(args.prompt_tokens),
                        "--gen-tokens", str(args.gen_tokens)], layout)
            b = run_k3(["--bandwidth"])["read_bandwidth_gb_s"]
            lim = max(b, bw["read_bandwidth_gb_s"]) * 1e9 / r["bytes_read_per_token"]
            print(f"codebook experts, {layout} layout: decode {r['decode_tok_s']:.2f} tok/s, prefill "
                  f"{r['prefill_tok_s']:.1f} tok/s, {r['bytes_read_per_token'] / 1e6:.1f} MB read per token, "
                  f"limit {lim:.1f} tok/s: {100 * r['decode_tok_s'] / lim:.0f}% of it", flush=True)
            result["codebook_experts"][layout] = {"mlx_k3": r, "bandwidth_after_gb_s": b, "bandwidth_limit_tok_s": lim}
    (Path(args.out) / "results.json").parent.mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
