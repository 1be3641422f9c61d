"""Fixtures of the mlx_k3 tests: the test checkpoints (built once per session from k3-nano, see
checkpoints.py) and the Rust CLI (``MLX_K3_CLI``, else the release or debug ``mlx-k3`` in the Cargo target
folder, else a release build of it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import checkpoints  # noqa: E402

ROOT = checkpoints.ROOT


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def plain_ckpt(ckpt_dir):
    return checkpoints.plain(ckpt_dir / "plain")


@pytest.fixture(scope="session")
def codebook_ckpts(ckpt_dir):
    """(codebook checkpoint, its float32 reference)."""
    return checkpoints.codebook(ckpt_dir / "codebook", ckpt_dir / "codebook_ref")


@pytest.fixture(scope="session")
def codebook_narrow_ckpts(ckpt_dir):
    """(codebook checkpoint with k3-nano's own narrow experts, its float32 reference)."""
    return checkpoints.codebook(ckpt_dir / "codebook_narrow", ckpt_dir / "codebook_narrow_ref", wide=False)


@pytest.fixture(scope="session")
def tiered_ckpts(ckpt_dir):
    """(tiered checkpoint, its float32 reference)."""
    return checkpoints.tiered(ckpt_dir / "tiered", ckpt_dir / "tiered_ref")


@pytest.fixture(scope="session")
def affine_ckpt(ckpt_dir):
    """k3-nano quantized by mlx-lm: affine 4-bit, groups of 32 (bf16 scales)."""
    return checkpoints.mlx_quantized(ckpt_dir / "affine4", "affine", 4, 32)


@pytest.fixture(scope="session")
def mxfp4_ckpt(ckpt_dir):
    """k3-nano quantized by mlx-lm: MXFP4 (the router affine 8-bit)."""
    return checkpoints.mlx_quantized(ckpt_dir / "mxfp4", "mxfp4", 4, 32)


@pytest.fixture(scope="session")
def rust_cli():
    if "MLX_K3_CLI" in os.environ:
        path = Path(os.environ["MLX_K3_CLI"])
        assert path.exists(), f"MLX_K3_CLI={path} does not exist"
        return path
    target = ROOT / os.environ.get("CARGO_TARGET_DIR", "target")
    for profile in ("release", "debug"):
        if (target / profile / "mlx-k3").exists():
            return target / profile / "mlx-k3"
    subprocess.run(["cargo", "build", "--release", "--bin", "mlx-k3"], cwd=ROOT, check=True, timeout=1800)
    return target / "release" / "mlx-k3"
