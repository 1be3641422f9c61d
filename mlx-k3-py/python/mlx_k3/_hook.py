"""How ``import mlx_k3`` makes ``mlx_lm.load`` understand mlx-k3's checkpoint formats.

mlx-lm picks a model's classes in ``mlx_lm.utils._get_classes``: it imports ``mlx_lm.models.<model_type>``
and takes that module's ``Model`` and ``ModelArgs``. (Patching ``_get_classes`` itself would not reach
``load_model``, which bound it as a default argument when mlx-lm was imported.) So the hook replaces those
two attributes of ``mlx_lm.models.kimi_k3`` with :mod:`mlx_k3.models.kimi_k3`'s, whose ``Model`` builds
mlx-k3's layers only for a config that names an mlx-k3 format and otherwise returns mlx-lm's own ``Model``,
unchanged. Every mlx-lm entry point (``load``, ``generate``, the server, perplexity, ...) goes through
``_get_classes``, so all of them see the drop-in.

Importing mlx-lm takes seconds, so nothing is imported eagerly: when ``mlx_lm.models.kimi_k3`` is already
loaded it is patched at once, otherwise the first import of it is (a meta-path finder that steps aside after
that).
"""

import importlib.abc
import sys

TARGET = "mlx_lm.models.kimi_k3"


def _patch(module) -> None:
    from .models import kimi_k3

    # When mlx_k3.models.kimi_k3 itself is being imported (and imported mlx-lm's module), it is only partly
    # initialized here; it installs itself when it finishes.
    install = getattr(kimi_k3, "install", None)
    if install is not None:
        install(module)


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``TARGET`` with the other finders and patches it right after it executes."""

    def __init__(self):
        self._loader = None

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__spec__.loader = self._loader
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _patch(module)


def install_drop_in() -> None:
    """Makes ``mlx_lm`` load mlx-k3's formats (idempotent; ``import mlx_k3`` calls it)."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
