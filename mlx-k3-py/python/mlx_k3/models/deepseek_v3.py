"""The DeepSeek-V3 family for mlx-lm with mlx-k3's kernels: the drop-in for ``deepseek_v3`` checkpoints
(DeepSeek-V3/R1, Kimi K2 and K2-Thinking) and ``kimi_k25`` ones (Kimi K2.5/K2.7, whose text model is a
``deepseek_v3`` one under ``text_config``).

As for Kimi K3 (:mod:`mlx_k3.models.kimi_k3`), these are mlx-lm's own classes, subclassed, with mlx-k3's
kernels where mlx-k3's CLI runs them for this family:

- MLX's quantization formats (affine 2-8 bit, MXFP4, MXFP8, NVFP4 without a global scale): linear layers,
  expert stacks and a quantized embedding's tied head run ``mlx_k3.quantized_matmul`` / ``gather_qmm``;
- on a CPU stream the grouped sigmoid router (``noaux_tc``) runs ``mlx_k3.moe_router``.

The feed-forward activation stays mlx-lm's SwiGLU (``silu(gate) * up``, what the CLI computes for this
family too), attention (MLA with decoupled RoPE), caches and generation are mlx-lm's code. On a CPU the model
computes in float32 as mlx-k3's CLI does by default: its first call on a CPU stream casts the floating-point
weights (MLX's CPU ``gather_mm`` takes float32 only, so a bf16 checkpoint could not run otherwise).

:func:`install` (run by ``import mlx_k3`` when mlx-lm's ``deepseek_v3`` module is imported) makes
``mlx_lm.models.deepseek_v3.Model`` :class:`Model` (``ModelArgs`` stays mlx-lm's) and its router function
the dispatcher; :mod:`mlx_k3.models.kimi_k25` does the same for ``mlx_lm.models.kimi_k25``.
"""

import contextvars
import importlib

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .. import kernels
from .kimi_k3 import _use_k3_quantized

base = importlib.import_module("mlx_lm.models.deepseek_v3")

# mlx-lm's classes and functions, kept even if this module is imported again after install().
MlxLmModel = getattr(base, "_mlx_lm_Model", base.Model)
_mlx_lm_group_expert_select = getattr(base, "_mlx_lm_group_expert_select", base.group_expert_select)

# True while a drop-in model of this family computes on a CPU stream: the router then runs mlx-k3's kernel.
_CPU_KERNELS = contextvars.ContextVar("mlx_k3_deepseek_v3_cpu_kernels", default=False)


class DropIn:
    """What the drop-in adds to mlx-lm's ``Model`` of this family (a mixin before mlx-lm's class; the
    ``kimi_k25`` model, :mod:`mlx_k3.models.kimi_k25`, uses it too)."""

    def load_weights(self, file_or_weights, strict: bool = True):
        # mlx-lm has made its quantized layers by now (nn.quantize runs between sanitize and this).
        _use_k3_quantized(self)
        self._cpu_ready = False
        return super().load_weights(file_or_weights, strict=strict)

    def __call__(self, inputs: mx.array, cache=None):
        if mx.default_device().type != mx.cpu:
            return super().__call__(inputs, cache)
        if not getattr(self, "_cpu_ready", False):
            self.to_float32()
        token = _CPU_KERNELS.set(True)
        try:
            return super().__call__(inputs, cache)
        finally:
            _CPU_KERNELS.reset(token)

    def to_float32(self) -> None:
        """Casts the floating-point weights to float32 and evaluates them (the first call on a CPU does this;
        at load the checkpoint's dtypes stay, so that ``mlx_lm.convert`` keeps them)."""
        cast = [
            (k, v.astype(mx.float32))
            for k, v in tree_flatten(self.parameters())
            if mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float32
        ]
        if cast:
            self.update(tree_unflatten(cast))
            mx.eval([v for _, v in cast])
        self._cpu_ready = True


class Model(DropIn, MlxLmModel):
    """DeepSeek-V3 / Kimi K2: mlx-lm's model with mlx-k3's kernels where they apply; float32 on a CPU."""


def _router(gates, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob):
    """mlx-lm's ``group_expert_select``; mlx-k3's ``moe_router`` in a drop-in model on a CPU (same selection
    and weights: sigmoid scores, the bias for selection only, groups ranked by their two best scores)."""
    if not _CPU_KERNELS.get():
        return _mlx_lm_group_expert_select(
            gates, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob
        )
    return kernels.moe_router(
        gates,
        bias,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        renormalize=norm_topk_prob,
    )


def install(module=None) -> None:
    """Makes ``mlx_lm.models.deepseek_v3`` build :class:`Model` and route with mlx-k3's kernel in it
    (idempotent)."""
    module = module or base
    if module.Model is Model:
        return
    module._mlx_lm_Model = MlxLmModel
    module._mlx_lm_group_expert_select = _mlx_lm_group_expert_select
    module.Model = Model
    module.group_expert_select = _router


install()
