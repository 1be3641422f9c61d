#!/usr/bin/env bash
# The DWQ ledger on k3-nano: three builds (routed experts affine 2-bit with clip search, codebook where it
# fits, routed experts tiered codebook + 14% MXFP4), each distilled with `mlx-k3 dwq` layer-wise and end to
# end (`--mode end-to-end --only-below-8-bits`, 32 steps in all), every build evaluated against the teacher
# before and after on the same held-out windows (exact KL, top-1 flips, perplexity); prints Markdown tables.
# E2E=0 skips the end-to-end runs.
#
# usage: scripts/compress/dwq_ledger.sh [OUT_DIR]     (MLX_K3=path/to/mlx-k3 to pick the binary)
#
# Windows of 256 held-out tokens (models/k3-nano/heldout.safetensors): calibration statistics for the
# conversions use windows 150..213 (as scripts/compress/ledger.sh), DWQ trains on windows 150..165 and
# validates on 40..51, and the evaluation uses windows 0..31: the evaluation windows are disjoint from both.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${MLX_K3:-target/release/mlx-k3}
N=models/k3-nano
D=$N/heldout.safetensors
R=scripts/compress/recipes
OUT=${1:-/tmp/k3-dwq-ledger}
EVAL_WINDOWS=${EVAL_WINDOWS:-32}
STEPS=${DWQ_STEPS:-32}
LR=${DWQ_LR:-1e-4}
VAL_WINDOWS=${DWQ_VAL_WINDOWS:-12}
E2E=${E2E:-1}
mkdir -p "$OUT"
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [ "${K3_BLAS:-}" != reference ] && [ -e $OPENBLAS ]; then
    export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+ $LD_PRELOAD}" OPENBLAS_NUM_THREADS=1
fi

[ -f "$OUT/calib.safetensors" ] || "$B" calibrate --model $N --data $D --ctx 256 --skip 150 --windows 64 \
    --out "$OUT/calib.safetensors" --quiet

builds="experts_a2_clip codebook experts_cb_mxfp4_2_1"
declare -A recipe=([experts_a2_clip]=experts_a2_clip.toml [codebook]=codebook_where_it_fits.toml
                   [experts_cb_mxfp4_2_1]=experts_cb_mxfp4_2_1.toml)
for b in $builds; do
    "$B" convert --from $N --to "$OUT/$b" --recipe "$R/${recipe[$b]}" --calib "$OUT/calib.safetensors" \
        --json --quiet > "$OUT/convert-$b.json"
    /usr/bin/time -f "%e s" -o "$OUT/dwq-$b.time" "$B" dwq --teacher $N --build "$OUT/$b" --data $D --ctx 256 \
        --skip 150 --windows 16 --val-skip 40 --val-windows "$VAL_WINDOWS" --batch 4 --steps "$STEPS" --lr "$LR" \
        --out "$OUT/$b-dwq" --json --quiet > "$OUT/dwq-$b.json"
    ms="$b $b-dwq"
    if [ "$E2E" = 1 ]; then
        /usr/bin/time -f "%e s" -o "$OUT/dwq-$b-e2e.time" "$B" dwq --teacher $N --build "$OUT/$b" --data $D \
            --ctx 256 --skip 150 --windows 16 --val-skip 40 --val-windows "$VAL_WINDOWS" --batch 4 --steps "$STEPS" \
            --lr "$LR" --mode end-to-end --only-below-8-bits --out "$OUT/$b-dwq-e2e" --json --quiet \
            > "$OUT/dwq-$b-e2e.json"
        ms="$ms $b-dwq-e2e"
    fi
    for m in $ms; do
        [ -f "$OUT/eval-$m.json" ] || "$B" eval kl --model "$OUT/$m" --teacher $N --data $D --ctx 256 \
            --windows "$EVAL_WINDOWS" --out "$OUT/eval-$m.json" --quiet > /dev/null
    done
done

python3 - "$OUT" $builds <<'PY'
import json, os, sys
out, builds = sys.argv[1], sys.argv[2:]
print("| build | routed-expert bpw | DWQ | PPL | KL mean | KL p99 | top-1 flips | DWQ validation KL | DWQ time |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
for b in builds:
    d = json.load(open(f"{out}/dwq-{b}.json"))["dwq"]
    t = open(f"{out}/dwq-{b}.time").read().split()[0]
    rows = [(b, "before", d["val_kl_before"], ""), (b + "-dwq", "layer-wise", d["val_kl_after"], t + " s")]
    if os.path.exists(f"{out}/dwq-{b}-e2e.json"):
        e = json.load(open(f"{out}/dwq-{b}-e2e.json"))["dwq"]
        te = open(f"{out}/dwq-{b}-e2e.time").read().split()[0]
        rows.append((b + "-dwq-e2e", "end-to-end", e["val_kl_after"], te + " s"))
    for m, tag, v, tt in rows:
        r = json.load(open(f"{out}/eval-{m}.json"))
        print(f"| {b} | {r['size']['routed_expert_bpw']:.3f} | {tag} | {r['ppl']:.3f} | {r['kl_mean']:.5f} "
              f"| {r['kl_p99']:.4f} | {100 * r['top1_flip_rate']:.2f}% | {v:.5f} | {tt} |")
print()
print("| build | layer | val KL before | val KL after | change | rollbacks | lr kept |")
print("|---|---:|---:|---:|---:|---:|---:|")
for b in builds:
    d = json.load(open(f"{out}/dwq-{b}.json"))["dwq"]
    for x in d["blocks"]:
        kept = [a for a in x["attempts"] if a["kept"]]
        lr = f"{kept[0]['lr']:.2g}" if kept else "kept as built"
        ch = 100 * (x["val_kl_after"] / x["val_kl_before"] - 1)
        print(f"| {b} | {x['layer']} | {x['val_kl_before']:.5f} | {x['val_kl_after']:.5f} | {ch:+.1f}% "
              f"| {x['rollbacks']} | {lr} |")
PY
