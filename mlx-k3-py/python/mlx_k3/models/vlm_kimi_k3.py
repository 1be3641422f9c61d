"""Kimi K3 with images for mlx-vlm: mlx-vlm's ``kimi_k3`` model (its MoonViT-3d tower, ``patchmergerv2``
projector, processor and generation) whose language model is the drop-in's (:mod:`mlx_k3.models.kimi_k3`:
mlx-lm's Kimi K3 text model with mlx-k3's kernels, float32 on a CPU, and mlx-k3's codebook and tiered expert
formats).

``mlx_vlm.load`` imports ``mlx_vlm.models.kimi_k3`` and builds its ``Model`` from its ``ModelConfig``;
:func:`install` (run by ``import mlx_k3`` when that package is imported) makes them :class:`Model` and
:class:`ModelConfig`. The tower and projector stay mlx-vlm's Python modules (in float32 on a CPU, as mlx-k3's
CLI runs its own); see :mod:`mlx_k3.models.vlm` for how the language model takes mlx-vlm's merged embeddings.
mlx-vlm's own classes stay reachable as :data:`MlxVlmModel` / :data:`MlxVlmModelConfig`.
"""

import importlib

from . import kimi_k3, vlm

base = importlib.import_module("mlx_vlm.models.kimi_k3")

MlxVlmModel = getattr(base, "_mlx_vlm_Model", base.Model)
MlxVlmModelConfig = getattr(base, "_mlx_vlm_ModelConfig", base.ModelConfig)
ModelConfig = vlm.with_quantization(MlxVlmModelConfig)


class LanguageModel(vlm.TextModel, kimi_k3.base.LanguageModel):
    """mlx-lm's Kimi K3 text model with mlx-k3's kernels, speaking mlx-vlm's language-model interface."""

    cpu_kernels = kimi_k3._CPU_KERNELS


class Model(vlm.VisionLanguageModel, MlxVlmModel):
    """mlx-vlm's Kimi K3 (tower, projector, merge) with the drop-in's language model."""

    def __init__(self, config):
        super().__init__(config)
        # mlx-vlm's language model was only declared (MLX initializes lazily); this one replaces it, with the
        # same parameter names (mlx-vlm's and mlx-lm's Kimi K3 text models share their layout).
        self.language_model = LanguageModel(vlm.text_args(kimi_k3.base.TextArgs, config.text_config))
        kimi_k3.use_k3_formats(self, getattr(config, "quantization", None))
        kimi_k3.fuse_situ(self.language_model)
        self._cpu_ready = False


def install(module=None) -> None:
    """Makes ``mlx_vlm.models.kimi_k3`` build :class:`Model` from :class:`ModelConfig` (idempotent)."""
    kimi_k3.install()
    vlm.install_classes(module or base, Model, ModelConfig, MlxVlmModel, MlxVlmModelConfig)


install()
