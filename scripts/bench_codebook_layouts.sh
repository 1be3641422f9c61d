#!/usr/bin/env bash
# The codebook's two execution layouts (compact IQ1_S planes, ternary trits) against each other, the affine 2-bit
# kernel and, where a ggml build is given, ggml's IQ1_S and TQ2_0, alternated in rounds (A, B, A, B, ...) so that
# a noisy machine shows as ranges: GEMV 4096 x 14336, the `experts_decode` and `experts_prefill512` shapes of
# benches/qmm.rs, then the memory read bandwidth (`mlx-k3 bench --bandwidth`) for the roofline.
#
# Usage: scripts/bench_codebook_layouts.sh [ROUNDS]   (default 3; run from the repository root)
#   GGML_BIN=/path/to/test-backend-ops   also time ggml (MUL_MAT, m=4096 n=1 k=14336) in every round
#   CPUS=0,1                             pin everything to these CPUs (taskset); threads = their count
# docs/performance.md ("The codebook's ternary layout") has the figures it gave and the ggml build.
set -euo pipefail
rounds=${1:-3}
cpus=${CPUS:-0,1}
nt=$(echo "$cpus" | tr ',' '\n' | wc -l)
cargo bench -p mlx-k3 --bench qmm --no-run >/dev/null 2>&1
bin=$(ls -t target/release/deps/qmm-* | grep -v '\.d$' | head -1)
cargo build --release -p mlx-k3-cli >/dev/null 2>&1
filter='(gemv/(codebook_(ternary_)?(q8_)?k3|affine2_(q8_)?k3)/4096x14336|experts_(decode|prefill512)/(codebook_(ternary_)?(q8_)?k3|affine2_(q8_)?k3))$'
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), CPUs $cpus; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
    echo "== round $r"
    K3_NUM_THREADS=$nt taskset -c "$cpus" "$bin" --bench --warm-up-time 1 --measurement-time 3 "$filter" 2>/dev/null |
        awk '/^(gemv|experts)[^ ]* +time:/ {print $1, $5, $6; next}
             /^(gemv|experts)/ {name = $1} /^ +time:/ && name != "" {print name, $4, $5; name = ""}'
    if [ -n "${GGML_BIN:-}" ]; then
        for t in iq1_s tq2_0 q2_K; do
            GGML_NT=$nt taskset -c "$cpus" "$GGML_BIN" perf -o MUL_MAT -b CPU \
                -p "type_a=$t,type_b=f32,m=4096,n=1,k=14336," 2>/dev/null | grep -E 'MUL_MAT' | sed "s/^/ggml $t: /"
        done
    fi
done
echo "== read bandwidth"
taskset -c "$cpus" target/release/mlx-k3 bench --bandwidth
