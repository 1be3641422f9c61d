"""Kimi K2.5 / K2.7 with images for mlx-vlm: mlx-vlm's ``kimi_k25`` model (its MoonViT tower, projector,
processor and generation) whose language model is the drop-in's (:mod:`mlx_k3.models.kimi_k25`: mlx-lm's
``kimi_k25`` text model, a DeepSeek-V3 one, with mlx-k3's quantized matmuls and router, float32 on a CPU).

:func:`install` (run by ``import mlx_k3`` when ``mlx_vlm.models.kimi_k25`` is imported) makes that package's
``Model`` :class:`Model`; see :mod:`mlx_k3.models.vlm` for how the language model takes mlx-vlm's merged
embeddings. mlx-k3's codebook and tiered formats are Kimi K3's (:mod:`mlx_k3.models.vlm_kimi_k3`); this family
loads MLX's formats, as mlx-lm's drop-in for it does.
"""

import importlib

from mlx_lm.models.cache import KVCache

from . import deepseek_v3, kimi_k25, vlm

base = importlib.import_module("mlx_vlm.models.kimi_k25")

MlxVlmModel = getattr(base, "_mlx_vlm_Model", base.Model)
MlxVlmModelConfig = getattr(base, "_mlx_vlm_ModelConfig", base.ModelConfig)
ModelConfig = vlm.with_quantization(MlxVlmModelConfig)


class LanguageModel(vlm.TextModel, kimi_k25.base.LanguageModel):
    """mlx-lm's Kimi K2.5 text model with mlx-k3's kernels, speaking mlx-vlm's language-model interface."""

    cpu_kernels = deepseek_v3._CPU_KERNELS

    @property
    def layers(self):
        return self.model.pipeline_layers

    def make_cache(self):
        """mlx-lm's caches, which mlx-lm's attention layers take (mlx-vlm asks the language model for them)."""
        return [KVCache() for _ in self.layers]


class Model(vlm.VisionLanguageModel, MlxVlmModel):
    """mlx-vlm's Kimi K2.5 (tower, projector, merge) with the drop-in's language model."""

    def __init__(self, config):
        super().__init__(config)
        # mlx-vlm's language model was only declared (MLX initializes lazily); this one replaces it, with the
        # same parameter names (mlx-vlm's and mlx-lm's DeepSeek-V3 text models share their layout).
        self.language_model = LanguageModel(vlm.text_args(deepseek_v3.base.ModelArgs, config.text_config))
        if vlm.k3_formats_of(config):
            raise ValueError(
                "config.json gives layers of this kimi_k25 checkpoint mlx-k3's codebook / tiered formats; the "
                "Python drop-in runs those formats for Kimi K3 (kimi_k3) checkpoints only"
            )
        self._cpu_ready = False


def install(module=None) -> None:
    """Makes ``mlx_vlm.models.kimi_k25`` build :class:`Model` from :class:`ModelConfig` (idempotent)."""
    kimi_k25.install()
    vlm.install_classes(module or base, Model, ModelConfig, MlxVlmModel, MlxVlmModelConfig)


install()
