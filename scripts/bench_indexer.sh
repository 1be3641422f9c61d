#!/usr/bin/env bash
# The DSA indexer decode-step measurement of docs/performance.md ("DSA indexer decode step") in one command:
# the read-bandwidth probe, then twice, alternated, mlx-k3's criterion bench (fused step against MLX's ops) and
# mlx-lm's Indexer (scripts/bench_indexer_mlx_lm.py), then the probe again. Shapes: 4096, 16384 and 65536
# cached positions, top-2048, 32 x 128 (Kimi K3.1) and 64 x 128 (DeepSeek-V3.2) heads, f32 and bf16 keys.
#
# Run from anywhere: scripts/bench_indexer.sh   (PROFILE=dev reuses a debug build: the timed work is the C++
# kernels and MLX either way, but the bandwidth probe then needs a release mlx-k3, so it is skipped)
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${PROFILE:-release}
PY=${PYTHON:-.venv/bin/python}
lscpu | grep -E 'Model name|^CPU\(s\)|L1d|L2|L3' || true
if [ "$PROFILE" = release ]; then
    cargo build --release -p mlx-k3-cli
    probe() { target/release/mlx-k3 bench --bandwidth; }
else
    probe() { echo "bandwidth probe skipped (PROFILE=$PROFILE)"; }
fi
cargo bench -p mlx-k3 --bench indexer --profile "$PROFILE" --no-run
probe
for round in 1 2; do
    echo "== round $round: mlx-k3 (cargo bench --bench indexer)"
    cargo bench -p mlx-k3 --bench indexer --profile "$PROFILE" -- --warm-up-time 1 --measurement-time 3 2>&1 \
        | awk '/^indexer\// {name = $1} /^ +time:/ && name != "" {print name, $4, $5; name = ""}'
    echo "== round $round: mlx-lm (scripts/bench_indexer_mlx_lm.py)"
    "$PY" scripts/bench_indexer_mlx_lm.py
done
probe
