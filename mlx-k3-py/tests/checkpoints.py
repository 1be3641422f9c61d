"""Test checkpoints made from k3-nano (the project's trained Kimi K3-architecture model).

k3-nano's experts are narrower than one codebook super-block (expert input dims 128 and 32; the format takes
them as short super-blocks, but these checkpoints exercise full 256-weight IQ1_S super-blocks, the layout of
imported GGUF weights), so :func:`widen` pads them to 256 with zeros: the latent down-projection gains zero
rows, the experts and shared experts zero rows and columns, the latent up-projection zero columns, and the
latent RMSNorm's scale is divided by sqrt(2) (the mean square over twice the dims halves). The widened model
computes what k3-nano computes (up to the norm's epsilon) and is still a trained model, so greedy decoding
is decisive, not a coin toss between near-equal logits.

The codebook and tiered checkpoints are float32 (the Rust engine's CPU default), in mlx-lm's format and
names, with k3-nano's Kimi tiktoken tokenizer plus a tokenizer.json for mlx-lm
(:func:`mlx_k3.tokenizer.write_tokenizer_json`). :func:`mlx_quantized` is k3-nano quantized by mlx-lm's own
``quantize_model`` (affine, MXFP4), kept in bf16 as ``mlx_lm.convert`` would, with k3-nano's tokenizer files
only (no tokenizer.json, as k3-nano itself).
"""

import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

import mlx_k3
from mlx_k3.tokenizer import write_tokenizer_json

ROOT = Path(__file__).resolve().parents[2]
K3_NANO = ROOT / "models" / "k3-nano"
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "generation_config.json")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
WIDE = 256
# Tiers of the 16 experts in the tiered checkpoint (0 codebook, 1 mxfp4, 2 affine), interleaved.
TIERS = [(3 * e + 1) % 4 % 3 for e in range(16)]
AFFINE = {"group_size": 64, "bits": 4}


def _config():
    return json.loads((K3_NANO / "config.json").read_text())


def _weights():
    return {k: v.astype(mx.float32) for k, v in mx.load(str(K3_NANO / "model.safetensors")).items()}


def _moe_layers(cfg):
    tc = cfg["text_config"]
    first, freq = tc["first_k_dense_replace"], tc["moe_layer_freq"]
    return [i for i in range(tc["num_hidden_layers"]) if i >= first and (i - first) % freq == 0]


def _save(dst: Path, weights, cfg, tokenizer_json: bool = True) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(K3_NANO / name, dst / name)
    if tokenizer_json:
        write_tokenizer_json(dst)
    return dst


def _pad(a, shape):
    return mx.pad(a, [(0, n - m) for m, n in zip(a.shape, shape)])


def widen(weights, cfg):
    """k3-nano with expert dims (latent and intermediate) padded to 256; same function (see module doc)."""
    tc = cfg["text_config"]
    latent, inter, shared = tc["routed_expert_hidden_size"], tc["moe_intermediate_size"], tc["num_shared_experts"]
    hidden, experts = tc["hidden_size"], tc["num_experts"]
    w = dict(weights)
    for i in _moe_layers(cfg):
        p = f"language_model.model.layers.{i}.mlp"
        w[f"{p}.routed_expert_down_proj.weight"] = _pad(w[f"{p}.routed_expert_down_proj.weight"], (WIDE, hidden))
        w[f"{p}.routed_expert_up_proj.weight"] = _pad(w[f"{p}.routed_expert_up_proj.weight"], (hidden, WIDE))
        norm = w[f"{p}.routed_expert_norm.weight"] / math.sqrt(WIDE / latent)
        w[f"{p}.routed_expert_norm.weight"] = _pad(norm, (WIDE,))
        for proj in ("gate_proj", "up_proj"):
            w[f"{p}.switch_mlp.{proj}.weight"] = _pad(w[f"{p}.switch_mlp.{proj}.weight"], (experts, WIDE, WIDE))
            w[f"{p}.shared_experts.{proj}.weight"] = _pad(w[f"{p}.shared_experts.{proj}.weight"], (WIDE * shared, hidden))
        w[f"{p}.switch_mlp.down_proj.weight"] = _pad(w[f"{p}.switch_mlp.down_proj.weight"], (experts, WIDE, WIDE))
        w[f"{p}.shared_experts.down_proj.weight"] = _pad(w[f"{p}.shared_experts.down_proj.weight"], (hidden, WIDE * shared))
    assert inter <= WIDE and latent <= WIDE
    cfg = json.loads(json.dumps(cfg))
    cfg["text_config"]["routed_expert_hidden_size"] = WIDE
    cfg["text_config"]["moe_intermediate_size"] = WIDE
    return w, cfg


def _expert_paths(cfg):
    for i in _moe_layers(cfg):
        for proj in PROJECTIONS:
            yield f"language_model.model.layers.{i}.mlp.switch_mlp.{proj}"


def plain(dst: Path) -> Path:
    """k3-nano in float32: a plain checkpoint (mlx-lm's own classes load it)."""
    return _save(dst, _weights(), _config())


def codebook(dst: Path, ref: Path, wide: bool = True):
    """The widened model with every routed expert stack in the codebook format (``dst``), and the same
    model with those stacks decoded back to float32 (``ref``: a plain checkpoint computing the same).
    ``wide=False``: k3-nano as it is, its experts' rows ending in short super-blocks (K = 128 and 32)."""
    w, cfg = widen(_weights(), _config()) if wide else (_weights(), _config())
    wq, wr = dict(w), dict(w)
    records = {}
    for path in _expert_paths(cfg):
        codes, qh, scales = mlx_k3.codebook_quantize(wq.pop(f"{path}.weight"))
        wq.update({f"{path}.codes": codes, f"{path}.qh": qh, f"{path}.scales": scales})
        wr[f"{path}.weight"] = mlx_k3.codebook_dequantize(codes, qh, scales)
        records[path] = {"mode": "k3_codebook"}
    cfg_q = dict(cfg, quantization=records)
    return _save(dst, wq, cfg_q), _save(ref, wr, cfg)


def tiered(dst: Path, ref: Path):
    """The widened model with every routed expert stack tiered (:data:`TIERS`: codebook, mxfp4 and affine
    4-bit experts interleaved), and its float32 reference as for :func:`codebook`."""
    w, cfg = widen(_weights(), _config())
    wq, wr = dict(w), dict(w)
    records = {}
    for path in _expert_paths(cfg):
        stack = mlx_k3.tiered_quantize(wq.pop(f"{path}.weight"), TIERS, AFFINE["group_size"], AFFINE["bits"])
        wq.update({f"{path}.{k}": v for k, v in stack.items()})
        wr[f"{path}.weight"] = mlx_k3.tiered_dequantize(
            stack["tier"],
            stack["slot"],
            codes=stack.get("codebook.codes"),
            qh=stack.get("codebook.qh"),
            scales=stack.get("codebook.scales"),
            mxfp4_weight=stack.get("mxfp4.weight"),
            mxfp4_scales=stack.get("mxfp4.scales"),
            affine_weight=stack.get("affine.weight"),
            affine_scales=stack.get("affine.scales"),
            affine_biases=stack.get("affine.biases"),
            affine_group_size=AFFINE["group_size"],
            affine_bits=AFFINE["bits"],
        )
        records[path] = {"mode": "k3_tiered", "affine": dict(AFFINE)}
    cfg_q = dict(cfg, quantization=records)
    return _save(dst, wq, cfg_q), _save(ref, wr, cfg)


def wide_dense(dst: Path) -> Path:
    """The widened model before quantization (checks that widening keeps k3-nano's function)."""
    w, cfg = widen(_weights(), _config())
    return _save(dst, w, cfg)


def mlx_quantized(dst: Path, mode: str, bits: int, group_size: int) -> Path:
    """k3-nano (bf16) quantized by mlx-lm's ``quantize_model`` on mlx-lm's own classes, as ``mlx_lm.convert
    -q`` quantizes it (its quant_predicate keeps the router at 8 bits, group 64, affine), saved with the
    config mlx-lm writes. k3-nano's experts have 32 inputs (down_proj), so groups of 32 reach every layer."""
    from mlx_lm.utils import quantize_model

    from mlx_k3.models import kimi_k3 as drop_in

    cfg = _config()
    model = drop_in.MlxLmModel(drop_in.MlxLmModelArgs.from_dict(cfg))
    weights = model.sanitize(mx.load(str(K3_NANO / "model.safetensors")))
    model.load_weights(list(weights.items()))
    model, cfg = quantize_model(model, cfg, group_size, bits, mode=mode)
    return _save(dst, dict(tree_flatten(model.parameters())), cfg, tokenizer_json=False)
