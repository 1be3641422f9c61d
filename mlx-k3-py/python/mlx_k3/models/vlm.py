"""What the drop-in adds to mlx-vlm's Kimi models (``kimi_k3``, ``kimi_k25``): shared by
:mod:`mlx_k3.models.vlm_kimi_k3` and :mod:`mlx_k3.models.vlm_kimi_k25`.

mlx-vlm's model of a Kimi checkpoint is a vision tower, a projector and a language model; its ``generate``
calls ``model.get_input_embeddings(input_ids, pixel_values, ...)`` (the language model's token embeddings with
the projected image features written over the image placeholder tokens) and then
``model.language_model(input_ids, inputs_embeds=..., cache=...)`` for the prefill and
``model.language_model(tokens, cache=...)`` for each decode step. The drop-in keeps mlx-vlm's model, tower,
projector, processor and generation, and makes ``language_model`` mlx-lm's text model of the family with
mlx-k3's kernels and formats (the same classes :mod:`mlx_k3.models.kimi_k3` / :mod:`mlx_k3.models.deepseek_v3`
give ``mlx_lm.load``), speaking mlx-vlm's interface (:class:`TextModel`).
"""

import contextvars
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_vlm.models.base import LanguageModelOutput

from .kimi_k3 import _use_k3_quantized, cast_to_float32, check_k3_formats, k3_formats


def on_cpu() -> bool:
    return mx.default_device().type == mx.cpu


class _GivenEmbeddings:
    """Stands in for a text model's ``embed_tokens`` during one forward: returns the embeddings mlx-vlm merged
    (the tokens are ignored); the tied output head still reads the real table."""

    def __init__(self, table, embeds: mx.array):
        self.table = table
        self.embeds = embeds

    def __call__(self, tokens):
        return self.embeds

    def as_linear(self, x):
        return self.table.as_linear(x)


class TextModel:
    """A mixin before mlx-lm's ``LanguageModel`` of a family (``model`` the text model, ``lm_head`` or a tied
    head): mlx-vlm's language-model interface over mlx-lm's module.

    - ``__call__(inputs, inputs_embeds=None, cache=None, **kwargs)`` returns mlx-vlm's ``LanguageModelOutput``;
      ``inputs_embeds`` (the prefill's merged embeddings) replaces the token embedding for that call (mlx-lm's
      text models embed their inputs first and nothing else reads ``embed_tokens`` in the forward). mlx-vlm's
      other keyword arguments (``logits_to_keep``, ``n_to_process``, ``mask``, ...) are hints its own
      language models ignore too.
    - ``embed_tokens(ids)``: the token embeddings (what mlx-vlm's ``get_input_embeddings`` asks for).
    - On a CPU stream: float32 from the first call, and :attr:`cpu_kernels` (the family's switch that points
      mlx-lm's router / SiTU / residual-mix functions at mlx-k3's kernels) set for the forward.
    """

    cpu_kernels: contextvars.ContextVar = None  # the family's (set by the subclass)

    def __call__(self, inputs: Optional[mx.array] = None, inputs_embeds: Optional[mx.array] = None, cache=None,
                 mask=None, **kwargs):
        if not on_cpu():
            return LanguageModelOutput(logits=self._forward(inputs, inputs_embeds, cache))
        self.prepare_cpu()
        token = self.cpu_kernels.set(True)
        try:
            return LanguageModelOutput(logits=self._forward(inputs, inputs_embeds, cache))
        finally:
            self.cpu_kernels.reset(token)

    def _forward(self, inputs, inputs_embeds, cache):
        if inputs_embeds is None:
            return super().__call__(inputs, cache)
        text = self.model
        table = text["embed_tokens"]
        text["embed_tokens"] = _GivenEmbeddings(table, inputs_embeds)
        try:
            return super().__call__(inputs, cache)
        finally:
            text["embed_tokens"] = table

    def embed_tokens(self, ids: mx.array) -> mx.array:
        if on_cpu():
            self.prepare_cpu()
        return self.model.embed_tokens(ids)

    def prepare_cpu(self) -> None:
        """float32 weights (not the codebook scales), once: what mlx-k3's CLI computes in on a CPU."""
        if not getattr(self, "_cpu_ready", False):
            cast_to_float32(self)
            self._cpu_ready = True


class VisionLanguageModel:
    """A mixin before mlx-vlm's ``Model`` of a family whose ``language_model`` is a :class:`TextModel`."""

    def k3_quantization(self) -> Optional[Dict[str, Any]]:
        return getattr(self.config, "quantization", None)

    def get_input_embeddings(self, input_ids: Optional[mx.array] = None, pixel_values: Optional[mx.array] = None,
                             **kwargs):
        if on_cpu():
            self.prepare_cpu()
        return super().get_input_embeddings(input_ids, pixel_values, **kwargs)

    def prepare_cpu(self) -> None:
        """float32 weights for the whole model on a CPU (tower and projector too, as mlx-k3's CLI runs them),
        once, at the first call; at load the checkpoint's dtypes stay (so that converting tools keep them)."""
        if not getattr(self, "_cpu_ready", False):
            cast_to_float32(self)
            self._cpu_ready = True
            self.language_model._cpu_ready = True

    def load_weights(self, file_or_weights: Union[str, List[Tuple[str, mx.array]]], strict: bool = True):
        # mlx-vlm has sanitized the weights and made its quantized layers by now.
        if isinstance(file_or_weights, str):
            file_or_weights = list(mx.load(file_or_weights).items())
        check_k3_formats(self, self.k3_quantization(), dict(file_or_weights))
        _use_k3_quantized(self.language_model)  # the tower and projector keep mlx-vlm's layers
        self._cpu_ready = False
        self.language_model._cpu_ready = False
        return super().load_weights(file_or_weights, strict=strict)


def text_args(args_class, text_config) -> Any:
    """mlx-lm's arguments of the text model from mlx-vlm's ``TextConfig`` (the same fields, as config.json names
    them; a field mlx-vlm leaves None takes mlx-lm's default)."""
    return args_class.from_dict({k: v for k, v in vars(text_config).items() if v is not None})


def k3_formats_of(config) -> Dict[str, dict]:
    """The layers config.json gives an mlx-k3 format (:func:`mlx_k3.models.kimi_k3.k3_formats`)."""
    return k3_formats(getattr(config, "quantization", None))


def with_quantization(config_class):
    """mlx-vlm's ``ModelConfig`` of a family plus config.json's ``quantization`` (mlx-vlm's drops it), which
    says which layers use mlx-k3's formats."""

    @dataclass
    class ModelConfig(config_class):
        quantization: Optional[Dict[str, Any]] = None

        @classmethod
        def from_dict(cls, params):
            config = super().from_dict(params)
            if k3_formats(config.quantization):
                # As for mlx-lm (kimi_k3.ModelArgs): mlx-vlm's loader reads a default group_size / bits from
                # `quantization`, which a checkpoint whose only quantized layers are mlx-k3's may lack; layers
                # without an entry or packed weights are left as they are.
                params["quantization"].setdefault("group_size", 64)
                params["quantization"].setdefault("bits", 4)
            return config

    ModelConfig.__module__ = config_class.__module__
    ModelConfig.__doc__ = with_quantization.__doc__
    return ModelConfig


def install_classes(module, model, config, mlx_vlm_model, mlx_vlm_config) -> None:
    """Makes mlx-vlm's model module ``module`` build ``model`` from ``config``, keeping mlx-vlm's own classes
    reachable as ``_mlx_vlm_Model`` / ``_mlx_vlm_ModelConfig`` (idempotent)."""
    if module.Model is model:
        return
    module._mlx_vlm_Model = mlx_vlm_model
    module._mlx_vlm_ModelConfig = mlx_vlm_config
    module.Model = model
    module.ModelConfig = config
