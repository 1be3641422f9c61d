"""mlx-lm model classes over mlx-k3's kernels (``kimi_k3``: the drop-in for mlx-k3's checkpoint formats)."""
