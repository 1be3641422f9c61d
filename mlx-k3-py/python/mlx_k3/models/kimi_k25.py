"""Kimi K2.5 / K2.7 (``model_type: kimi_k25``, a ``deepseek_v3`` text model under ``text_config``) for
mlx-lm with mlx-k3's kernels: mlx-lm's ``kimi_k25`` model with :mod:`mlx_k3.models.deepseek_v3`'s drop-in
behaviour (float32 on a CPU, mlx-k3's quantized matmuls, its layers' router through ``moe_router``).

A module of its own because mlx-lm's ``kimi_k25`` imports ``deepseek_v3``: the hook patches that module while
``kimi_k25`` is still being imported, so the two patches must not import each other's mlx-lm module.
:func:`install` (run by ``import mlx_k3`` when ``mlx_lm.models.kimi_k25`` is imported) makes its ``Model``
:class:`Model`; ``ModelArgs`` stays mlx-lm's.
"""

import importlib

from . import deepseek_v3

base = importlib.import_module("mlx_lm.models.kimi_k25")

MlxLmModel = getattr(base, "_mlx_lm_Model", base.Model)


class Model(deepseek_v3.DropIn, MlxLmModel):
    """Kimi K2.5 / K2.7's text model: mlx-lm's ``kimi_k25`` model with mlx-k3's kernels; float32 on a CPU."""


def install(module=None) -> None:
    """Makes ``mlx_lm.models.kimi_k25`` build :class:`Model` (its layers are ``deepseek_v3``'s, whose router
    :func:`mlx_k3.models.deepseek_v3.install` rebinds) (idempotent)."""
    deepseek_v3.install()
    module = module or base
    if module.Model is Model:
        return
    module._mlx_lm_Model = MlxLmModel
    module.Model = Model


install()
