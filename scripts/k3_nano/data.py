"""The k3-nano corpus: the running interpreter's Python standard library sources and its pydoc topics text.

Selection (paths relative to `sysconfig.get_paths()["stdlib"]`, e.g. /root/.pyenv/versions/3.11.7/lib/python3.11):

  * every `*.py` file, recursively, EXCEPT
      - anything under a directory named `test`, `tests` or `idle_test` (test suites and their data),
      - the top-level directories `site-packages` (third-party code), `encodings` (codec tables: walls of
        hex), `idlelib`, `lib2to3`, `tkinter`, `turtledemo`, `distutils`, `ensurepip`, `__phello__`,
        `lib-dynload` and `config-*` (build configuration),
      - the files in EXCLUDED_FILES (machine-generated build data, data tables, the rot13 Zen),
  * `pydoc_data/topics.py` (the language reference / library docs text shipped with the interpreter) is one
    of the selected files like any other.

License: the Python Software Foundation License (PSF-2.0, the interpreter's LICENSE.txt in the same folder),
which permits copying, modification and derivative works with the copyright notice retained.

Split: by FILE. Files are ordered by sha256("k3-nano-heldout:" + relpath); walking that order, a file goes to
the held-out split if it is at most HELDOUT_MAX_FILE_CHARS long and the held-out split is still below
HELDOUT_TARGET_CHARS; `pydoc_data/topics.py` always stays in training. Everything else is training data.
Deterministic for a given stdlib (the script records the Python version and a sha256 of every file).

Document format: each file's text (read as UTF-8, unchanged) is one document, encoded as
[BOS] + tokens(text) + [EOS]; documents are concatenated in sorted relpath order into one token stream.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

EXCLUDED_DIR_NAMES = {"test", "tests", "idle_test"}
EXCLUDED_TOP_DIRS = {
    "site-packages",
    "encodings",
    "idlelib",
    "lib2to3",
    "tkinter",
    "turtledemo",
    "distutils",
    "ensurepip",
    "__phello__",
    "lib-dynload",
    "__pycache__",
}
EXCLUDED_FILES = {
    "this.py",  # rot13-encoded Zen of Python
    "html/entities.py",  # a 75 KB table of HTML entities
    "stringprep.py",  # generated Unicode tables
}
EXCLUDED_PREFIXES = ("_sysconfigdata",)  # machine-specific build data
ALWAYS_TRAIN = {"pydoc_data/topics.py"}

HELDOUT_SALT = "k3-nano-heldout:"
HELDOUT_TARGET_CHARS = 160_000
HELDOUT_MAX_FILE_CHARS = 24_000


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def select_files(root: Path | None = None) -> list[str]:
    root = root or stdlib_dir()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in EXCLUDED_TOP_DIRS or parts[0].startswith("config-"):
            continue
        if any(d in EXCLUDED_DIR_NAMES for d in parts[:-1]):
            continue
        if rel in EXCLUDED_FILES or parts[-1].startswith(EXCLUDED_PREFIXES):
            continue
        out.append(rel)
    return sorted(out)


def read(root: Path, rel: str) -> str:
    return (root / rel).read_bytes().decode("utf-8")


def split(root: Path, files: list[str]) -> tuple[list[str], list[str]]:
    """(train, heldout) relpaths, each sorted."""
    order = sorted(files, key=lambda r: hashlib.sha256((HELDOUT_SALT + r).encode()).hexdigest())
    held, total = [], 0
    for rel in order:
        if total >= HELDOUT_TARGET_CHARS:
            break
        if rel in ALWAYS_TRAIN:
            continue
        n = len(read(root, rel))
        if n == 0 or n > HELDOUT_MAX_FILE_CHARS:
            continue
        held.append(rel)
        total += n
    hs = set(held)
    return sorted(r for r in files if r not in hs), sorted(held)


def manifest(root: Path, train: list[str], held: list[str]) -> list[dict]:
    rows = []
    for split_name, rels in (("train", train), ("heldout", held)):
        for rel in rels:
            data = (root / rel).read_bytes()
            rows.append({"path": rel, "split": split_name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return rows
