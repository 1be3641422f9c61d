"""Kimi K3 for mlx-lm with mlx-k3's kernels: the drop-in model.

This is mlx-lm's own ``kimi_k3`` model (subclassed, not copied), built for every ``kimi_k3`` checkpoint
``mlx_lm.load`` reads after ``import mlx_k3``, with mlx-k3's kernels where they apply:

- the project's formats, which mlx-lm cannot read: ``{"mode": "k3_codebook"}``, the ternary codebook
  (``P.codes`` uint8, ``P.qh`` uint16, ``P.scales`` f16) on an expert stack (``gather_codebook_qmm``) or a
  linear layer (``codebook_qmm``); ``{"mode": "k3_tiered", "affine": {...}}``, a mixed-format expert stack
  (``P.tier``, ``P.slot`` and the tiers' stacks ``P.codebook.*``, ``P.mxfp4.*``, ``P.affine.*``) through
  ``gather_tiered_qmm``;
- MLX's formats (affine 2-8 bit, MXFP4, MXFP8, NVFP4 without a global scale): linear layers, expert stacks
  and a quantized tied output head run ``mlx_k3.quantized_matmul`` / ``gather_qmm`` (mlx-k3's CPU kernels,
  MLX's own op where those do not apply);
- the routed experts' SiTU as the fused kernel, and on a CPU stream the dense MLPs' SiTU, the MoE router
  (``moe_router``) and the attention-residual mix (``attn_res_mix``) too.

On a CPU the model computes in float32, as mlx-k3's CLI does by default: at its first call on a CPU stream
it casts its floating-point weights to float32 (not the codebook scales, which the kernels read as f16).
MLX's CPU ``gather_mm`` (mlx-lm's unquantized expert layers) takes float32 only, so a bf16 checkpoint such
as k3-nano could not run otherwise, and the same arithmetic as the CLI's gives the same greedy tokens. The
cast happens at the first call rather than at load so that ``mlx_lm.convert`` and other tools that load and
save a model keep its dtypes. On a GPU the weights keep their dtype and mlx-lm's ops run where mlx-k3's CLI
keeps MLX's ops too (router, residual mix).

Attention, caches, generation and everything else is mlx-lm's code, so ``mlx_lm.generate``,
``stream_generate``, the server, prompt caches, batching and perplexity work exactly as for any mlx-lm
model. (A wrapper over the Rust engine would have to re-implement mlx-lm's cache objects, which its server
and prompt caching manipulate directly; a model class keeps all of that and still runs the Rust kernels,
zero-copy.) The router, residual mix and dense SiTU are module-level functions of mlx-lm's ``kimi_k3``
that its layers call; :func:`install` rebinds them to dispatchers that run mlx-k3's kernels while a
drop-in model computes on a CPU stream, and mlx-lm's functions otherwise, so mlx-lm's own ``Model``
(``MlxLmModel``) still computes exactly as mlx-lm does.

:func:`install` (run by ``import mlx_k3``) makes ``mlx_lm.models.kimi_k3.Model`` / ``ModelArgs`` these
classes; :func:`mlx_k3.tokenizer.install_tokenizer` gives mlx-lm Kimi's exact tokenizer for a checkpoint
that ships only ``tiktoken.model``.
"""

import contextvars
import importlib
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from .. import kernels

base = importlib.import_module("mlx_lm.models.kimi_k3")

# mlx-lm's classes and functions, kept even if this module is imported again after install().
MlxLmModel = getattr(base, "_mlx_lm_Model", base.Model)
MlxLmModelArgs = getattr(base, "_mlx_lm_ModelArgs", base.ModelArgs)
_mlx_lm_group_expert_select = getattr(base, "_mlx_lm_group_expert_select", base._group_expert_select)
_mlx_lm_attn_res_mix = getattr(base, "_mlx_lm_attn_res_mix", base._attn_res_mix)
_mlx_lm_situ = getattr(base, "_mlx_lm_situ", base._situ)
if hasattr(base, "TOKENIZER_DEFAULTS"):  # mlx-lm reads it from the module of the model's class
    TOKENIZER_DEFAULTS = base.TOKENIZER_DEFAULTS

# True while a drop-in model computes on a CPU stream: mlx-lm's module functions below then run mlx-k3's kernels.
_CPU_KERNELS = contextvars.ContextVar("mlx_k3_cpu_kernels", default=False)
# MLX's quantization modes that mlx-k3's quantized_matmul / gather_qmm take (its CPU kernels or MLX's op).
MLX_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")

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


class K3QuantizedLinear(nn.QuantizedLinear):
    """MLX's ``QuantizedLinear`` (same parameters) through ``mlx_k3.quantized_matmul``."""

    def __call__(self, x):
        y = kernels.quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits, self.mode
        )
        return y + self["bias"] if "bias" in self else y


class K3QuantizedEmbedding(nn.QuantizedEmbedding):
    """MLX's ``QuantizedEmbedding`` whose tied output head (``as_linear``) runs ``mlx_k3.quantized_matmul``."""

    def as_linear(self, x):
        return kernels.quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits, self.mode
        )


class K3QuantizedSwitchLinear(QuantizedSwitchLinear):
    """mlx-lm's ``QuantizedSwitchLinear`` (same parameters) through ``mlx_k3.gather_qmm``."""

    def __call__(self, x, indices, sorted_indices=False):
        y = kernels.gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            rhs_indices=indices,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


# mlx-lm's quantized layer -> the drop-in's, with the same parameters and attributes.
K3_QUANTIZED = {
    nn.QuantizedLinear: K3QuantizedLinear,
    nn.QuantizedEmbedding: K3QuantizedEmbedding,
    QuantizedSwitchLinear: K3QuantizedSwitchLinear,
}


def _use_k3_quantized(module: nn.Module) -> None:
    """Turns mlx-lm's quantized layers in ``module`` into the drop-in's (those with a global scale keep MLX's
    op: mlx-k3's kernels have no global scale)."""
    for _, m in module.named_modules():
        k3_class = K3_QUANTIZED.get(type(m))
        if k3_class is not None and m.mode in MLX_MODES and m.get("global_scale") is None:
            m.__class__ = k3_class


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
    """Kimi K3: mlx-lm's model with mlx-k3's kernels where they apply and mlx-k3's formats where config.json
    names them; float32 on a CPU (see the module's doc)."""

    def __init__(self, args):
        super().__init__(args)
        use_k3_formats(self, args.quantization)
        fuse_situ(self.language_model)
        self._cpu_ready = False

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        weights = super().sanitize(weights)
        check_k3_formats(self, self.args.quantization, weights)
        return weights

    def load_weights(self, file_or_weights, strict: bool = True):
        # mlx-lm has made its quantized layers by now (nn.quantize runs between sanitize and this).
        _use_k3_quantized(self)
        self._cpu_ready = False
        return super().load_weights(file_or_weights, strict=strict)

    def __call__(self, inputs: mx.array, cache=None):
        if mx.default_device().type != mx.cpu:
            return super().__call__(inputs, cache)
        if not self._cpu_ready:
            self.to_float32()
        token = _CPU_KERNELS.set(True)
        try:
            return super().__call__(inputs, cache)
        finally:
            _CPU_KERNELS.reset(token)

    def to_float32(self) -> None:
        """Casts the floating-point weights to float32 and evaluates them (the codebook scales stay f16, as
        the codebook kernels read them). The first call on a CPU stream does this."""
        cast_to_float32(self)
        self._cpu_ready = True


def use_k3_formats(root: nn.Module, quantization: Optional[Dict[str, Any]]) -> None:
    """Replaces the layers of ``root`` (a model whose text model is ``root.language_model``) that config.json's
    ``quantization`` gives an mlx-k3 format with that format's layer (:func:`k3_formats`)."""
    for path, record in k3_formats(quantization).items():
        parent, name, layer = _locate(root, path)
        _replace(parent, name, _k3_layer(path, record, layer))


def fuse_situ(language_model: nn.Module) -> None:
    """Gives the routed experts of mlx-lm's Kimi K3 text model mlx-k3's fused SiTU."""
    for layer in language_model.model.layers:
        if isinstance(layer.mlp, base.KimiK3SparseMoE):
            act = layer.mlp.switch_mlp.activation
            layer.mlp.switch_mlp.activation = FusedSiTU(act.beta, act.linear_beta)


def check_k3_formats(root: nn.Module, quantization: Optional[Dict[str, Any]], weights: Dict[str, mx.array]) -> None:
    """Checks that ``weights`` (sanitized, keyed by the paths of ``root``) hold every tensor of the layers
    :func:`use_k3_formats` made, and sizes the tiered stacks' tiers from them."""
    for path in k3_formats(quantization):
        layer = _locate(root, path)[2]
        if isinstance(layer, TieredSwitchLinear):
            layer.attach(path, weights)
        else:
            missing = [f"{path}.{n}" for n in ("codes", "qh", "scales") if f"{path}.{n}" not in weights]
            if missing:
                raise ValueError(f"config.json gives {path} the k3_codebook format but {missing} are missing")


def cast_to_float32(module: nn.Module) -> None:
    """Casts the floating-point weights of ``module`` to float32 and evaluates them, except the codebook
    scales (f16, as the codebook kernels read them)."""
    keep = set()
    for path, m in module.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(m, (CodebookSwitchLinear, CodebookLinear)):
            keep.add(f"{prefix}scales")
        elif isinstance(m, TieredSwitchLinear):
            keep.add(f"{prefix}codebook.scales")
    cast = [
        (k, v.astype(mx.float32))
        for k, v in tree_flatten(module.parameters())
        if k not in keep and mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float32
    ]
    if cast:
        module.update(tree_unflatten(cast))
        mx.eval([v for _, v in cast])


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


def _router(gates, bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize):
    """mlx-lm's ``_group_expert_select``; mlx-k3's ``moe_router`` (bit-identical on a CPU) in a drop-in model."""
    if not _CPU_KERNELS.get():
        return _mlx_lm_group_expert_select(
            gates, bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize
        )
    return kernels.moe_router(
        gates,
        bias,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        renormalize=renormalize,
    )


def _attn_res_mix(blocks, partial_sum, w_eff, eps, use_kernel=True):
    """mlx-lm's ``_attn_res_mix``; mlx-k3's ``attn_res_mix`` in a drop-in model."""
    if not _CPU_KERNELS.get() or blocks.raw is None:
        return _mlx_lm_attn_res_mix(blocks, partial_sum, w_eff, eps, use_kernel)
    return kernels.attn_res_mix(blocks.raw, blocks.inv_rms, partial_sum, w_eff, eps)


def _situ(x, gate, beta, linear_beta):
    """mlx-lm's ``_situ``; mlx-k3's fused ``situ`` in a drop-in model."""
    if not _CPU_KERNELS.get():
        return _mlx_lm_situ(x, gate, beta, linear_beta)
    return kernels.situ(x, gate, beta, linear_beta)


def install(module=None) -> None:
    """Makes ``mlx_lm.models.kimi_k3`` build :class:`Model` and its layers call mlx-k3's kernels in it
    (idempotent)."""
    module = module or base
    if module.Model is Model:
        return
    module._mlx_lm_Model = MlxLmModel
    module._mlx_lm_ModelArgs = MlxLmModelArgs
    module._mlx_lm_group_expert_select = _mlx_lm_group_expert_select
    module._mlx_lm_attn_res_mix = _mlx_lm_attn_res_mix
    module._mlx_lm_situ = _mlx_lm_situ
    module.Model = Model
    module.ModelArgs = ModelArgs
    module._group_expert_select = _router
    module._attn_res_mix = _attn_res_mix
    module._situ = _situ


install()
