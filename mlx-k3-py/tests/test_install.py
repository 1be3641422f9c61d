"""``pip install ./mlx-k3-py`` in a fresh virtualenv that has only the pinned mlx: the build fetches what it
needs (maturin and the pinned nanobind through pip's build isolation), and the installed module runs on that
environment's libmlx, once.

Slow (a release build and a package index), so opt-in: ``MLX_K3_PY_FRESH_VENV=1`` (.ci/run sets it)."""

import os
import platform
import subprocess
import sys

import pytest

import checkpoints
import mlx_k3

CHECK = """
import os, sys
import mlx.core as mx
import mlx_k3
assert "mlx_lm" not in sys.modules
y = mlx_k3.situ(mx.ones((4,)), mx.ones((4,)), 2.0, 4.0)
mx.eval(y)
libs = sorted({l.split()[5] for l in open("/proc/self/maps") if len(l.split()) >= 6 and "libmlx" in l.split()[5]})
print(os.path.realpath(mlx_k3.__file__))
print("\\n".join(libs))
"""


@pytest.mark.skipif(os.environ.get("MLX_K3_PY_FRESH_VENV") != "1", reason="set MLX_K3_PY_FRESH_VENV=1 to run")
@pytest.mark.skipif(platform.system() != "Linux", reason="checks /proc/self/maps")
def test_pip_install_into_a_fresh_virtualenv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"mlx[cpu]=={mlx_k3.MLX_VERSION}"], check=True, timeout=900)
    # As a user would run it: no virtualenv activated, nothing of this test process's environment leaking in.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run(
        [*pip, str(checkpoints.ROOT / "mlx-k3-py")], env=env, capture_output=True, text=True, timeout=2400
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    r = subprocess.run([py, "-c", CHECK], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    module, *libs = r.stdout.split()
    site = os.path.realpath(venv)
    assert module.startswith(site)
    assert len(libs) == 1 and libs[0].startswith(site), libs
