#!/usr/bin/env bash
# The compression ledger on k3-nano: calibrate, convert/prune per recipe, evaluate every build against the
# teacher on the same held-out windows (exact KL), then print a Markdown table.
#
# usage: scripts/compress/ledger.sh [OUT_DIR]     (MLX_K3=path/to/mlx-k3 to pick the binary)
#
# Windows: held-out tokens (models/k3-nano/heldout.safetensors) in windows of 256; calibration uses windows
# 150..213, evaluation windows 0..31 (disjoint).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${MLX_K3:-target/release/mlx-k3}
N=models/k3-nano
D=$N/heldout.safetensors
R=scripts/compress/recipes
OUT=${1:-/tmp/k3-ledger}
EVAL_WINDOWS=${EVAL_WINDOWS:-32}
mkdir -p "$OUT"
# The Linux MLX CPU wheel links the reference BLAS; Debian's OpenBLAS (single-threaded, deterministic) makes
# the forward passes ~3x faster here. K3_BLAS=reference keeps the wheel's BLAS.
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [ "${K3_BLAS:-}" != reference ] && [ -e $OPENBLAS ]; then
    export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+ $LD_PRELOAD}" OPENBLAS_NUM_THREADS=1
fi

[ -f "$OUT/calib.safetensors" ] || "$B" calibrate --model $N --data $D --ctx 256 --skip 150 --windows 64 \
    --out "$OUT/calib.safetensors" --quiet

convert() { # name recipe [--calib]
    local name=$1 recipe=$2; shift 2
    "$B" convert --from $N --to "$OUT/$name" --recipe "$R/$recipe" "$@" --json --quiet > "$OUT/convert-$name.json"
}
convert a4 a4.toml
convert q8 q8.toml
convert experts_a4 experts_a4.toml
convert experts_a2_minmax experts_a2_minmax.toml
convert experts_a2_clip_unweighted experts_a2_clip.toml
convert experts_a2_clip experts_a2_clip.toml --calib "$OUT/calib.safetensors"
convert experts_tiered_12 experts_tiered_12.toml --calib "$OUT/calib.safetensors"
convert experts_tiered_25 experts_tiered_25.toml --calib "$OUT/calib.safetensors"
convert codebook_unweighted codebook_where_it_fits_unweighted.toml --calib "$OUT/calib.safetensors"
convert codebook codebook_where_it_fits.toml --calib "$OUT/calib.safetensors"
convert experts_cb_mxfp4_1_8 experts_cb_mxfp4_1_8.toml --calib "$OUT/calib.safetensors"
convert experts_cb_mxfp4_2_1 experts_cb_mxfp4_2_1.toml --calib "$OUT/calib.safetensors"
for keep in 12 8; do
    "$B" prune --model $N --keep $keep --stats "$OUT/calib.safetensors" --to "$OUT/reap$keep" --json --quiet \
        > "$OUT/prune-$keep.json"
done

builds="teacher a4 q8 experts_a4 experts_a2_minmax experts_a2_clip_unweighted experts_a2_clip experts_tiered_12
        experts_tiered_25 experts_cb_mxfp4_1_8 experts_cb_mxfp4_2_1 codebook_unweighted codebook reap12 reap8"
for b in $builds; do
    dir="$OUT/$b"; [ "$b" = teacher ] && dir=$N
    [ -f "$OUT/eval-$b.json" ] || "$B" eval kl --model "$dir" --teacher $N --data $D --ctx 256 \
        --windows "$EVAL_WINDOWS" --out "$OUT/eval-$b.json" --quiet > /dev/null
done

python3 - "$OUT" $builds <<'PY'
import json, sys
out, builds = sys.argv[1], sys.argv[2:]
print("| build | bytes | bpw (all) | bpw (routed experts) | PPL | KL mean | KL p99 | top-1 flips |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for b in builds:
    r = json.load(open(f"{out}/eval-{b}.json"))
    s = r["size"]
    print(f"| {b} | {s['bytes']:,} | {s['bits_per_weight']:.3f} | {s['routed_expert_bpw']:.3f} | {r['ppl']:.3f} "
          f"| {r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {100 * r['top1_flip_rate']:.2f}% |")
PY
