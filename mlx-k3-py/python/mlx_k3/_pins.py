"""The versions mlx-k3 is built and checked against: the one place Python code defines them.

Plain constants with no imports, so the repository's scripts can read them from this file without importing
``mlx_k3`` (``scripts/pins.py``)."""

MLX = "0.32.4"
"""The MLX wheel the extension is compiled against and runs on, exactly."""

MLX_LM = "0.32.2"
"""The mlx-lm release whose model files are the parity references."""

MLX_VLM = "0.7.10"
"""The mlx-vlm release whose ``models/kimi_k3/encoding_k3.py`` (adapted from Moonshot's ``encoding_k3.py``) is the
reference for the built-in Kimi K3 chat encoding (``scripts/make_k3_chat_fixtures.py``), whose vision models are
the parity references, and whose ``kimi_k3`` / ``kimi_k25`` models the drop-in subclasses for images."""
