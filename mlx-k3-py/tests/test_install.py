"""The README's Python install, verbatim, in a fresh virtualenv: its one ``pip install "./mlx-k3-py[...]"``
line (the build fetches what it needs: maturin and the pinned nanobind through pip's build isolation; the
extras bring mlx-lm and the MLX back-end wheel), then its ``python -m mlx_k3`` block, with nothing else
installed by hand. The installed module must run on that environment's libmlx, once.

Slow (a release build and a package index), so opt-in: ``MLX_K3_PY_FRESH_VENV=1`` (.ci/run sets it). The pins
of ``pyproject.toml`` are checked against ``mlx_k3/_pins.py`` on every run."""

import os
import platform
import re
import subprocess
import sys
import tomllib

import pytest

import checkpoints
import mlx_k3
from mlx_k3 import _pins

README = checkpoints.ROOT / "README.md"
# The install line: pip, the package folder and its extras, nothing else.
INSTALL = re.compile(r'^pip install "\./mlx-k3-py\[[a-z0-9,]+\]"$')

CHECK = """
import os, sys
import mlx.core as mx
import mlx_k3
assert "mlx_lm" not in sys.modules
y = mlx_k3.situ(mx.ones((4,)), mx.ones((4,)), 2.0, 4.0)
mx.eval(y)
import mlx_lm
libs = sorted({l.split()[5] for l in open("/proc/self/maps") if len(l.split()) >= 6 and "libmlx" in l.split()[5]})
print(os.path.realpath(mlx_k3.__file__))
print(mlx_lm.__version__)
print("\\n".join(libs))
"""


def readme_python_commands():
    """(the install line, the first ```sh block after it that runs ``python -m mlx_k3``) of the README."""
    lines = README.read_text().splitlines()
    installs = [n for n, line in enumerate(lines) if INSTALL.match(line.strip())]
    assert len(installs) == 1, f'README.md must hold one line `pip install "./mlx-k3-py[EXTRAS]"`, found {installs}'
    start = installs[0]
    blocks, body = [], None
    for line in lines[start + 1 :]:
        if body is None and re.match(r"^```sh\s*$", line):
            body = []
        elif body is not None and line.startswith("```"):
            blocks.append("\n".join(body))
            body = None
        elif body is not None:
            body.append(line)
    python_blocks = [b for b in blocks if "python -m mlx_k3" in b]
    assert python_blocks, "README.md has no ```sh block running `python -m mlx_k3` after its install line"
    return lines[start].strip(), python_blocks[0]


def test_pyproject_pins_are_the_package_pins():
    project = tomllib.loads((checkpoints.ROOT / "mlx-k3-py" / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert project["dependencies"] == [f"mlx=={_pins.MLX}"]
    assert extras["cpu"] == [f"mlx[cpu]=={_pins.MLX}"]
    assert extras["cuda13"] == [f"mlx[cuda13]=={_pins.MLX}"]
    assert f"mlx-lm=={_pins.MLX_LM}" in extras["lm"]
    assert f"mlx-vlm=={_pins.MLX_VLM}" in extras["vlm"] and f"mlx-lm=={_pins.MLX_LM}" in extras["vlm"]


@pytest.mark.skipif(os.environ.get("MLX_K3_PY_FRESH_VENV") != "1", reason="set MLX_K3_PY_FRESH_VENV=1 to run")
@pytest.mark.skipif(platform.system() != "Linux", reason="checks /proc/self/maps")
def test_readme_install_and_commands_in_a_fresh_virtualenv(tmp_path):
    install, block = readme_python_commands()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # As a user would run it from the repository root: the virtualenv's pip and python first on PATH, nothing
    # of this test process's environment leaking in.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    bash = ["bash", "-c", "set -euo pipefail\n" + install]
    r = subprocess.run(bash, env=env, cwd=checkpoints.ROOT, capture_output=True, text=True, timeout=2400)
    assert r.returncode == 0, f"{install}\n{r.stdout[-4000:]}{r.stderr[-4000:]}"

    py = str(venv / "bin" / "python")
    r = subprocess.run([py, "-c", CHECK], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    module, lm_version, *libs = r.stdout.split()
    site = os.path.realpath(venv)
    assert module.startswith(site)
    assert lm_version == _pins.MLX_LM
    assert len(libs) == 1 and libs[0].startswith(site), libs
    assert mlx_k3.MLX_VERSION == _pins.MLX

    # The README's Python commands, verbatim, from the repository root.
    bash = ["bash", "-c", "set -euo pipefail\n" + block]
    r = subprocess.run(bash, env=env, cwd=checkpoints.ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"{block}\n{r.stdout[-4000:]}{r.stderr[-4000:]}"
    assert "warning" not in r.stderr.lower(), r.stderr
