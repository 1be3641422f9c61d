#!/bin/sh
# Draft models for speculative decoding with k3-nano, made from k3-nano itself (nothing is committed):
#   OUT/k3-nano-a4      every weight affine 4-bit (scripts/compress/recipes/a4.toml)
#   OUT/k3-nano-reap8   REAP pruning to 8 of 16 experts per MoE layer (calibrated on held-out windows)
# Usage: scripts/speculative/make_drafts.sh [MLX_K3_BINARY] [OUT]   (from the repository root)
set -eu
M=${1:-target/release/mlx-k3}
OUT=${2:-/tmp/k3-drafts}
N=models/k3-nano
D=$N/heldout.safetensors
mkdir -p "$OUT"
"$M" convert --from $N --to "$OUT/k3-nano-a4" --recipe scripts/compress/recipes/a4.toml --overwrite --quiet
"$M" calibrate --model $N --data $D --ctx 256 --skip 150 --windows 16 --out "$OUT/calib.safetensors"
"$M" prune --model $N --keep 8 --stats "$OUT/calib.safetensors" --to "$OUT/k3-nano-reap8" --overwrite --quiet
echo "drafts in $OUT: k3-nano-a4, k3-nano-reap8"
