"""One MLX runtime in the process, and the pinned MLX version only."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_k3

MAPPED_LIBMLX = """
import os, sys
{imports}
x = mx.arange(8, dtype=mx.float32).reshape(2, 4)
y = mlx_k3.situ(x, x, 2.0, 4.0)   # a kernel of the Rust side, evaluated by Python's mlx
mx.eval(y)
paths = set()
for line in open("/proc/self/maps"):
    fields = line.split()
    if len(fields) >= 6 and os.path.basename(fields[5]).startswith("libmlx"):
        paths.add(fields[5])
print("\\n".join(sorted(paths)))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
@pytest.mark.parametrize(
    "imports",
    ["import mlx.core as mx\nimport mlx_k3", "import mlx_k3\nimport mlx.core as mx"],
    ids=["mlx-first", "mlx_k3-first"],
)
def test_one_libmlx_mapped(imports):
    """/proc/self/maps lists exactly one libmlx, the one in Python's mlx package."""
    r = _run(MAPPED_LIBMLX.format(imports=imports))
    assert r.returncode == 0, r.stderr
    paths = r.stdout.split()
    wheel_lib = os.path.realpath(Path(mx.__file__).parent / "lib" / "libmlx.so")  # what mlx.core links
    assert paths == [wheel_lib], f"libmlx mappings: {paths}"


def test_module_bundles_no_libraries():
    """The installed package holds no shared library but the module itself (no second libmlx)."""
    pkg = Path(mlx_k3.__file__).parent
    libs = sorted(p.name for p in pkg.rglob("*.so*"))
    assert len(libs) == 1 and libs[0].startswith("_native."), libs


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_module_links_libmlx_through_runpath():
    """The module needs libmlx.so and finds it next to itself in site-packages ($ORIGIN/../mlx/lib) first."""
    so = next(Path(mlx_k3.__file__).parent.glob("_native.*"))
    dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert "Shared library: [libmlx.so]" in dyn
    runpath = next(line for line in dyn.splitlines() if "RUNPATH" in line or "RPATH" in line)
    assert runpath.split("[", 1)[1].startswith("$ORIGIN/../mlx/lib"), runpath


def test_versions():
    assert mlx_k3.MLX_VERSION == mx.__version__ == "0.32.4"
    assert mlx_k3._native.mlx_version() == "0.32.4"  # the libmlx the Rust side runs on
    assert mlx_k3._native.NANOBIND_VERSION == "3.1.0"


def test_other_mlx_version_is_refused_at_import():
    r = _run("import mlx.core as mx\nmx.__version__ = '0.31.0'\nimport mlx_k3")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:"), r.stderr
    assert "0.32.4" in last and "0.31.0" in last and "pip install" in last


def test_importing_mlx_k3_does_not_import_mlx_lm():
    """The drop-in hooks mlx-lm lazily: kernels alone cost no mlx-lm import."""
    r = _run("import sys, mlx_k3\nprint('mlx_lm' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_stubs_match_the_module():
    """kernels.pyi declares every kernel with the native signature plus ``stream``."""
    import ast
    import inspect

    stub = ast.parse((Path(mlx_k3.__file__).parent / "kernels.pyi").read_text())
    declared = {
        f.name: [a.arg for a in f.args.args + f.args.kwonlyargs] for f in stub.body if isinstance(f, ast.FunctionDef)
    }
    assert set(declared) == set(mlx_k3.kernels.__all__)
    for name, params in declared.items():
        native = list(inspect.signature(getattr(mlx_k3._native, name)).parameters)
        assert params == native + ["stream"], name
