"""Kimi K3 for mlx-lm with mlx-k3's expert formats: the drop-in model.

This is mlx-lm's own ``kimi_k3`` model (subclassed, not copied) with the layers that config.json gives an
mlx-k3 format replaced by layers that call mlx-k3's kernels:

- ``{"mode": "k3_codebook"}``: the ternary codebook (``P.codes`` uint8, ``P.qh`` uint16, ``P.scales`` f16),
  on an expert stack (``gather_codebook_qmm``) or a linear layer (``codebook_qmm``);
- ``{"mode": "k3_tiered", "affine": {...}}``: a mixed-format expert stack (``P.tier``, ``P.slot`` and the
  tiers' stacks ``P.codebook.*``, ``P.mxfp4.*``, ``P.affine.*``) through ``gather_tiered_qmm``;

and, in such a model, the routed experts' SiTU runs as mlx-k3's fused kernel. Attention, caches, routing,
generation and everything else is mlx-lm's code, so ``mlx_lm.generate``, ``stream_generate``, the server,
prompt caches, batching and perplexity work exactly as for any mlx-lm model. (A wrapper over the Rust
engine would have to re-implement mlx-lm's cache objects, which its server and prompt caching manipulate
directly; a model class keeps all of that and still runs the Rust kernels, zero-copy.)

:func:`install` (run by ``import mlx_k3``) makes ``mlx_lm.models.kimi_k3.Model`` / ``ModelArgs`` these
classes. :class:`Model` builds itself only when the config names an mlx-k3 format; for any other
checkpoint it returns mlx-lm's own ``Model``, untouched.
"""

import importlib
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchLinear

from .. import kernels

base = importlib.import_module("mlx_lm.models.kimi_k3")

# mlx-lm's classes, kept even if this module is imported again after install().
MlxLmModel = getattr(base, "_mlx_lm_Model", base.Model)
MlxLmModelArgs = getattr(base, "_mlx_lm_ModelArgs", base.ModelArgs)

K3_MODES = ("k3_codebook", "k3_tiered")
TIER_NAMES = ("codebook", "mxfp4", "affine")  # tier ids 0, 1, 2 in P.tier
TIER_TENSORS = {
    "codebook": ("codes", "qh", "scales"),
    "mxfp4": ("weight", "scales"),
    "affine": ("weight", "scales", "biases"),
}


def k3_formats(quantization: Optional[Dict[str, Any]]) -> Dict[str, dict]:
    """The entries of config.json's ``quantization`` that give a module an mlx-k3 format, keyed by the module's
    path in :class:`Model` (``language_model.model.layers.1.mlp.switch_mlp.up_proj``; config keys may omit
    the ``language_model.`` prefix, as mlx-k3's loader accepts)."""
    out = {}
    for key, record in (quantization or {}).items():
        if isinstance(record, dict) and record.get("mode") in K3_MODES:
            path = key if key.startswith("language_model.") else f"language_model.{key}"
            out[path] = record
    return out


class CodebookSwitchLinear(nn.Module):
    """An expert stack ``W [E, N, K]`` in the ternary codebook format, applied per routed expert with
    ``mlx_k3.gather_codebook_qmm`` (a drop-in for mlx-lm's ``SwitchLinear`` inside ``SwitchGLU``)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        if input_dims % 32:
            raise ValueError(f"the codebook format needs input dims divisible by 32, got {input_dims}")
        self.codes = mx.zeros((num_experts, output_dims, input_dims // 8), dtype=mx.uint8)
        self.qh = mx.zeros((num_experts, output_dims, input_dims // 32), dtype=mx.uint16)
        self.scales = mx.zeros((num_experts, output_dims, -(-input_dims // 256)), dtype=mx.float16)
        self.freeze()

    @property
    def input_dims(self) -> int:
        return self.codes.shape[-1] * 8

    @property
    def output_dims(self) -> int:
        return self.codes.shape[-2]

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]

    def __call__(self, x, indices, sorted_indices=False):
        return kernels.gather_codebook_qmm(
            x, self["codes"], self["qh"], self["scales"], rhs_indices=indices, sorted_indices=sorted_indices
        )

    def to_quantized(self, **kwargs):
        """Already in its format (mlx-lm calls this with the module's config.json entry)."""
        return self


class CodebookLinear(nn.Module):
    """A linear layer ``y = x @ W.T`` with ``W [N, K]`` in the ternary codebook format."""

    def __init__(self, input_dims: int, output_dims: int):
        super().__init__()
        if input_dims % 32:
            raise ValueError(f"the codebook format needs input dims divisible by 32, got {input_dims}")
        self.codes = mx.zeros((output_dims, input_dims // 8), dtype=mx.uint8)
        self.qh = mx.zeros((output_dims, input_dims // 32), dtype=mx.uint16)
        self.scales = mx.zeros((output_dims, -(-input_dims // 256)), dtype=mx.float16)
        self.freeze()

    def __call__(self, x):
        return kernels.codebook_qmm(x, self["codes"], self["qh"], self["scales"])

    def to_quantized(self, **kwargs):
        return self


class TieredSwitchLinear(nn.Module):
    """A mixed-format expert stack: expert ``e`` lives in tier ``tier[e]`` (0 codebook, 1 mxfp4, 2 affine) at
    ``slot[e]``; ``mlx_k3.gather_tiered_qmm`` runs each routed pair on its tier's kernel. The tiers' stack
    sizes come from the checkpoint (:meth:`attach`, called by :meth:`Model.sanitize`)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, affine: Optional[dict] = None):
        super().__init__()
        self.in_dims, self.out_dims, self.experts = input_dims, output_dims, num_experts
        affine = affine or {}
        self.affine_group_size = int(affine.get("group_size", 64))
        self.affine_bits = int(affine.get("bits", 4))
        self.tier = mx.zeros((num_experts,), dtype=mx.uint8)
        self.slot = mx.zeros((num_experts,), dtype=mx.uint32)
        self.freeze()

    @property
    def input_dims(self) -> int:
        return self.in_dims

    @property
    def output_dims(self) -> int:
        return self.out_dims

    @property
    def num_experts(self) -> int:
        return self.experts

    def attach(self, path: str, weights: Dict[str, mx.array]) -> None:
        """Sizes the tiers' stacks from the checkpoint's tensors under ``path`` and checks the tables."""
        for name in ("tier", "slot"):
            if f"{path}.{name}" not in weights:
                raise ValueError(f"config.json gives {path} the k3_tiered format but {path}.{name} is missing")
        counts = [0, 0, 0]
        for t, tier in enumerate(TIER_NAMES):
            names = TIER_TENSORS[tier]
            present = [n for n in names if f"{path}.{tier}.{n}" in weights]
            if not present:
                continue
            if tier != "affine" and len(present) != len(names) or tier == "affine" and len(present) < 2:
                raise ValueError(f"{path}.{tier}: expected tensors {names}, found {present}")
            arrays = {n: weights[f"{path}.{tier}.{n}"] for n in present}
            counts[t] = arrays[names[0]].shape[0]
            if tier == "affine":  # the packing tells group size and bits, as for mlx-lm's own layers
                self.affine_group_size = self.in_dims // arrays["scales"].shape[-1]
                self.affine_bits = arrays["weight"].shape[-1] * 32 // self.in_dims
            setattr(self, tier, {n: mx.zeros(a.shape, dtype=a.dtype) for n, a in arrays.items()})
        tier = np.array(weights[f"{path}.tier"]).astype(np.int64)
        slot = np.array(weights[f"{path}.slot"]).astype(np.int64)
        if tier.shape != (self.experts,) or slot.shape != (self.experts,):
            raise ValueError(f"{path}: tier and slot must have shape ({self.experts},)")
        for e, (t, s) in enumerate(zip(tier.tolist(), slot.tolist())):
            if t not in (0, 1, 2) or s >= counts[t]:
                raise ValueError(f"{path}: expert {e} is in tier {t} slot {s}, but that tier has {counts[t]} experts")
        self.freeze()

    def __call__(self, x, indices, sorted_indices=False):
        cb, fp, af = (self.get(name) for name in TIER_NAMES)
        return kernels.gather_tiered_qmm(
            x,
            self["tier"],
            self["slot"],
            codes=cb["codes"] if cb else None,
            qh=cb["qh"] if cb else None,
            scales=cb["scales"] if cb else None,
            mxfp4_weight=fp["weight"] if fp else None,
            mxfp4_scales=fp["scales"] if fp else None,
            affine_weight=af["weight"] if af else None,
            affine_scales=af["scales"] if af else None,
            affine_biases=af.get("biases") if af else None,
            affine_group_size=self.affine_group_size,
            affine_bits=self.affine_bits,
            rhs_indices=indices,
            sorted_indices=sorted_indices,
        )

    def to_quantized(self, **kwargs):
        return self


class FusedSiTU(nn.Module):
    """mlx-lm's ``SiTU`` module through mlx-k3's fused kernel (one pass, f32 math)."""

    def __init__(self, beta: float = 1.0, linear_beta: Optional[float] = None):
        super().__init__()
        self.beta = beta
        self.linear_beta = linear_beta

    def __call__(self, x, gate):
        return kernels.situ(x, gate, self.beta, self.linear_beta)


@dataclass
class ModelArgs(MlxLmModelArgs):
    """mlx-lm's ``ModelArgs`` plus config.json's ``quantization``, which says which layers use mlx-k3's
    formats (mlx-lm reads it only after building the model)."""

    quantization: Optional[Dict[str, Any]] = None

    @classmethod
    def from_dict(cls, params):
        args = super().from_dict(params)
        args.quantization = params.get("quantization")
        if k3_formats(args.quantization):
            # mlx-lm's loader reads a default group_size/bits from `quantization` before it applies the
            # per-path entries; a checkpoint whose only quantized layers are mlx-k3's may have none. The
            # defaults are never used: layers without an entry or packed weights are left as they are.
            params["quantization"].setdefault("group_size", 64)
            params["quantization"].setdefault("bits", 4)
        return args


class Model(MlxLmModel):
    """Kimi K3 with mlx-k3's layers where config.json names an mlx-k3 format; mlx-lm's ``Model`` otherwise."""

    def __new__(cls, args):
        if cls is Model and not k3_formats(getattr(args, "quantization", None)):
            return MlxLmModel(args)
        return super().__new__(cls)

    def __init__(self, args):
        super().__init__(args)
        for path, record in k3_formats(args.quantization).items():
            parent, name, layer = _locate(self, path)
            _replace(parent, name, _k3_layer(path, record, layer))
        for layer in self.language_model.model.layers:
            if isinstance(layer.mlp, base.KimiK3SparseMoE):
                act = layer.mlp.switch_mlp.activation
                layer.mlp.switch_mlp.activation = FusedSiTU(act.beta, act.linear_beta)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        weights = super().sanitize(weights)
        for path in k3_formats(self.args.quantization):
            layer = _locate(self, path)[2]
            if isinstance(layer, TieredSwitchLinear):
                layer.attach(path, weights)
            else:
                missing = [f"{path}.{n}" for n in ("codes", "qh", "scales") if f"{path}.{n}" not in weights]
                if missing:
                    raise ValueError(f"config.json gives {path} the k3_codebook format but {missing} are missing")
        return weights


def _locate(root: nn.Module, path: str) -> Tuple[Any, str, Any]:
    """(parent, last name, module) of a dotted module path; list items are addressed by index."""
    *parents, name = path.split(".")
    obj = root
    for part in parents:
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
    layer = obj[int(name)] if isinstance(obj, list) else getattr(obj, name, None)
    if layer is None:
        raise ValueError(f"config.json gives a format to {path}, which is not a module of this model")
    return obj, name, layer


def _replace(parent, name: str, layer: nn.Module) -> None:
    if isinstance(parent, list):
        parent[int(name)] = layer
    else:
        setattr(parent, name, layer)


def _k3_layer(path: str, record: dict, layer) -> nn.Module:
    mode = record["mode"]
    if isinstance(layer, SwitchLinear) and "bias" not in layer:
        experts, out_dims, in_dims = layer.weight.shape
        if mode == "k3_codebook":
            return CodebookSwitchLinear(in_dims, out_dims, experts)
        return TieredSwitchLinear(in_dims, out_dims, experts, record.get("affine"))
    if isinstance(layer, nn.Linear) and "bias" not in layer and mode == "k3_codebook":
        out_dims, in_dims = layer.weight.shape
        return CodebookLinear(in_dims, out_dims)
    raise ValueError(
        f"config.json gives {path} ({type(layer).__name__}) the format {mode}; mlx-k3's formats apply to "
        "expert stacks (k3_codebook, k3_tiered) and bias-free linear layers (k3_codebook)"
    )


def install(module=None) -> None:
    """Makes ``mlx_lm.models.kimi_k3`` build :class:`Model` (idempotent)."""
    module = module or base
    if module.Model is Model:
        return
    module._mlx_lm_Model = MlxLmModel
    module._mlx_lm_ModelArgs = MlxLmModelArgs
    module.Model = Model
    module.ModelArgs = ModelArgs


install()
