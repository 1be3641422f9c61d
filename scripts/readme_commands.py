#!/usr/bin/env python3
"""Runs every shell command of the README, so that it cannot drift from the program (.ci/run calls this).

Every fenced block whose info string is ``sh`` is executed by bash (``set -euo pipefail``) from the repository
root, one block at a time, with ``target/release`` and ``.venv/bin`` first on ``PATH`` (so ``mlx-k3`` and the
environment's ``python`` with the installed ``mlx_k3`` wheel resolve as they do for a user who followed the
README). A block that exits non-zero, or runs past the time limit, fails the run. Each block runs in its own
process group, which is killed afterwards, so a server a failed block started does not outlive it.

The README's two commands (the run and test commands) are the exception: ``.ci/run`` runs them itself, so
they are skipped here after checking that ``.ci/run`` holds them verbatim. Blocks in other languages
(``text``, ``json``) are not run.

Usage: scripts/readme_commands.py [--list] [--readme README.md] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TWO_COMMANDS = ("cargo run --release --example generate", "cargo test --workspace")


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of every ```sh block."""
    blocks, body, start, lang = [], [], 0, None
    for n, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^```\s*([\w-]*)", line)
        if lang is None and fence:
            lang, start, body = fence.group(1), n + 1, []
        elif lang is not None and line.startswith("```"):
            if lang == "sh":
                blocks.append((start, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    if lang is not None:
        sys.exit(f"README: the block opened at line {start - 1} is never closed")
    return blocks


def without_two_commands(body: str, ci_run: str) -> str:
    kept = []
    for line in body.splitlines():
        command = line.split("#", 1)[0].strip()
        if command in TWO_COMMANDS:
            if command not in ci_run:
                sys.exit(f"README's `{command}` is not what .ci/run runs")
            continue
        kept.append(line)
    return "\n".join(kept)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--timeout", type=float, default=900, help="seconds a block may run (default 900)")
    ap.add_argument("--list", action="store_true", help="print the blocks that would run, run nothing")
    args = ap.parse_args()

    ci_run = (ROOT / ".ci" / "run").read_text()
    blocks = [(n, without_two_commands(b, ci_run)) for n, b in shell_blocks(Path(args.readme).read_text())]
    blocks = [(n, b) for n, b in blocks if b.strip()]
    if not blocks:
        sys.exit("README has no sh blocks to run")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(ROOT / "target" / "release"), str(ROOT / ".venv" / "bin"), env["PATH"]])
    env.pop("VIRTUAL_ENV", None)
    if not args.list and not (ROOT / "target" / "release" / "mlx-k3").exists():
        sys.exit("target/release/mlx-k3 is missing: run `cargo build --release` first")
    failed = []
    for n, body in blocks:
        print(f"== README.md:{n}", flush=True)
        print("\n".join("   $ " + line for line in body.splitlines()), flush=True)
        if args.list:
            continue
        t0 = time.monotonic()
        p = subprocess.Popen(
            ["bash", "-c", "set -euo pipefail\n" + body],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            rc = p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.timeout:.0f} s"
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        print(f"== README.md:{n}: {'ok' if rc == 0 else 'FAILED (' + str(rc) + ')'} in {time.monotonic() - t0:.1f} s",
              flush=True)
        if rc != 0:
            failed.append(n)
    if failed:
        print(f"README blocks that failed (first line): {', '.join(map(str, failed))}", file=sys.stderr)
        return 1
    print(f"all {len(blocks)} README shell blocks ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
