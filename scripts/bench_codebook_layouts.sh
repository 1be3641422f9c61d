#!/usr/bin/env bash
# The codebook's two execution layouts (compact IQ1_S planes, ternary trits) against each other, the affine 2-bit
# kernel and, where a ggml build is given, ggml's IQ1_S, TQ2_0 and q2_K, alternated in rounds (A, B, A, B, ...) so
# that a noisy machine shows as ranges: GEMV 4096 x 14336, the `experts_decode` and `experts_prefill512` shapes of
# benches/qmm.rs (ggml: `MUL_MAT` and `MUL_MAT_ID`), then a table of ratios per round and the memory read
# bandwidth (`mlx-k3 bench --bandwidth`) for the roofline.
#
# Usage: scripts/bench_codebook_layouts.sh [ROUNDS]   (default 3; run from the repository root)
#   GGML_BIN=/path/to/test-backend-ops   also time ggml in every round (needs the local patch below)
#   CPUS=0,1                             pin everything to these CPUs (taskset); threads = their count
#   PROBE=/tmp/codebook_layouts          on a machine loaded by other work: one thread's CPU time instead of
#                                        wall time, ours through benches/probes/codebook_layouts.cpp (build line
#                                        in its header) and ggml with GGML_NT=1 GGML_CPUTIME=1, on the first CPU;
#                                        the probe also times the q8 row kernels alone (`*_rows_k3`: AVX-512 off,
#                                        so no int8 GEMM at the prefill shape), the path before that GEMM
#
# ggml (built outside the repository; none of its code is part of mlx-k3): ggml-org/ggml at d99724f (the newest
# commit on 2026-12-07), after three local edits to tests/test-backend-ops.cpp, then
#   cmake -G Ninja -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON && ninja -C build test-backend-ops
#   1. the thread count from GGML_NT (upstream passes every online CPU, even under taskset): in main(),
#        ggml_backend_set_n_threads_fn(backend.get(), getenv("GGML_NT") ? atoi(getenv("GGML_NT")) : N_THREADS);
#   2. MUL_MAT_ID perf cases at the bench's expert shapes, first in make_test_cases_perf():
#        for (ggml_type type_a : {GGML_TYPE_IQ1_S, GGML_TYPE_TQ2_0, GGML_TYPE_Q2_K}) {
#            test_cases.emplace_back(new test_mul_mat_id(type_a, GGML_TYPE_F32, 16, 16, true, 3072, 1, 3584));
#            test_cases.emplace_back(new test_mul_mat_id(type_a, GGML_TYPE_F32, 128, 8, false, 512, 512, 1024));
#        }
#      decode: the 16 routed experts of `experts_decode` (3584 -> 3072, one token broadcast to the 16); the bench
#      holds 64 experts but routes the same 16 every call, so ggml holding just those 16 reads the same bytes
#      (and quantizing 64 experts to IQ1_S took 7 minutes per run on a loaded machine). prefill: 512 tokens x 8
#      of 128 experts, 1024 -> 512, a row per routed token as `experts_prefill512`.
#   3. in test_case::eval_perf's timing loop, both ggml_time_us() calls replaced by a clock that reads
#      clock_gettime(CLOCK_THREAD_CPUTIME_ID) when GGML_CPUTIME is set (with GGML_NT=1 the CPU backend computes
#      on the calling thread, so that is the kernel's CPU time).
# docs/performance.md ("The codebook's ternary layout") has the figures it gave.
set -euo pipefail
rounds=${1:-3}
cpus=${CPUS:-0,1}
nt=$(echo "$cpus" | tr ',' '\n' | wc -l)
if [ -n "${PROBE:-}" ]; then
    # Thread CPU time on a loaded machine: one thread, ours through the probe, ggml with GGML_CPUTIME.
    cpus=${cpus%%,*} nt=1
else
    cargo bench -p mlx-k3 --bench qmm --no-run >/dev/null 2>&1
    bin=$(ls -t target/release/deps/qmm-* | grep -v '\.d$' | head -1)
    cargo build --release -p mlx-k3-cli >/dev/null 2>&1
fi
filter='(gemv/(codebook_(ternary_)?(q8_)?k3|affine2_(q8_)?k3)/4096x14336|experts_(decode|prefill512)/(codebook_(ternary_)?(q8_)?k3|affine2_(q8_)?k3))$'
types='type_a=(iq1_s|tq2_0|q2_K),type_b=f32'
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# ggml's perf lines -> "group/ggml_TYPE TIME ms" (the group told by the case's shape).
ggml_rows() {
    sed 's/\x1b\[[0-9;]*m//g' | sed -n 's/^ *MUL_MAT[_ID]*(type_a=\([^,]*\),.*,m=\([0-9]*\),n=\([0-9]*\),k=\([0-9]*\).*[^0-9.]\([0-9.]*\) us\/run.*/\1 \2 \3 \4 \5/p' |
        awk '{g = $2 == 4096 ? "gemv" : ($2 == 3072 ? "experts_decode" : "experts_prefill512"); printf "%s/ggml_%s %.4g ms\n", g, $1, $5 / 1000}'
}
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), CPUs $cpus; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
    echo "== round $r (load $(cut -d' ' -f1 /proc/loadavg))"
    if [ -n "${PROBE:-}" ]; then
        out=$(K3_NUM_THREADS=1 taskset -c "$cpus" "$PROBE" 1 10 cpu | awk '
            /^gemv/ {g = "gemv"} /^experts_decode/ {g = "experts_decode"} /^experts_prefill512/ {g = "experts_prefill512"}
            /^  [a-z]/ && / ms / {
                three = ($3 == "avx2" || $3 == "rows")
                v = $1 " " $2 (three ? " " $3 : ""); t = three ? $4 : $3
                m["compact f32"] = "codebook_k3"; m["ternary f32"] = "codebook_ternary_k3"
                m["ternary f32 avx2"] = "codebook_ternary_avx2_k3"; m["compact q8"] = "codebook_q8_k3"
                m["ternary q8"] = "codebook_ternary_q8_k3"; m["affine2 q8"] = "affine2_q8_k3"
                m["compact q8 rows"] = "codebook_q8_rows_k3"; m["ternary q8 rows"] = "codebook_ternary_q8_rows_k3"
                if (v in m) print g "/" m[v], t, "ms"
            }')
    else
        out=$(K3_NUM_THREADS=$nt taskset -c "$cpus" "$bin" --bench --warm-up-time 1 --measurement-time 3 "$filter" 2>/dev/null |
            awk '/^(gemv|experts)[^ ]* +time:/ {print $1, $5, $6; next}
                 /^(gemv|experts)/ {name = $1} /^ +time:/ && name != "" {print name, $4, $5; name = ""}' |
            sed 's|/4096x14336 | |')
    fi
    echo "$out"
    sed "s/^/$r /" <<<"$out" >>"$log"
    if [ -n "${GGML_BIN:-}" ]; then
        g=$( (env GGML_NT=$nt ${PROBE:+GGML_CPUTIME=1} taskset -c "$cpus" "$GGML_BIN" perf -o MUL_MAT -b CPU \
                  -p "$types,m=4096,n=1,k=14336," 2>/dev/null
              env GGML_NT=$nt ${PROBE:+GGML_CPUTIME=1} taskset -c "$cpus" "$GGML_BIN" perf -o MUL_MAT_ID -b CPU \
                  -p "$types,n_mats=(16,n_used=16,b=1,m=3072,n=1,k=3584|128,n_used=8,b=0,m=512,n=512,k=1024)" 2>/dev/null) |
            ggml_rows)
        if [ -z "$g" ]; then
            echo "ggml: no result (is the local patch above applied?)" >&2
        else
            echo "$g"
            sed "s/^/$r /" <<<"$g" >>"$log"
        fi
    fi
done
echo "== speed-ups per round (the other's time / ours: above 1 is ours faster)"
awk -v rounds="$rounds" '
    function ms(v, u) { return u == "s" ? v * 1000 : (u == "ms" ? v : (u == "µs" || u == "us" ? v / 1000 : v / 1e6)) }
    { t[$1, $2] = ms($3, $4) }
    END {
        n = split("gemv experts_decode experts_prefill512", groups, " ")
        n_ours = split("codebook_ternary_q8_k3 codebook_q8_k3 affine2_q8_k3 codebook_ternary_k3 codebook_k3", ours, " ")
        n_base = split("ggml_iq1_s ggml_tq2_0 ggml_q2_K codebook_q8_k3 affine2_q8_k3 codebook_ternary_q8_rows_k3 codebook_q8_rows_k3", base, " ")
        for (g = 1; g <= n; g++)
            for (o = 1; o <= n_ours; o++)
                for (b = 1; b <= n_base; b++) {
                    if (ours[o] == base[b]) continue
                    line = ""
                    for (r = 1; r <= rounds; r++) {
                        a = t[r, groups[g] "/" ours[o]]; c = t[r, groups[g] "/" base[b]]
                        if (a > 0 && c > 0) line = line sprintf(" r%s %.2fx", r, c / a)
                    }
                    if (line != "") print groups[g] ": " ours[o] " vs " base[b] ":" line
                }
    }' "$log"
echo "== read bandwidth (load $(cut -d' ' -f1-3 /proc/loadavg))"
if [ -x target/release/mlx-k3 ]; then
    taskset -c "${CPUS:-0,1}" target/release/mlx-k3 bench --bandwidth
else
    echo "(no target/release/mlx-k3: run cargo build --release -p mlx-k3-cli for the probe)"
fi
