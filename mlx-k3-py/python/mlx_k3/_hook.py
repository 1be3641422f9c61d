"""How ``import mlx_k3`` makes ``mlx_lm.load`` run Kimi K3 checkpoints and the DeepSeek-V3 family's
(``deepseek_v3``, ``kimi_k25``) with mlx-k3's kernels, and ``mlx_vlm.load`` Kimi K3 and K2.5 ones with images.

mlx-lm picks a model's classes in ``mlx_lm.utils._get_classes``: it imports ``mlx_lm.models.<model_type>``
and takes that module's ``Model`` and ``ModelArgs``. (Patching ``_get_classes`` itself would not reach
``load_model``, which bound it as a default argument when mlx-lm was imported.) So the hook replaces those
two attributes of ``mlx_lm.models.kimi_k3`` with :mod:`mlx_k3.models.kimi_k3`'s, whose ``Model`` is
mlx-lm's with mlx-k3's kernels and formats (see that module for what else it installs). Every mlx-lm entry
point (``load``, ``generate``, the server, perplexity, ...) goes through ``_get_classes``, so all of them see
the drop-in for every ``kimi_k3`` checkpoint. ``mlx_lm.models.deepseek_v3`` and ``kimi_k25`` are patched
the same way with :mod:`mlx_k3.models.deepseek_v3`'s and :mod:`mlx_k3.models.kimi_k25`'s classes.

The tokenizer is loaded by ``mlx_lm.utils.load_tokenizer``, which may run before any model module is
imported, so ``mlx_lm.utils`` is patched by itself: its tokenizer loader gets Kimi's exact tokenizer for a
checkpoint without ``tokenizer.json``, and transformers learns the ``kimi_k3`` model type
(:func:`mlx_k3.tokenizer.install_tokenizer`).

mlx-vlm builds a model from the package ``mlx_vlm.models.<model_type>`` (``mlx_vlm.utils.get_model_and_args``)
and takes its ``Model`` and ``ModelConfig``; the hook makes those of ``mlx_vlm.models.kimi_k3`` and
``kimi_k25`` :mod:`mlx_k3.models.vlm_kimi_k3`'s and :mod:`mlx_k3.models.vlm_kimi_k25`'s (mlx-vlm's model with
the drop-in's language model).

Importing mlx-lm takes seconds, so nothing is imported eagerly: a module of :data:`TARGETS` that is already
loaded is patched at once, otherwise its first import is (a meta-path finder that steps aside once every
target is patched).
"""

import importlib.abc
import sys


def _patch_model(module) -> None:
    from .models import kimi_k3

    # When mlx_k3.models.kimi_k3 itself is being imported (and imported mlx-lm's module), it is only partly
    # initialized here; it installs itself when it finishes.
    install = getattr(kimi_k3, "install", None)
    if install is not None:
        install(module)


def _patch_deepseek_v3(module) -> None:
    from .models import deepseek_v3

    # As for kimi_k3: a partly initialized mlx_k3.models.deepseek_v3 installs itself when it finishes.
    install = getattr(deepseek_v3, "install", None)
    if install is not None:
        install(module)


def _patch_kimi_k25(module) -> None:
    from .models import kimi_k25

    install = getattr(kimi_k25, "install", None)
    if install is not None:
        install(module)


def _patch_vlm_kimi_k3(module) -> None:
    from .models import vlm_kimi_k3

    install = getattr(vlm_kimi_k3, "install", None)
    if install is not None:
        install(module)


def _patch_vlm_kimi_k25(module) -> None:
    from .models import vlm_kimi_k25

    install = getattr(vlm_kimi_k25, "install", None)
    if install is not None:
        install(module)


def _patch_utils(module) -> None:
    from .tokenizer import install_tokenizer

    install_tokenizer(module)


# mlx-lm's and mlx-vlm's modules the drop-in patches, and how.
TARGETS = {
    "mlx_lm.models.kimi_k3": _patch_model,
    "mlx_lm.models.deepseek_v3": _patch_deepseek_v3,
    "mlx_lm.models.kimi_k25": _patch_kimi_k25,
    "mlx_lm.utils": _patch_utils,
    "mlx_vlm.models.kimi_k3": _patch_vlm_kimi_k3,
    "mlx_vlm.models.kimi_k25": _patch_vlm_kimi_k25,
}


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules of :data:`TARGETS` with the other finders and patches each right after it executes."""

    def __init__(self):
        self._loaders = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        self._loaders[fullname], spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        name = module.__spec__.name
        loader = self._loaders.pop(name)
        loader.exec_module(module)
        module.__spec__.loader = loader
        if self in sys.meta_path and all(t in sys.modules for t in TARGETS):
            sys.meta_path.remove(self)
        TARGETS[name](module)


def install_drop_in() -> None:
    """Makes ``mlx_lm`` load Kimi K3 and DeepSeek-V3-family checkpoints, and ``mlx_vlm`` Kimi K3 and K2.5 ones,
    with the drop-in (idempotent; ``import mlx_k3`` calls it)."""
    for name, patch in TARGETS.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not all(t in sys.modules for t in TARGETS) and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
