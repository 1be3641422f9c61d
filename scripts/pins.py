"""The MLX, mlx-lm and mlx-vlm versions the scripts check for, read from the Python package's single definition
(``mlx-k3-py/python/mlx_k3/_pins.py``) without importing ``mlx_k3``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_mlx_k3_pins", Path(__file__).resolve().parents[1] / "mlx-k3-py" / "python" / "mlx_k3" / "_pins.py"
)
assert _spec is not None and _spec.loader is not None
_pins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_pins)

MLX: str = _pins.MLX
MLX_LM: str = _pins.MLX_LM
MLX_VLM: str = _pins.MLX_VLM


def missing(wanted: dict[str, str]) -> list[str]:
    """The packages of ``wanted`` (distribution name -> version) not installed at exactly that version, as
    ``"name==version (found X)"`` lines for an error message; empty when all are."""
    import importlib.metadata

    bad = []
    for dist, want in wanted.items():
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != want:
            bad.append(f"{dist}=={want} (found {have or 'nothing'})")
    return bad
