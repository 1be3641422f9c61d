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
